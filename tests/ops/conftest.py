import os
import sys

# The test modules import their shared helpers (_fp8.py, _flat_buffer.py) by name.
sys.path.insert(0, os.path.dirname(__file__))

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import megatron_fsdp_v2.ops as mops  # noqa: E402


@pytest.fixture
def use_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The public wrappers call the C++/CUDA kernels, whatever MFSDP_USE_REFERENCE_OPS says."""
    monkeypatch.setattr(mops, "_impl", torch.ops.megatron_fsdp_v2)


@pytest.fixture
def four_threads() -> Iterator[None]:
    """Several CPU threads, so one segment is split across threads (the amax combine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)
