"""Transitional re-exports: the old home of the state-dict plumbing, now split into
``_dtensor/_chunk_metadata.py`` (DCP chunk metadata and the row marker), ``_dtensor/_local_rows.py``
(local-rows DTensors), ``_runtime/_state_dict_hooks.py`` (the units' and optimizers' state-dict
hooks), ``_runtime/_state_dict_checks.py`` (keys and shapes against the model). Kept only
for the callers that still import these names from here (``_redistribute.py``,
``_torch_full_state_dict.py``, ``_frontend/_fully_shard.py``); new code imports from the
modules above, and this file goes once those callers do.
"""

from __future__ import annotations

from .._runtime._state_dict_hooks import load_state_dict_pre_hook, state_dict_post_hook
from ._chunk_metadata import ROWS_ATTR, mark_rows

__all__ = ["ROWS_ATTR", "load_state_dict_pre_hook", "mark_rows", "state_dict_post_hook"]
