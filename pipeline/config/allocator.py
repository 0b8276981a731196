"""The memory allocator a stage process runs with: `runtime.allocator`.

PyTorch on a CPU allocates and frees a tensor for nearly every operator. The C library's malloc serves the large
ones from fresh pages (`mmap`: page faults and zeroing each time) and hands them back on free; tcmalloc
(gperftools) keeps them for the next request. On the SmolLM2 update that is 1.13x faster on a 2-core Zen 5 EPYC,
with byte-identical weights after the stage (docs/results/speed.md, "The allocator"); vLLM's CPU guide asks for
tcmalloc as well.

An allocator is chosen when a process starts (`LD_PRELOAD`), so `stages/__init__.py` calls `preload` before the
stage imports anything: where tcmalloc is to be used and is not loaded, the stage's command is executed again (the
same process id, so Snakemake, DVC and torchrun see one process) with `LD_PRELOAD` naming it. The re-executed
stage then puts `LD_PRELOAD` back as its caller had it, so that the stage's own children (a sandboxed program, a
tool) do not inherit it.

- `auto` (the default): tcmalloc where its library is installed (`scripts/install-vllm` installs it on Debian and
  Ubuntu), else the C library's malloc.
- `tcmalloc`: the same, and an error at params load where the library is not found.
- `system`: the C library's malloc.

Linux only: elsewhere every choice runs the system's allocator. `loaded()` reads what the process really runs with
(its memory map), which every stage logs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CHOICES = ("auto", "tcmalloc", "system")
LIBRARIES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
FOLDERS = ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
           "/lib/aarch64-linux-gnu", "/usr/lib64", "/lib64", "/usr/local/lib", "/usr/lib")
# set on the re-executed process: the caller's LD_PRELOAD ("" where it had none), so that it is put back
CALLER = "CREDITRL_CALLER_LD_PRELOAD"


def tcmalloc_library(folders: tuple[str, ...] = FOLDERS) -> str | None:
    """The path of tcmalloc's shared library where one is installed, else None."""
    if not sys.platform.startswith("linux"):
        return None
    for folder in folders:
        for name in LIBRARIES:
            if (path := Path(folder) / name).is_file():
                return str(path)
    return None


def loaded(maps: str = "/proc/self/maps") -> str:
    """The allocator this process runs with: `tcmalloc` where its library is mapped, else `system`."""
    try:
        text = Path(maps).read_text()
    except OSError:
        return "system"
    return "tcmalloc" if "libtcmalloc" in text else "system"


def environ(choice: str, env: dict[str, str] | None = None, library: str | None = None) -> dict[str, str] | None:
    """The environment a process started now must get to run with `choice`, or None where `env` (default: this
    process's) already gives it or the choice is the system's allocator (or tcmalloc is not installed)."""
    env = dict(os.environ if env is None else env)
    if choice == "system" or CALLER in env:          # a process preloaded once is never executed again
        return None
    library = library or tcmalloc_library()
    if library is None:
        return None
    current = env.get("LD_PRELOAD", "")
    if library in current.replace(":", " ").split():
        return None
    env[CALLER] = current
    env["LD_PRELOAD"] = f"{library} {current}".strip()
    return env


def choice_in(runtime: dict) -> str:
    """`runtime.allocator` of a raw (unvalidated) runtime section; a value the schema refuses counts as `system`
    here (the stage reports it once it validates its params)."""
    value = runtime.get("allocator", "auto")
    return value if value in CHOICES else "system"


def preload(runtime: dict) -> None:
    """Called first thing by `python -m stages.X`: execute the stage again with `runtime.allocator` preloaded
    where it is not, and in the re-executed stage put the caller's `LD_PRELOAD` back."""
    if CALLER in os.environ:
        caller = os.environ.pop(CALLER)
        if caller:
            os.environ["LD_PRELOAD"] = caller
        else:
            os.environ.pop("LD_PRELOAD", None)
        return
    if loaded() == "tcmalloc":                        # the caller preloaded it already
        return
    env = environ(choice_in(runtime))
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)
