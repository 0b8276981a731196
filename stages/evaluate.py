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

import polars as pl

from pathlib import Path

from pipeline.envs.base import has, make_env
from pipeline.engines import open_sampler
from pipeline.registry import CHECKPOINT, EVAL, EVAL_METRICS, shard_table
from pipeline.rollout import EpisodeSpec, check_env_errors, episode_summary, play_with_params
from pipeline.stagekit import parse_args, stage_errors
from pipeline.tasks import task_seed
from pipeline.tables import EVAL_EPISODES, STEPS, write_table, write_text_atomic
from pipeline.tracking import Tracker
from stages.rollout import merge_shards, shard_of, shard_options


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
    seed = p.seed * 1_000_003 + 500_000 + it
    sampler, tokenizer = open_sampler(p, checkpoint, engine_seed=seed)
    log(f"sampling {checkpoint} with {sampler.name}")
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
    write_table(episodes, eval_file, EVAL_EPISODES)
    summary = episode_summary(steps) | faults
    write_text_atomic(metrics_file, json.dumps({"iteration": it, **summary}, indent=2) + "\n")
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
    p, a = ctx.params, ctx.args
    if (a.checkpoint is None) != (a.out is None):
        print("error: --checkpoint and --out go together (evaluation only); without them the stage evaluates "
              "--iteration's checkpoint", file=sys.stderr)
        sys.exit(2)
    if a.checkpoint is not None and (a.shard is not None or a.merge):
        print("error: --shard and --merge are the stage's own jobs; evaluation only (--checkpoint) runs whole",
              file=sys.stderr)
        sys.exit(2)
    if a.checkpoint is None:
        it = ctx.iteration
        if a.merge:
            with stage_errors(ctx), Tracker(p, "evaluate", it) as tracker:
                summarize(p, merge_shards(ctx, "evaluate", p.evaluate.shards), it, ctx.path(EVAL),
                          ctx.path(EVAL_METRICS), tracker, ctx.log)
        elif a.shard is not None:
            with stage_errors(ctx):
                specs = shard_of(eval_specs(p), a.shard, p.evaluate.shards, p.rollout.batch_size,
                                 p.evaluate.episodes_per_task, "evaluate.shards")
                ctx.log(f"{len(specs)} held-out episodes: shard {a.shard} of {p.evaluate.shards}")
                steps = play(p, ctx.path(CHECKPOINT), it, specs, ctx.log)
                out = ctx.path(shard_table("evaluate").replace("{shard}", str(a.shard)))
                write_table(steps.with_columns(pl.lit(it, dtype=pl.Int32).alias("iteration")), out, STEPS)
                ctx.log(f"wrote {out}: {steps.height} turns")
        else:
            with stage_errors(ctx), Tracker(p, "evaluate", it) as tracker:
                evaluate(p, ctx.path(CHECKPOINT), it, ctx.path(EVAL), ctx.path(EVAL_METRICS), tracker, ctx.log)
        return
    it = ctx.iteration if ctx.iteration is not None else 0
    ctx.iteration = it
    with stage_errors(ctx):
        if not a.checkpoint.is_dir():
            raise FileNotFoundError(f"--checkpoint {a.checkpoint}: no such folder")
        a.out.mkdir(parents=True, exist_ok=True)
        name = f"evaluate {a.checkpoint.resolve()}"
        with Tracker(p, "evaluate", it, metrics_dir=a.out, run_name=name,
                     tags={"creditrl.checkpoint": str(a.checkpoint.resolve())}) as tracker:
            evaluate(p, a.checkpoint, it, a.out / "eval.parquet", a.out / "eval_metrics.json", tracker, ctx.log)


if __name__ == "__main__":
    main()
