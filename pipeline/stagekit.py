"""What every stage entry point shares: arguments, validated params, threads, progress lines, tracking."""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pipeline import threads
from pipeline.config import ParamsError, load_params
from pipeline.tables import TableError


@dataclass
class StageContext:
    params: object
    params_file: str
    iteration: int | None
    stage: str
    started: float
    args: argparse.Namespace | None = None   # the stage's own options (`options` of parse_args)

    def log(self, msg: str) -> None:
        elapsed = time.perf_counter() - self.started
        where = self.stage if self.iteration is None else f"{self.stage}[{self.iteration}]"
        print(f"[{where} {elapsed:7.1f}s] {msg}", flush=True)

    def path(self, template: str, it: int | None = None) -> Path:
        from pipeline.registry import at, fill, strip_dir

        it = self.iteration if it is None else it
        template = at(self.params, template)
        return Path(strip_dir(fill(template, it) if it is not None else template))


def parse_args(stage: str, per_iteration: bool, argv: list[str] | None = None, options=None,
               iteration_needed=None) -> StageContext:
    """Parse a stage's command line and load its params. `options(parser)` adds the stage's own arguments;
    `iteration_needed(args)` says whether `--iteration` must be given (default: always, for a per-iteration stage)."""
    ap = argparse.ArgumentParser(prog=f"python -m stages.{stage}")
    ap.add_argument("--params", default="params.yaml", help="validated parameters file")
    if per_iteration:
        ap.add_argument("--iteration", type=int, required=iteration_needed is None)
    if options is not None:
        options(ap)
    args = ap.parse_args(argv)
    if per_iteration and args.iteration is None and iteration_needed is not None and iteration_needed(args):
        ap.error("the following arguments are required: --iteration")
    started = time.perf_counter()
    try:
        params = load_params(args.params)
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    it = getattr(args, "iteration", None)
    if it is not None and not (0 <= it <= params.loop.iterations):
        print(f"error: --iteration {it} is outside 0..loop.iterations ({params.loop.iterations}) of {args.params}",
              file=sys.stderr)
        sys.exit(2)
    n = threads.resolve(params.runtime.torch_threads)
    threads.apply(n)                                          # stages/__init__.py exported it before any import
    ctx = StageContext(params, args.params, it, stage, started, args)
    ctx.log(f"{n} threads (runtime.torch_threads {params.runtime.torch_threads})")
    return ctx


def job_outputs(ctx: StageContext) -> list[str]:
    """The registry's outputs of this job (the stage, its iteration and its shard or merge role), as Snakemake and
    DVC name them, and its Snakemake benchmark file; none for a run outside the workflow (evaluation only)."""
    from pipeline.registry import enabled_stages, fill, job_file, strip_dir

    a = ctx.args
    if getattr(a, "checkpoint", None) is not None:
        return []
    shard = getattr(a, "shard", None)
    role = "shard" if shard is not None else "merge" if getattr(a, "merge", False) else None
    for st in enabled_stages(ctx.params):
        if st.base == ctx.stage and (role is None or st.role == role):
            outs = [*st.outs_for(ctx.params), job_file(st, ctx.params, "benchmarks")]
            return [strip_dir(fill(o, ctx.iteration, shard) if ctx.iteration is not None else o) for o in outs]
    return []


def forget_snakemake_records(paths: list[str], root: Path = Path(".")) -> int:
    """Delete Snakemake's metadata records of `paths` (`.snakemake/metadata/`, one file per output, named by the
    URL-safe base64 of its path) and a benchmark file among them (Snakemake dates a job by its oldest output or
    benchmark file). A stage run by DVC calls this for its outputs: Snakemake then judges them by modification time
    alone, as files it did not make, instead of by the params and code of the run that made them before. Under
    Snakemake the record and the benchmark are written again when the job ends."""
    from base64 import urlsafe_b64encode

    folder = root / ".snakemake" / "metadata"
    if not folder.is_dir():
        return 0
    gone = 0
    for path in paths:
        if path.endswith(".tsv") and "/benchmarks/" in path:
            (root / path).unlink(missing_ok=True)
            continue
        b64 = urlsafe_b64encode(path.encode()).decode()
        parts = [b64[i: i + 254] for i in range(0, len(b64), 254)]
        record = folder.joinpath(*["@" + x for x in parts[:-1]], parts[-1])
        if record.is_file():
            record.unlink()
            gone += 1
    return gone


@contextmanager
def stage_errors(ctx: StageContext):
    """Turn the errors a user can cause into one clear line and exit status 1 (no traceback noise). On success,
    forget Snakemake's records of the job's outputs (`forget_snakemake_records`)."""
    try:
        yield
        forget_snakemake_records(job_outputs(ctx))
    except (TableError, ParamsError, FileNotFoundError, ValueError, ArithmeticError) as e:
        print(f"error in stage {ctx.stage}"
              f"{'' if ctx.iteration is None else f' (iteration {ctx.iteration})'}: {e}", file=sys.stderr)
        sys.exit(1)
