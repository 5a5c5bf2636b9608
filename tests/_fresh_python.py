"""``python -c CODE`` for tests that need a fresh interpreter, without paying torch's import each
time: every program runs in a process forked from one server that imported torch (and nothing of
this library, transformers or torchao), as ``__main__``, with the caller's environment and working
directory. What a program imports, patches or sets stays in its own forked process.

The tests that use it check what importing the library does (hooks installed, torch objects
patched, environment variables read at import, the stale-build error): each is a fresh import of
``megatron_fsdp_v2`` in a process that has torch already, as a user's script has.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys

_SERVER = r"""
import json, os, sys, tempfile, traceback
import torch  # the point of the server: imported once, before forking

for line in sys.stdin:
    request = json.loads(line)
    with tempfile.TemporaryDirectory() as tmp:
        out_path, err_path = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            with open(out_path, "w") as out, open(err_path, "w") as err:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                os.environ.clear()
                os.environ.update(request["env"])
                os.chdir(request["cwd"])  # sys.path[0] is "" (python -c): the new directory
                try:
                    exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
                    code = 0
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                    if not isinstance(e.code, (int, type(None))):
                        print(e.code, file=sys.stderr)
                except BaseException:
                    traceback.print_exc()
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        with open(out_path) as out, open(err_path) as err:
            reply = [os.waitstatus_to_exitcode(status), out.read(), err.read()]
    print(json.dumps(reply), flush=True)
"""


class FreshPython:
    """A server that forks one ``python -c``-like process per :meth:`run`; see the module doc."""

    def __init__(self) -> None:
        self._server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)

    def run(self, code: str, *, env: dict[str, str] | None = None, cwd: str | None = None,
            timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``code`` as ``python -c code`` would (with torch imported); raises
        ``CalledProcessError`` on a non-zero exit when ``check``, ``TimeoutError`` after
        ``timeout`` seconds (the server is stopped then)."""
        assert self._server.stdin is not None and self._server.stdout is not None
        request = {"code": code, "env": dict(os.environ if env is None else env),
                   "cwd": os.getcwd() if cwd is None else str(cwd)}
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        ready, _, _ = select.select([self._server.stdout], [], [], timeout)
        if not ready:
            self.close()
            raise TimeoutError(f"the program did not finish within {timeout:.0f} s:\n{code}")
        line = self._server.stdout.readline()
        if not line:
            raise RuntimeError(f"the fresh-python server exited (code {self._server.poll()})")
        returncode, stdout, stderr = json.loads(line)
        proc = subprocess.CompletedProcess(["python", "-c", code], returncode, stdout, stderr)
        if check and returncode != 0:
            raise subprocess.CalledProcessError(returncode, proc.args, stdout, stderr)
        return proc

    def close(self) -> None:
        """Stop the server (its children have all exited)."""
        if self._server.poll() is None:
            self._server.kill()
        self._server.wait()
