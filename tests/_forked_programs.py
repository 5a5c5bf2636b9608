"""Run several Python programs, each as ``__main__`` in a process of its own, forked from one
interpreter that imported torch and the library once.

    python tests/_forked_programs.py '[["path/to/program.py", "--flag", ...], ...]'

prints one JSON list: ``[returncode, stdout, stderr]`` per program, in order. A program started
with ``python program.py`` pays the imports (about 3 s of CPU, more when DTensor pulls in
torch._dynamo) before it does anything; tests that run several small programs (the GPU check's
``--self-test`` runs) pay them once here. Each program runs in a forked child, so whatever it
patches or leaves in the library stays in that child; the parent never runs torch code (no
process group, no OpenMP region) before forking.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
import traceback

import torch  # noqa: F401 - imported once, before forking: the point of this runner
import torch._dynamo  # noqa: F401 - DTensor.from_local imports it on first use (seconds)

# The library of this checkout, as scripts/gpu_checks/_common.py imports it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import megatron_fsdp_v2  # noqa: E402, F401


def _child(argv: list[str], out_path: str, err_path: str) -> None:
    """In the forked child: ``argv[0]`` as ``__main__``, its output in the two files."""
    code = 1
    with open(out_path, "w") as out, open(err_path, "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        try:
            runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - reported like an uncaught exception would be
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)  # no interpreter teardown in the child: the parent still owns everything


def run(commands: list[list[str]]) -> list[tuple[int, str, str]]:
    """``[returncode, stdout, stderr]`` of each command (a program path and its arguments)."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, argv in enumerate(commands):
            out_path = os.path.join(tmp, f"{i}.out")
            err_path = os.path.join(tmp, f"{i}.err")
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(argv, out_path, err_path)
            _, status = os.waitpid(pid, 0)
            with open(out_path) as out, open(err_path) as err:
                results.append((os.waitstatus_to_exitcode(status), out.read(), err.read()))
    return results


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
