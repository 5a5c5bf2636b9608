"""Session-wide set-up shared by every test folder."""

import os
import shlex
import subprocess
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


@pytest.fixture(scope="session")
def launched_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An executable that runs like ``python ARGS``, for torchrun and the ranks it starts
    (``<it> -m torch.distributed.run --no-python ... <it> script.py ...``): the launcher and
    each rank forked from one ``tests/_forked_programs.py`` server that imported torch and the
    library, so a launch pays those imports (about 2-3 s of CPU per process) once per session
    instead of once per process. The
    script still runs as ``__main__`` in a process of its own with torchrun's environment, its
    own process group, teardown and exit status (the client exits with the program's). The
    server starts in the environment the launches use (CPU only, one OpenMP thread)."""
    folder = tmp_path_factory.mktemp("launched_python")
    server_socket = str(folder / "server.sock")
    forked = os.path.join(os.path.dirname(__file__), "_forked_programs.py")
    server = subprocess.Popen([sys.executable, forked, "serve", server_socket],
                              env=dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1"),
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline() == "ready\n", \
            "the launched-python server did not start"
        wrapper = folder / "python"
        wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -S "
                           f"{shlex.quote(forked)} run {shlex.quote(server_socket)} \"$@\"\n")
        wrapper.chmod(0o755)
        yield str(wrapper)
    finally:
        server.kill()
        server.wait(timeout=30)
