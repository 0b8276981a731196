"""Stage `rollout`: iteration i's policy (the checkpoint of i-1) plays G episodes of each training task.

Writes the step table (`tables.STEPS`): one row per turn with the observation, the anchor, prompt and response
token ids, the rollout engine's per-token log-probs, the action, its validity, the reward and the episode's
return and success.
"""

from __future__ import annotations

from contextlib import closing

import polars as pl

from pipeline.config import GROUPS_PER_ITERATION
from pipeline.engines import open_sampler
from pipeline.registry import PREV_CHECKPOINT, STEPS
from pipeline.rollout import EpisodeSpec, check_env_errors, episode_summary, play_with_params
from pipeline.stagekit import parse_args, stage_errors
from pipeline.tasks import task_seed
from pipeline.tables import STEPS as STEPS_SCHEMA
from pipeline.tables import write_table
from pipeline.tracking import Tracker


def training_specs(p, it: int) -> list[EpisodeSpec]:
    """The episodes of iteration `it`: G of each training task (task seeds disjoint from every other stream and
    iteration, `pipeline.tasks`)."""
    specs = []
    for t in range(p.rollout.tasks_per_iteration):
        task_id = task_seed("train", p.seed, it, t)
        group = it * GROUPS_PER_ITERATION + t
        for g in range(p.rollout.group_size):
            specs.append(EpisodeSpec(task_id, group, group * 1000 + g))
    return specs


def main(argv=None) -> None:
    ctx = parse_args("rollout", per_iteration=True, argv=argv)
    p, it = ctx.params, ctx.iteration
    with stage_errors(ctx), Tracker(p, "rollout", it) as tracker:
        seed = p.seed * 1_000_003 + it
        sampler, tokenizer = open_sampler(p, ctx.path(PREV_CHECKPOINT), engine_seed=seed)
        ctx.log(f"sampling with {sampler.name}")
        specs = training_specs(p, it)
        ctx.log(f"{len(specs)} episodes: {p.rollout.tasks_per_iteration} tasks x {p.rollout.group_size}")
        with closing(sampler):   # vLLM's merged copy of a LoRA checkpoint goes with it
            steps = play_with_params(p, sampler, tokenizer, specs, temperature=p.rollout.temperature,
                                     seed=seed, progress=ctx.log)
        faults = check_env_errors(steps, p.faults.max_env_error_share, f"rollout, iteration {it}")
        steps = steps.with_columns(pl.lit(it, dtype=pl.Int32).alias("iteration"))
        write_table(steps, ctx.path(STEPS), STEPS_SCHEMA)
        summary = episode_summary(steps) | faults
        summary["response_tokens_mean"] = float(steps["response_ids"].list.len().mean())
        tracker.log_metrics({f"train/{k}": v for k, v in summary.items()}, step=it, parent=True)
        ctx.log(f"wrote {ctx.path(STEPS)}: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
