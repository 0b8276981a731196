"""How many threads a stage's numeric libraries use: `runtime.torch_threads`, set before any of them is imported.

0 (the default) means the threads the job declares (`runtime.resources`), which Snakemake's rule and DVC's command
both export as CREDITRL_THREADS (so either tool computes the same floats), at most the machine's cores; a stage
started by hand (`python -m stages.X`) takes every core. OpenMP, MKL, OpenBLAS and polars read their thread
counts from the environment when they are first imported, so `stages/__init__.py` calls `configure` before a stage
module imports anything heavy; `apply` sets torch's count again in case torch was imported earlier (a stage
called in-process). `configure` also puts MKL in strict reproducible mode (`MKL_CBWR`) unless the caller set
it. `in_effect` reports what the stage actually ran with (`runtime/*` metrics).
"""

from __future__ import annotations

import os
import sys

from pipeline.config.allocator import loaded
from pipeline.config.files import read_params

ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "POLARS_MAX_THREADS")


def resolve(torch_threads: int) -> int:
    cores = os.cpu_count() or 1
    return torch_threads or min(int(os.environ.get("CREDITRL_THREADS") or 0), cores) or cores


def _params_file(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--params" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--params="):
            return arg.split("=", 1)[1]
    return "params.yaml"


def runtime_section(argv: list[str] | None = None) -> dict:
    """The raw `runtime` section of the params file a stage run with `argv` names (`extends:` resolved); empty
    where the file cannot be read (the stage reports its errors once it validates it)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        runtime = read_params(_params_file(argv))[0].get("runtime")
    except Exception:  # noqa: BLE001 - validation happens later, with a proper message
        return {}
    return runtime if isinstance(runtime, dict) else {}


def configure(argv: list[str] | None = None, runtime: dict | None = None) -> int:
    """Export the thread count a stage run with `argv` asks for (its `runtime` section, where the caller read it
    already); a value that is not a count counts as 0 here (the stage reports it once it validates its params)."""
    runtime = runtime_section(argv) if runtime is None else runtime
    try:
        requested = int(runtime.get("torch_threads") or 0)
    except (TypeError, ValueError):
        requested = 0
    n = resolve(max(requested, 0))
    for var in ENV:
        os.environ[var] = str(n)
    # MKL's AVX-512 paths may round differently from one run to the next (data alignment); strict CNR mode
    # makes a rerun's floats equal to the first run's
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
    return n


def apply(n: int) -> None:
    for var in ENV:
        os.environ[var] = str(n)
    if "torch" in sys.modules:
        import torch  # start-up cost: torch

        if torch.get_num_threads() != n:
            torch.set_num_threads(n)


def in_effect() -> dict[str, float]:
    """The thread counts this process runs with: torch's (when torch is loaded) and polars' pool; and whether its
    allocator is tcmalloc (`runtime.allocator`)."""
    out = {"runtime/threads": float(os.environ.get("OMP_NUM_THREADS", 0)),
           "runtime/tcmalloc": float(loaded() == "tcmalloc")}
    if "torch" in sys.modules:
        out["runtime/torch_threads"] = float(sys.modules["torch"].get_num_threads())
    if "polars" in sys.modules:
        out["runtime/polars_threads"] = float(sys.modules["polars"].thread_pool_size())
    return out
