"""``python -c CODE`` for tests that need a fresh interpreter, without paying torch's import each
time: the program runs forked from a ``tests/_forked_programs.py`` server that imported torch but
not this library (nor transformers or torchao), with the caller's environment and directory.

The tests that use it check what importing the library does (hooks installed, torch objects
patched, environment variables read at import, the stale-build error): each is a fresh import of
``megatron_fsdp_v2`` in a process that has torch already, as a user's script has.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

_FORKED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_forked_programs.py")


class FreshPython:
    """The server (started here) and :meth:`run`; see the module doc."""

    def __init__(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self._socket = os.path.join(self._tmp.name, "server.sock")
        self._server = subprocess.Popen([sys.executable, _FORKED, "serve", self._socket, "torch"],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        text=True)
        assert self._server.stdout is not None
        if self._server.stdout.readline() != "ready\n":
            self.close()
            raise RuntimeError("the fresh-python server did not start")

    def run(self, code: str, *, env: dict[str, str] | None = None, cwd: str | None = None,
            timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``subprocess.run([python, "-c", code], capture_output=True, text=True, ...)`` with
        torch imported already (the client is killed after ``timeout``: so is the program).
        ``check``: a non-zero exit fails with the program's output in the message."""
        proc = subprocess.run([sys.executable, "-S", _FORKED, "run", self._socket, "-c", code],
                              env=env, cwd=cwd, timeout=timeout, capture_output=True, text=True)
        if check and proc.returncode != 0:
            raise AssertionError(f"python -c exited with {proc.returncode}:\n{code}\n"
                                 f"--- stdout ---\n{proc.stdout}--- stderr ---\n{proc.stderr}")
        return proc

    def close(self) -> None:
        """Stop the server (programs already run have exited)."""
        self._server.kill()
        self._server.wait()
        self._tmp.cleanup()
