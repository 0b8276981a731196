"""Stage `rollout`: iteration i's policy (the checkpoint of i-1; of i-2 with `loop.off_policy_lag: 1`) plays G
episodes of each training task.

Writes the step table (`tables.STEPS`): one row per turn with the observation, the anchor, prompt and response token
ids, the rollout engine's per-token log-probs, the action, its validity, the reward and the episode's return and
success. With `rollout.branching` a task's episodes branch from each other's states (`pipeline.rollout.branching`;
`parent_episode`, `branch_turn` and `shared` say which turns are copies, and the metrics count sampled and shared
turns and tool calls apart). With `rollout.shards: N` the stage runs as N jobs (`--shard K`, each playing a slice of
whole batches into `shards/rollout_K.parquet`) and a merge job (`--merge`) that writes the same step table.
"""

from __future__ import annotations

import time
from contextlib import closing

import polars as pl

from pipeline.config.params import GROUPS_PER_ITERATION
from pipeline.data import paths, tables
from pipeline.data.seeds import stage_seed, task_seed
from pipeline.envs.base import spec_of
from pipeline.model.engines import open_sampler
from pipeline.rollout.branching import rollout_counts
from pipeline.rollout.episodes import EpisodeSpec, check_env_errors, episode_summary, play_with_params
from pipeline.rollout.shards import merge_shards, shard_of, shard_options
from pipeline.workflow.cli import parse_args, stage_job
from pipeline.workflow.tracking import Tracker


def training_specs(p, it: int) -> list[EpisodeSpec]:
    """The episodes of iteration `it`: G of each training task (task seeds disjoint from every other stream and
    iteration, `pipeline.data.seeds`)."""
    specs = []
    for t in range(p.rollout.tasks_per_iteration):
        task_id = task_seed("train", p.seed, it, t)
        group = it * GROUPS_PER_ITERATION + t
        for g in range(p.rollout.group_size):
            specs.append(EpisodeSpec(task_id, group, group * 1000 + g))
    return specs


def play(ctx, specs: list[EpisodeSpec]) -> tuple[pl.DataFrame, float]:
    """The step rows of `specs` played by the rollout's checkpoint (i-1, or i-2 one step off-policy) at the rollout
    temperature, and the seconds the play took after the engine started."""
    p, it = ctx.params, ctx.iteration
    seed = stage_seed("rollout", p.seed, it)
    sampler, tokenizer = open_sampler(p, ctx.path(paths.ROLLOUT_CHECKPOINT), engine_seed=seed)
    ctx.log(f"sampling with {sampler.label}")
    started = time.perf_counter()
    with closing(sampler):   # vLLM's merged copy of a LoRA checkpoint goes with it
        steps = play_with_params(p, sampler, tokenizer, specs, temperature=p.rollout.temperature, seed=seed,
                                 progress=ctx.log, branch=True)
    return steps.with_columns(pl.lit(it, dtype=pl.Int32).alias("iteration")), time.perf_counter() - started


def main(argv=None) -> None:
    ctx = parse_args("rollout", per_iteration=True, argv=argv, options=shard_options)
    p, it, shard = ctx.params, ctx.iteration, ctx.args.shard
    if ctx.args.merge:
        with stage_job(ctx), Tracker(p, "rollout", it) as tracker:
            files = [ctx.path(paths.shard_table("rollout"), shard=k) for k in range(p.rollout.shards)]
            finish(ctx, merge_shards(files, ctx.log), tracker)
        return
    name, run_name = (("rollout", None) if shard is None
                      else (f"rollout_shard{shard}", f"rollout[{it}] shard {shard}/{p.rollout.shards}"))
    with stage_job(ctx), Tracker(p, name, it, run_name=run_name) as tracker:
        specs = training_specs(p, it)
        if shard is not None:
            specs = shard_of(specs, shard, p.rollout.shards, p.rollout.batch_size, p.rollout.group_size,
                             "rollout.shards")
        ctx.log(f"{len(specs)} episodes: " + (f"{p.rollout.tasks_per_iteration} tasks x {p.rollout.group_size}"
                                               if shard is None else f"shard {shard} of {p.rollout.shards}"))
        steps, seconds = play(ctx, specs)
        if shard is None:
            finish(ctx, steps, tracker)
            return
        out = ctx.path(paths.shard_table("rollout"), shard=shard)
        tables.write_table(steps, out, tables.STEPS)
        tracker.log_metrics({"shard/turns": float(steps.height), "shard/seconds": seconds,
                             "shard/turns_per_s": steps.height / max(seconds, 1e-9)}, step=it)
        ctx.log(f"wrote {out}: {steps.height} turns in {seconds:.1f} s")


def finish(ctx, steps: pl.DataFrame, tracker) -> None:
    """Check the environment's faults, write the iteration's step table and log its metrics."""
    p, it = ctx.params, ctx.iteration
    faults = check_env_errors(steps, p.faults.max_env_error_share, f"rollout, iteration {it}")
    tables.write_table(steps, ctx.path(paths.STEPS), tables.STEPS)
    summary = episode_summary(steps) | faults
    if p.rollout.branching.mode != "none":
        summary |= rollout_counts(steps, spec_of(p.env).tool_call)
    summary["response_tokens_mean"] = float(steps["response_ids"].list.len().mean())
    tracker.log_metrics({f"train/{k}": v for k, v in summary.items()}, step=it, parent=True)
    ctx.log(f"wrote {ctx.path(paths.STEPS)}: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
