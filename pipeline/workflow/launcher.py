"""The client side of the fork server (`pipeline.workflow.forkserver`): `python -m stages.X ...` started with
`CREDITRL_FORK_SERVER` set hands its command to the server (`stages/__init__.py` calls `delegate`), and the
messages both sides exchange. Light on purpose: it runs before a stage imports anything, and imports neither the
server nor the stages.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

ENV = "CREDITRL_FORK_SERVER"
_HEADER = struct.Struct("!I")


def send(sock: socket.socket, obj, fds: list[int] = ()) -> None:
    data = json.dumps(obj).encode()
    msg = _HEADER.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [msg], list(fds))
    else:
        sock.sendall(msg)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return buf


def recv(sock: socket.socket, with_fds: int = 0):
    fds: list[int] = []
    if with_fds:
        head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, with_fds)
        if len(head) < _HEADER.size:
            head += _recv_exact(sock, _HEADER.size - len(head))
    else:
        head = _recv_exact(sock, _HEADER.size)
    (n,) = _HEADER.unpack(head)
    return json.loads(_recv_exact(sock, n)), fds


def launched_stage() -> tuple[str, list[str]] | None:
    """(module, arguments) when this process was started as `python [options] -m stages.X ...` outside torchrun
    (whose workers keep their own processes), else None."""
    argv = list(getattr(sys, "orig_argv", []))
    if "-m" not in argv or "LOCAL_RANK" in os.environ:
        return None
    i = argv.index("-m")
    if i + 1 >= len(argv) or not argv[i + 1].startswith("stages."):
        return None
    return argv[i + 1], argv[i + 2:]


def delegate(module: str, args: list[str]) -> None:
    """Run `module` with `args` in a child of the fork server and exit with its status; return (and let the caller
    run the stage itself) when no server answers."""
    path = os.environ.get(ENV)
    if not path:
        return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        send(sock, {"module": module, "args": args, "cwd": os.getcwd(), "env": dict(os.environ)}, [0, 1, 2])
        started, _ = recv(sock)
    except (OSError, ConnectionError, ValueError):
        sock.close()
        return
    if started.get("refused"):                      # the project's code changed since the server imported it
        sock.close()
        return
    child = started["pid"]

    def forward(sig, _frame):
        try:
            os.kill(child, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    try:
        status, _ = recv(sock)
    except (OSError, ConnectionError, ValueError):
        status = {"code": 1}                        # the server died under the child: a failed job
    sock.close()
    if status.get("signal"):                        # killed by a signal: die of the same one, as the child did
        signal.signal(status["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), status["signal"])
    os._exit(status["code"])
