"""Session-wide set-up shared by every test folder."""

import os
import sys
from collections.abc import Iterator

import pytest

from megatron_fsdp_v2.testing import preload_in_server

sys.path.insert(0, os.path.dirname(__file__))
from _fresh_python import FreshPython  # noqa: E402

# Test-only dependencies that many ranks import (the Hugging Face model classes take about 3 s
# of CPU per process; torchao's float8 about 1 s): imported once by the rank pools' fork server
# instead of once per rank (see [Note: ranks fork from a preloaded server]). Missing packages
# are skipped there; the tests that need them skip themselves. Both ask torch about CUDA at
# import, so where torch sees a GPU they are not preloaded (ranks forked after that question
# could not use CUDA; tests/test_fork_server_cuda.py).
preload_in_server(
    "torchao.float8",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
)


@pytest.fixture(scope="session")
def fresh_python() -> Iterator[FreshPython]:
    """``fresh_python.run(code)``: ``python -c code`` forked from a server that imported torch
    once (see ``tests/_fresh_python.py``)."""
    server = FreshPython()
    yield server
    server.close()
