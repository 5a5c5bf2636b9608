"""A stand-in for ``python`` that runs each program forked from one interpreter that imported
torch and the library once.

    python tests/_forked_programs.py serve SOCKET        # prints "ready", then serves until killed
    python tests/_forked_programs.py serve SOCKET torch  # the same, the library not imported
    python -S tests/_forked_programs.py run SOCKET ARGS  # as `python ARGS`: a script, -c or -m

A program started with ``python program.py`` pays the imports (about 3 s of CPU, more when
DTensor pulls in torch._dynamo) before it does anything; scripts/gpu_check.sh's dry run starts
six such programs and the ``--self-test`` runs three more, which then spent most of their time
importing. ``run`` is a client that needs nothing but the standard library (a few milliseconds
to start): it hands its argument list, working directory, environment and standard streams (the
file descriptors themselves) to the server, and exits with the program's exit status. The
server forks a supervisor per request, which forks the program: a process group of its own, the
client's streams as 0, 1 and 2, its directory, environment and ``sys.argv``, run as
``__main__``. The supervisor reports the exit status (128 + N after signal N, as a shell does);
if the client dies first (``timeout`` sent it SIGTERM), it kills the program's process group,
so a timed-out step leaves nothing running. The server never runs torch code (no process group,
no OpenMP region) before forking, so each program starts as a fresh interpreter would, except
that the imports are done; what a program patches or leaves in the library stays in its process.

Environment variables torch reads at import come from the server's start (tests/test_gpu_check.py
starts it with the environment it runs gpu_check.sh with).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys
import traceback

_HEADER = struct.Struct("!Q")  # the request's length, sent with the three stream descriptors


def _recv_exactly(conn: socket.socket, size: int, data: bytes = b"") -> bytes:
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the client closed the connection mid-request")
        data += chunk
    return data


# ---------------------------------------------------------------------------------- the client

def client(path: str, argv: list[str]) -> int:
    """Run ``python argv`` on the server at ``path``; its exit status."""
    request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        socket.send_fds(conn, [_HEADER.pack(len(request))], [0, 1, 2])
        conn.sendall(request)
        # Blocks until the program ends. Killed meanwhile (SIGTERM from `timeout`), this process
        # exits and closes the connection: the supervisor then kills the program.
        reply = conn.recv(64)
    if not reply:
        print("_forked_programs: the server closed the connection without an exit status",
              file=sys.stderr)
        return 1
    return int(reply)


# ---------------------------------------------------------------------------------- the server

def serve(path: str, library: bool = True) -> None:
    """Import torch and (``library``) the library, then fork a supervisor per connection,
    forever. Without the library: for programs that check what importing it does."""
    import torch  # noqa: F401 - imported once, before forking: the point of the server
    import torch._dynamo  # noqa: F401 - DTensor.from_local imports it on first use (seconds)

    if library:
        # The library of this checkout, as scripts/gpu_checks/_common.py imports it.
        sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import megatron_fsdp_v2  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the supervisor waits for its child
            try:
                _supervise(conn)
            finally:
                os._exit(1)
        conn.close()


def _supervise(conn: socket.socket) -> None:
    """In the forked supervisor: start the program, then report its exit status, or kill it if
    the client goes away first."""
    header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
    header = _recv_exactly(conn, _HEADER.size, header)
    request = json.loads(_recv_exactly(conn, _HEADER.unpack(header)[0]))
    pid = os.fork()
    if pid == 0:
        conn.close()
        _program(request, fds)
    try:
        os.setpgid(pid, pid)  # as the program does itself: whichever runs first
    except OSError:
        pass
    for fd in fds:
        os.close(fd)  # the program's streams: only the program may hold them open
    pidfd = os.pidfd_open(pid)
    readable, _, _ = select.select([conn, pidfd], [], [])
    if pidfd not in readable:  # the client died (killed by `timeout`): so does the program
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    try:
        os.killpg(pid, signal.SIGKILL)  # whatever it left behind (a fork server, say)
    except ProcessLookupError:
        pass
    conn.sendall(str(code if code >= 0 else 128 - code).encode())
    os._exit(0)


def _program(request: dict, fds: list[int]) -> None:
    """In the forked program: ``python argv`` with the client's streams, directory and
    environment. Never returns."""
    os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    code = 1
    try:
        if argv[:1] == ["-c"] and len(argv) >= 2:
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        elif argv[:1] == ["-m"] and len(argv) >= 2:
            import runpy

            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv and not argv[0].startswith("-"):
            import runpy

            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        else:
            raise SystemExit(f"_forked_programs: unsupported python arguments {argv}: a script, "
                             "-c CODE or -m MODULE (extend _program to run this)")
        code = 0
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported like an uncaught exception would be
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed by the program: python ignores that at exit too
            pass
    os._exit(code)  # no interpreter teardown: the server's imports are not the program's


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"] and len(sys.argv) == 3:
        serve(sys.argv[2])
    elif sys.argv[1:2] == ["serve"] and sys.argv[3:] == ["torch"]:
        serve(sys.argv[2], library=False)
    elif sys.argv[1:2] == ["run"] and len(sys.argv) >= 3:
        sys.exit(client(sys.argv[2], sys.argv[3:]))
    else:
        sys.exit(f"usage: {sys.argv[0]} serve SOCKET [torch] | run SOCKET ARGS...")
