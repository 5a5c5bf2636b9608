"""``python -m megatron_fsdp_v2.estimate``: every strategy side by side for one model preset.

The command line; the function is ``megatron_fsdp_v2.estimate`` (``_estimate.py``). Importing
this module (``import megatron_fsdp_v2.estimate``) rebinds the package attribute ``estimate``
to it, so the module is made callable: ``megatron_fsdp_v2.estimate(...)`` estimates either way.
"""

import sys
import types
from typing import Any

from ._estimate import Estimate, estimate, main

__all__ = ["Estimate", "estimate", "main"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Estimate:
        return estimate(*args, **kwargs)


if __name__ == "__main__":
    main()
else:
    sys.modules[__name__].__class__ = _CallableModule
