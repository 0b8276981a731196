"""Stage `evaluate`: iteration i's checkpoint on held-out tasks (seeds disjoint from training and warm start).

Writes one row per episode (`tables.EVAL_EPISODES`) and the iteration's metrics: success rate, mean return, mean
episode length, invalid-action rate; the metrics also go to the parent MLflow run with `step = iteration`.

Evaluation only, of any local checkpoint (a project checkpoint, a Hugging Face model folder, a LoRA adapter folder),
by the same code, into a folder of your choice:

    python -m stages.evaluate --params P --checkpoint PATH --out DIR [--iteration I]

writes DIR/eval.parquet, DIR/eval_metrics.json and DIR/evaluate_I.jsonl (the metrics), and logs an MLflow run named
after the checkpoint. `--iteration` (default 0) only labels the rows and seeds the sampling: the stage's own
evaluation of iteration I's checkpoint and this command with `--iteration I` write the same table.

With `evaluate.shards: N` the stage runs as N jobs (`--shard K`, each playing a slice of whole batches into
`shards/evaluate_K.parquet`) and a merge job (`--merge`) that writes the same episode table and metrics.
"""

from __future__ import annotations

import json
import math
import sys
from contextlib import closing
from pathlib import Path

import polars as pl

from pipeline.data import paths, tables
from pipeline.data.seeds import stage_seed, task_seed
from pipeline.envs.base import has, make_env
from pipeline.model.engines import open_sampler
from pipeline.rollout.episodes import EpisodeSpec, check_env_errors, episode_summary, play_with_params
from pipeline.rollout.shards import merge_shards, shard_of, shard_options
from pipeline.workflow.cli import parse_args, stage_job
from pipeline.workflow.tracking import Tracker


def eval_specs(p) -> list[EpisodeSpec]:
    k = p.evaluate.episodes_per_task
    return [EpisodeSpec(task_seed("eval", 0, 0, j), j, j * k + r) for j in range(p.evaluate.tasks) for r in range(k)]


def optimal_moves(p, task_ids: list[int]) -> list[int | None]:
    """The oracle's optimal number of steps from each task's start; None where the environment has no oracle."""
    env = make_env(p.env)
    if not has(env, "oracle_distance"):
        return [None] * len(task_ids)
    known: dict[int, int | None] = {}
    for t in task_ids:
        if t not in known:
            env.reset(t)
            d = env.oracle_distance()
            known[t] = int(d) if math.isfinite(d) else None
    return [known[t] for t in task_ids]


def play(p, checkpoint: Path, it: int, specs: list[EpisodeSpec], log) -> pl.DataFrame:
    """The step rows of the held-out episodes `specs` played with `checkpoint`."""
    seed = stage_seed("evaluate", p.seed, it)
    sampler, tokenizer = open_sampler(p, checkpoint, engine_seed=seed)
    log(f"sampling {checkpoint} with {sampler.label}")
    with closing(sampler):   # vLLM's merged copy of a LoRA checkpoint goes with it
        return play_with_params(p, sampler, tokenizer, specs, temperature=p.evaluate.temperature, seed=seed,
                                progress=log)


def evaluate(p, checkpoint: Path, it: int, eval_file: Path, metrics_file: Path, tracker, log) -> dict[str, float]:
    """Play the held-out episodes with `checkpoint`, write the episode table and the metrics; returns the metrics."""
    log(f"{p.evaluate.tasks} held-out tasks x {p.evaluate.episodes_per_task} episodes, temperature "
        f"{p.evaluate.temperature}")
    return summarize(p, play(p, checkpoint, it, eval_specs(p), log), it, eval_file, metrics_file, tracker, log)


def summarize(p, steps: pl.DataFrame, it: int, eval_file: Path, metrics_file: Path, tracker, log) -> dict[str, float]:
    """The episode table and the metrics of the held-out episodes' step rows."""
    faults = check_env_errors(steps, p.faults.max_env_error_share, f"evaluate, iteration {it}")
    episodes = steps.group_by("episode_id").agg(
        pl.col("task_id").first(), pl.col("episode_return").first(), pl.col("episode_length").first(),
        pl.col("success").first(), (~pl.col("action_valid")).sum().cast(pl.Int32).alias("invalid_turns"),
    ).sort("task_id", "episode_id")
    episodes = episodes.with_columns(
        pl.lit(it, dtype=pl.Int32).alias("iteration"),
        pl.Series("optimal_moves", optimal_moves(p, episodes["task_id"].to_list()), dtype=pl.Int32),
    )
    tables.write_table(episodes, eval_file, tables.EVAL_EPISODES)
    summary = episode_summary(steps) | faults
    tables.write_text_atomic(metrics_file, json.dumps({"iteration": it, **summary}, indent=2) + "\n")
    tracker.log_metrics({f"eval/{k}": v for k, v in summary.items()}, step=it, parent=True)
    log(f"wrote {eval_file}: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    return summary


def _options(ap) -> None:
    shard_options(ap)
    ap.add_argument("--checkpoint", type=Path, help="evaluation only: any local checkpoint (a project checkpoint, a "
                    "Hugging Face model folder, a LoRA adapter folder) instead of iteration I's")
    ap.add_argument("--out", type=Path, help="evaluation only: the folder for eval.parquet, eval_metrics.json and "
                    "the metrics file")


def main(argv=None) -> None:
    ctx = parse_args("evaluate", per_iteration=True, argv=argv, options=_options,
                     iteration_needed=lambda a: a.checkpoint is None)
    a = ctx.args
    if (a.checkpoint is None) != (a.out is None):
        usage_error("--checkpoint and --out go together (evaluation only); without them the stage evaluates "
                    "--iteration's checkpoint")
    if a.checkpoint is not None and (a.shard is not None or a.merge):
        usage_error("--shard and --merge are the stage's own jobs; evaluation only (--checkpoint) runs whole")
    if a.checkpoint is not None:
        evaluate_only(ctx)
    elif a.merge:
        merge(ctx)
    elif a.shard is not None:
        play_shard(ctx)
    else:
        with stage_job(ctx), Tracker(ctx.params, "evaluate", ctx.iteration) as tracker:
            evaluate(ctx.params, ctx.path(paths.CHECKPOINT), ctx.iteration, ctx.path(paths.EVAL),
                     ctx.path(paths.EVAL_METRICS), tracker, ctx.log)


def usage_error(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def merge(ctx) -> None:
    """The merge job: the shards' step tables into the episode table and metrics."""
    p, it = ctx.params, ctx.iteration
    with stage_job(ctx), Tracker(p, "evaluate", it) as tracker:
        files = [ctx.path(paths.shard_table("evaluate"), shard=k) for k in range(p.evaluate.shards)]
        summarize(p, merge_shards(files, ctx.log), it, ctx.path(paths.EVAL), ctx.path(paths.EVAL_METRICS),
                  tracker, ctx.log)


def play_shard(ctx) -> None:
    """A shard job: its slice of the held-out episodes into its shard's step table."""
    p, it, shard = ctx.params, ctx.iteration, ctx.args.shard
    with stage_job(ctx):
        specs = shard_of(eval_specs(p), shard, p.evaluate.shards, p.rollout.batch_size,
                         p.evaluate.episodes_per_task, "evaluate.shards")
        ctx.log(f"{len(specs)} held-out episodes: shard {shard} of {p.evaluate.shards}")
        steps = play(p, ctx.path(paths.CHECKPOINT), it, specs, ctx.log)
        out = ctx.path(paths.shard_table("evaluate"), shard=shard)
        tables.write_table(steps.with_columns(pl.lit(it, dtype=pl.Int32).alias("iteration")), out, tables.STEPS)
        ctx.log(f"wrote {out}: {steps.height} turns")


def evaluate_only(ctx) -> None:
    """Evaluation only: any local checkpoint into the folder `--out`, with an MLflow run named after it."""
    p, a = ctx.params, ctx.args
    it = ctx.iteration = ctx.iteration if ctx.iteration is not None else 0
    with stage_job(ctx):
        if not a.checkpoint.is_dir():
            raise FileNotFoundError(f"--checkpoint {a.checkpoint}: no such folder")
        a.out.mkdir(parents=True, exist_ok=True)
        name = f"evaluate {a.checkpoint.resolve()}"
        with Tracker(p, "evaluate", it, metrics_dir=a.out, run_name=name,
                     tags={"creditrl.checkpoint": str(a.checkpoint.resolve())}) as tracker:
            evaluate(p, a.checkpoint, it, a.out / "eval.parquet", a.out / "eval_metrics.json", tracker, ctx.log)


if __name__ == "__main__":
    main()
