"""Stage `evaluate`: iteration i's checkpoint on held-out tasks (seeds disjoint from training and warm start).

Writes one row per episode (`tables.EVAL_EPISODES`) and the iteration's metrics: success rate, mean return, mean
episode length, invalid-action rate; the metrics also go to the parent MLflow run with `step = iteration`.
"""

from __future__ import annotations

import json
import math
from contextlib import closing

import polars as pl

from pipeline.envs.base import has, make_env
from pipeline.engines import open_sampler
from pipeline.registry import CHECKPOINT, EVAL, EVAL_METRICS
from pipeline.rollout import EpisodeSpec, check_env_errors, episode_summary, play_with_params
from pipeline.stagekit import parse_args, stage_errors
from pipeline.tasks import task_seed
from pipeline.tables import EVAL_EPISODES, write_table, write_text_atomic
from pipeline.tracking import Tracker


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


def main(argv=None) -> None:
    ctx = parse_args("evaluate", per_iteration=True, argv=argv)
    p, it = ctx.params, ctx.iteration
    with stage_errors(ctx), Tracker(p, "evaluate", it) as tracker:
        seed = p.seed * 1_000_003 + 500_000 + it
        sampler, tokenizer = open_sampler(p, ctx.path(CHECKPOINT), engine_seed=seed)
        ctx.log(f"sampling with {sampler.name}")
        specs = eval_specs(p)
        ctx.log(f"{p.evaluate.tasks} held-out tasks x {p.evaluate.episodes_per_task} episodes, temperature "
                f"{p.evaluate.temperature}")
        with closing(sampler):   # vLLM's merged copy of a LoRA checkpoint goes with it
            steps = play_with_params(p, sampler, tokenizer, specs, temperature=p.evaluate.temperature,
                                     seed=seed, progress=ctx.log)
        faults = check_env_errors(steps, p.faults.max_env_error_share, f"evaluate, iteration {it}")
        episodes = steps.group_by("episode_id").agg(
            pl.col("task_id").first(), pl.col("episode_return").first(), pl.col("episode_length").first(),
            pl.col("success").first(), (~pl.col("action_valid")).sum().cast(pl.Int32).alias("invalid_turns"),
        ).sort("task_id", "episode_id")
        episodes = episodes.with_columns(
            pl.lit(it, dtype=pl.Int32).alias("iteration"),
            pl.Series("optimal_moves", optimal_moves(p, episodes["task_id"].to_list()), dtype=pl.Int32),
        )
        write_table(episodes, ctx.path(EVAL), EVAL_EPISODES)
        summary = episode_summary(steps) | faults
        write_text_atomic(ctx.path(EVAL_METRICS), json.dumps({"iteration": it, **summary}, indent=2) + "\n")
        tracker.log_metrics({f"eval/{k}": v for k, v in summary.items()}, step=it, parent=True)
        ctx.log(f"wrote {ctx.path(EVAL)}: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
