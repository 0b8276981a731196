"""Model-written Python run where it can harm nothing: a fresh child process per program, in bubblewrap's namespaces,
under rlimits and a wall-clock limit (issue: the code-interpreter environment; docs/environments.md).

Each program runs as `python3 -I -B prog.py` (the system interpreter, isolated mode) inside `bwrap` with:

- **namespaces** (`--unshare-all`): no network (an empty network namespace: a connect fails at once), its own PID
  namespace (the trainer and every other process are invisible; `os.kill` of the trainer's pid finds nothing), a
  fresh `/proc`, its own IPC and hostname; as root the child drops to uid/gid 65534 (nobody) before bwrap starts,
  so the user namespace maps to an unprivileged user;
- **files**: `/usr` read-only (the interpreter and its standard library) and nothing else of the machine: no
  project folder, no home, no `/etc`; a private `/tmp` (tmpfs, gone with the program) and a working directory
  `/tmp/work` that holds the program and is deleted after it;
- **environment**: cleared, then `PATH`, `HOME` and `LANG` only;
- **rlimits**: CPU seconds (`RLIMIT_CPU`), address space (`RLIMIT_AS`), processes of the sandbox's user
  (`RLIMIT_NPROC`: a fork bomb stops at the cap), file size (`RLIMIT_FSIZE`: also stdout and stderr, which go to
  files, so a program that prints a gigabyte is stopped at the cap: Python, which ignores SIGXFSZ, gets an error
  from the write), open files, no core dumps;
- **time**: a wall-clock limit, after which the whole session is killed; bwrap is the PID namespace's first
  process, so when it goes every process inside goes with it (a child that detached with `setsid` included), and
  `--die-with-parent` takes it down with the trainer;
- **output**: at most `output_bytes` of stdout and of stderr come back, marked when cut.

`unavailable()` says why this machine cannot run the sandbox (no bwrap, no user namespaces, no system Python), for
the check when params load; `scripts/install-sandbox` installs bubblewrap. The tests attack each guard
(tests/unit/test_sandbox.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PYTHON = "/usr/bin/python3"
NOBODY = 65534


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 5                # CPU seconds (RLIMIT_CPU): SIGXCPU, then SIGKILL a second later
    wall_s: float = 10.0          # wall-clock seconds before the whole session is killed
    memory_mb: int = 512          # address space (RLIMIT_AS)
    processes: int = 32           # processes and threads of the sandbox's user (RLIMIT_NPROC)
    file_mb: int = 16             # the largest file it may write, stdout and stderr included (RLIMIT_FSIZE)
    output_bytes: int = 4096      # of stdout and of stderr, what comes back


@dataclass(frozen=True)
class Outcome:
    stdout: str
    stderr: str
    exit_code: int | None         # the program's exit status; None when a signal ended it
    signal: int | None            # the signal that ended it (SIGXCPU, SIGXFSZ, SIGKILL at the wall limit)
    timed_out: bool               # killed at the wall-clock limit
    truncated: bool               # stdout or stderr was cut at output_bytes
    wall_s: float


def unavailable() -> str | None:
    """Why programs cannot be sandboxed on this machine, or None."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed: run scripts/install-sandbox"
    if shutil.which("prlimit") is None:
        return "prlimit (util-linux) is not installed"
    if not Path(PYTHON).is_file():
        return f"{PYTHON} (the system Python the sandbox runs programs with) is missing"
    r = subprocess.run(["bwrap", "--unshare-all", "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib",
                        "--symlink", "usr/lib64", "/lib64", "--", PYTHON, "-I", "-c", "pass"],
                       capture_output=True, text=True, check=False, timeout=30, **_as_nobody())
    if r.returncode != 0:
        return f"bwrap cannot make its namespaces here ({r.stderr.strip()[-300:]})"
    return None


def _as_nobody() -> dict:
    """Popen's arguments that start the child as nobody where the trainer is root (the user namespace is then
    unprivileged and the process cap counts the sandbox's processes only); nothing otherwise."""
    return {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.getuid() == 0 else {}


def _command(work: Path) -> list[str]:
    return ["bwrap", "--unshare-all", "--die-with-parent", "--new-session",
            "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
            "--symlink", "usr/bin", "/bin", "--symlink", "usr/sbin", "/sbin",
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", str(work), "/tmp/work",
            "--chdir", "/tmp/work", "--clearenv", "--setenv", "PATH", "/usr/bin", "--setenv", "HOME", "/tmp/work",
            "--setenv", "LANG", "C.UTF-8", "--", PYTHON, "-I", "-B", "prog.py"]


def _read(path: Path, cap: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(cap + 1)
    return data[:cap].decode("utf-8", errors="replace"), len(data) > cap


# The sandbox's user may not start a namespace for a moment after others ended: their exited processes still count
# against RLIMIT_NPROC until the kernel frees them (back-to-back programs at ~75 a second: half refused with
# EAGAIN). bwrap then exits 1 before the program runs, and the start is tried again after these pauses (seconds),
# within the program's wall limit.
_START_WAITS = (0.02, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 0.0)
_REFUSED = b"Resource temporarily unavailable"


def _refused_start(stderr: Path) -> bool:
    """Whether bwrap itself gave up before the program ran, for want of a process or a namespace (EAGAIN)."""
    text = stderr.read_bytes()[:400]
    return text.startswith(b"bwrap: ") and _REFUSED in text


def _start_and_wait(rlimits: list[str], work: Path, out: Path, deadline: float) -> tuple[subprocess.Popen, bool]:
    """One start of the program, its stdout and stderr written afresh; (the process, whether the wall limit
    killed it)."""
    with open(out / "stdout", "wb") as so, open(out / "stderr", "wb") as se:
        p = subprocess.Popen([*rlimits, *_command(work)], stdin=subprocess.DEVNULL, stdout=so, stderr=se,
                             close_fds=True, start_new_session=True, **_as_nobody())
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)     # bwrap first: the PID namespace dies with it
            p.wait()
            return p, True
    return p, False


def run_python(code: str, limits: Limits = Limits()) -> Outcome:
    """Run `code` as a program in the sandbox; whatever it does comes back as an `Outcome`, within the limits."""
    root = Path(tempfile.mkdtemp(prefix="creditrl-sandbox-"))
    work, out = root / "work", root / "out"      # out/ is the host's: never bound into the sandbox
    work.mkdir()
    out.mkdir()
    (work / "prog.py").write_text(code)
    if os.getuid() == 0:        # nobody may pass through the temporary folder to its own working directory
        os.chmod(root, 0o711)
        os.chown(work, NOBODY, NOBODY)
    mb = 1 << 20

    # rlimits set by util-linux's prlimit, which then execs bwrap: no Python code between fork and exec (the
    # trainer has threads)
    rlimits = ["prlimit", f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}", f"--as={limits.memory_mb * mb}",
               f"--nproc={limits.processes}", f"--fsize={limits.file_mb * mb}", "--nofile=64", "--core=0", "--"]

    t0 = time.monotonic()
    try:
        for wait in _START_WAITS:
            p, timed_out = _start_and_wait(rlimits, work, out, t0 + limits.wall_s)
            if p.returncode != 1 or not _refused_start(out / "stderr") or time.monotonic() + wait > t0 + limits.wall_s:
                break
            time.sleep(wait)     # bwrap could not start yet (below): the program never ran; start it again
        wall = time.monotonic() - t0
        stdout, cut_out = _read(out / "stdout", limits.output_bytes)
        stderr, cut_err = _read(out / "stderr", limits.output_bytes)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # bwrap reports a program a signal ended as 128 + the signal (killed at the wall limit, bwrap itself: < 0)
    rc = p.returncode
    sig = -rc if rc < 0 else (rc - 128 if rc > 128 and rc - 128 < signal.NSIG else None)
    return Outcome(stdout, stderr, None if sig is not None else rc, sig, timed_out, cut_out or cut_err, wall)
