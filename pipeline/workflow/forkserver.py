"""A fork server for stage processes: torch, transformers and the stage modules imported once per workflow run.

A stage process imports torch and transformers before its first line of work; on the tiny configurations that is
most of every job (docs/workflow.md, Stage processes and the fork server). With `runtime.fork_server: true` the Snakefile's `onstart` starts
this server (`python -m pipeline.workflow.forkserver SOCKET`), which imports them once and then serves stage
commands: `python -m stages.X ...` started with `CREDITRL_FORK_SERVER` set hands its arguments, working directory,
environment and its standard streams to the server and waits (`pipeline.workflow.launcher`); the server forks a
child that runs `stages.X` as `__main__` with them. The job's command line, its log file and its exit status are
those of a plain process.

- The server is single-threaded and runs no computation: forked children of a process whose OpenMP (torch) or
  rayon (polars) thread pools have run would hang in their first parallel region.
- A child's environment is the job's (thread counts included: `pipeline.workflow.threads` applies them); its
  random generators are reseeded from the OS, as a fresh process's are.
- A child dies with its launcher: it watches the connection and kills itself when the launcher is gone (a job
  killed by Snakemake, a test, or a user). SIGTERM, SIGINT and SIGHUP sent to the launcher are passed on.
- The server exits when the Snakemake process that started it is gone, or on SIGTERM.
- Snakemake's benchmark files then measure the launcher, not the child: their memory columns are the launcher's.
  The child logs its own peak (`time/peak_rss_mb`), which `bench.breakdown` and `bench.real_size` read instead.
- Once a project module the server imported changes on disk, it refuses every request and the launchers run their
  stages themselves, with the new code (a stage's own module is read afresh by every child anyway).
- Anything that goes wrong on the way (no server, a refused connection) makes the launcher run the stage itself.
"""

from __future__ import annotations

import importlib
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.config.allocator import environ
from pipeline.workflow.launcher import ENV, recv, send
from pipeline.workflow.registry import STAGES

# --- Snakemake's side: started in `onstart`, stopped in `onsuccess` and `onerror` ---------------------------------

_server: dict = {}


def start(enabled: bool, allocator: str = "auto", timeout: float = 120.0, cwd: str | Path | None = None) -> None:
    """Start the server for this workflow run (`runtime.fork_server`), importing the code that `python -m` finds
    in `cwd` (default: this process's), with the memory allocator `allocator` (`runtime.allocator`: its forks run
    the stages), and export its socket to the jobs; a server that does not come up in `timeout` seconds is
    reported and the jobs run as plain processes."""
    if not enabled or _server:
        return
    # a Unix socket's path holds at most 107 bytes: a short folder, whatever TMPDIR says
    folder = Path(tempfile.mkdtemp(prefix="creditrl-fork-", dir="/tmp" if os.path.isdir("/tmp") else None))
    path, log = folder / "socket", folder / "server.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.workflow.forkserver", str(path), str(os.getpid())],
                                stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True, cwd=cwd,
                                env=environ(allocator))
    deadline = time.monotonic() + timeout
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not path.exists():
        proc.kill()
        print(f"runtime.fork_server: the fork server did not start, the stages run as plain processes:\n"
              f"{log.read_text()[-2000:]}", file=sys.stderr)
        return
    _server.update(proc=proc, folder=folder)
    os.environ[ENV] = str(path)


def stop() -> None:
    """Stop the server (and remove its socket's folder)."""
    if not _server:
        return
    os.environ.pop(ENV, None)
    proc, folder = _server.pop("proc"), _server.pop("folder")
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()


# --- the server ----------------------------------------------------------------------------------------------------

def preload() -> None:
    """What every model stage imports, and the stage modules themselves (their top levels run no computation).
    CUDA must stay uninitialised here (a forked child cannot use a CUDA its parent initialised): torch checks for a
    GPU through NVML instead, and `serve` refuses to serve if CUDA was initialised all the same."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM  # noqa: F401
    from transformers.generation import utils  # noqa: F401

    for stage in sorted({s.base for s in STAGES}):   # the modules the registry's commands run (`python -m stages.X`)
        importlib.import_module(f"stages.{stage}")


def _child(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In the forked child: become the job's process and run its stage; never returns."""
    import atexit
    import random
    import runpy
    import threading
    import traceback

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.pop(ENV, None)                       # what the stage starts runs as plain processes
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()

    def watch():                                    # the launcher gone: so is the job
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()
    module = request["module"]
    sys.argv = [module, *request["args"]]
    code = 0
    try:
        from pipeline.workflow.threads import configure  # start-up cost: as above (YAML)

        configure()
        sys.modules.pop(module, None)               # runs as __main__, as `python -m` runs it (runpy warns otherwise)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            code = 1
        else:
            code = e.code or 0
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, then status 1
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _mtime(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1


def project_files() -> dict[str, int]:
    """The modification times of the project's modules this process has imported (`pipeline`, `stages`)."""
    return {path: _mtime(path) for name, module in list(sys.modules.items())
            if (path := getattr(module, "__file__", None)) and name.split(".")[0] in ("pipeline", "stages")}


def _changed(files: dict[str, int]) -> str | None:
    """The first of `files` whose modification time is no longer the recorded one."""
    return next((path for path, mtime in files.items() if _mtime(path) != mtime), None)


def serve(path: str, parent: int | None = None) -> None:
    """Import, then listen on the Unix socket `path` until the process `parent` is gone or SIGTERM comes. Once a
    project module it imported has changed on disk, it refuses every request (the launchers run their stages
    themselves, with the new code) and exits when its running children are done."""
    preload()
    if sys.modules["torch"].cuda.is_initialized():
        raise SystemExit("fork server: CUDA was initialised while importing; a forked stage could not use it, so "
                         "the stages run as plain processes")
    files = project_files()
    sys.stdout.flush()
    sys.stderr.flush()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{path}.tmp"
    listener.bind(tmp)
    listener.listen(64)
    os.rename(tmp, path)                            # the socket appears once the server is ready
    running: dict[int, socket.socket] = {}          # child pid -> its launcher's connection
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    try:
        while not stop and (parent is None or os.getppid() == parent) and (listener is not None or running):
            ready, _, _ = select.select([listener] if listener is not None else [], [], [], 0.2)
            if ready:
                conn, _ = listener.accept()
                try:
                    request, fds = recv(conn, with_fds=3)
                except (OSError, ConnectionError, ValueError):
                    conn.close()
                    continue
                if (changed := _changed(files)) is not None:
                    print(f"fork server: {changed} changed since it was imported; the stages run as plain "
                          "processes from now on", file=sys.stderr, flush=True)
                    for fd in fds:
                        os.close(fd)
                    _refuse(conn)
                    listener.close()
                    listener = None
                    os.unlink(path)
                    continue
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in running.values():
                        other.close()
                    _child(conn, request, fds)
                for fd in fds:
                    os.close(fd)
                running[pid] = conn
                try:
                    send(conn, {"pid": pid})
                except OSError:
                    pass
            _reap(running)
    finally:
        if listener is not None:
            listener.close()
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _refuse(conn: socket.socket) -> None:
    try:
        send(conn, {"refused": True})
    except OSError:
        pass
    conn.close()


def _reap(running: dict[int, socket.socket]) -> None:
    """Report every finished child's status to its launcher."""
    while running:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = running.pop(pid, None)
        if conn is None:
            continue
        if os.WIFSIGNALED(status):
            report = {"code": 128 + os.WTERMSIG(status), "signal": os.WTERMSIG(status)}
        else:
            report = {"code": os.WEXITSTATUS(status)}
        try:
            send(conn, report)
        except OSError:
            pass
        conn.close()


USAGE = """usage: python -m pipeline.workflow.forkserver -- COMMAND ...   (e.g. -- dvc repro)
       python -m pipeline.workflow.forkserver SOCKET [PARENT_PID]

The first form runs COMMAND with a fork server for the stages it starts (DVC has no start hook; Snakemake starts
its own with runtime.fork_server) and exits with COMMAND's status. The second serves on SOCKET."""


def main(argv=None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--"] and len(args) > 1:
        start(True)
        try:
            code = subprocess.run(args[1:]).returncode
        finally:
            stop()
        raise SystemExit(code)
    if len(args) not in (1, 2) or args[0].startswith("-"):
        raise SystemExit(USAGE)
    serve(args[0], int(args[1]) if len(args) == 2 else None)


if __name__ == "__main__":
    main()
