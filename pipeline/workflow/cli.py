"""The stage command line every stage entry point shares: arguments, validated params, threads, progress lines,
and one clear line instead of a traceback for the errors a user can cause."""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import allocator
from pipeline.config.params import ParamsError, check_dependencies, load_params
from pipeline.data.paths import at, fill, strip_dir
from pipeline.data.tables import TableError
from pipeline.workflow import threads
from pipeline.workflow.records import forget_snakemake_records, job_outputs, keep_snakemake_records
from pipeline.workflow.registry import STAGE_BY_NAME


@dataclass
class StageContext:
    params: object
    params_file: str
    iteration: int | None
    stage: str
    started: float
    args: argparse.Namespace | None = None   # the stage's own options (`options` of parse_args)
    requested_dtype: str | None = None       # `policy.dtype` as the params file says it (`auto` is resolved in params)
    dtype_why: str | None = None             # why the run computes in `params.policy.dtype`
    quiet: bool = False                      # a process other than the first of a multi-process stage: no lines

    def log(self, msg: str) -> None:
        if self.quiet:
            return
        elapsed = time.perf_counter() - self.started
        where = self.stage if self.iteration is None else f"{self.stage}[{self.iteration}]"
        print(f"[{where} {elapsed:7.1f}s] {msg}", flush=True)

    def path(self, template: str, it: int | None = None, shard: int | None = None) -> Path:
        """`template` (`pipeline.data.paths`) for this job: under `run.dir`, at its iteration (or `it`), shard
        `shard`."""
        it = self.iteration if it is None else it
        template = at(self.params, template)
        lag = self.params.loop.off_policy_lag
        return Path(strip_dir(fill(template, it, shard, lag) if it is not None else template))


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
        check_dependencies(params, args.params)
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
    requested, why = params.policy.dtype, f"policy.dtype {params.policy.dtype}"
    if requested == "auto" and STAGE_BY_NAME[stage].loads_model:       # the others neither compute with a model nor import torch
        from pipeline.model.policy import resolve_params  # start-up cost: torch, only for stages with a model
        try:
            params, why = resolve_params(params, fresh=stage == "init")
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
    ctx = StageContext(params, args.params, it, stage, started, args, requested, why)
    ctx.log(f"{n} threads (runtime.torch_threads {params.runtime.torch_threads}), {allocator.loaded()}'s malloc "
            f"(runtime.allocator {params.runtime.allocator})")
    if requested == "auto" and params.policy.dtype != "auto":
        ctx.log(f"computing in {params.policy.dtype} ({why})")
    return ctx


@contextmanager
def stage_job(ctx: StageContext):
    """The frame of a stage's job, its two duties:

    - the errors a user can cause become one clear line and exit status 1 (no traceback noise);
    - on success, Snakemake's records of the job's outputs are kept right for a run by DVC
      (`pipeline.workflow.records`: brought up to date where the outputs are those Snakemake made, else
      forgotten); under torchrun process 0 alone does this."""
    try:
        yield
        if int(os.environ.get("RANK", "0")) == 0 and not keep_snakemake_records(ctx):
            forget_snakemake_records(job_outputs(ctx))
    except (TableError, ParamsError, FileNotFoundError, ValueError, ArithmeticError) as e:
        print(f"error in stage {ctx.stage}"
              f"{'' if ctx.iteration is None else f' (iteration {ctx.iteration})'}: {e}", file=sys.stderr)
        sys.exit(1)
