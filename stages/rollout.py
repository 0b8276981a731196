"""Stage `rollout`: iteration i's policy (the checkpoint of i-1) plays G episodes of each training task.

Writes the step table (`tables.STEPS`): one row per turn with the observation, the anchor, prompt and response
token ids, the rollout engine's per-token log-probs, the action, its validity, the reward and the episode's
return and success. With `rollout.shards: N` the stage runs as N jobs (`--shard K`, each playing a slice of whole
batches into `shards/rollout_K.parquet`) and a merge job (`--merge`) that writes the same step table.
"""

from __future__ import annotations

import time
from contextlib import closing

import polars as pl

from pipeline.config import GROUPS_PER_ITERATION
from pipeline.engines import open_sampler
from pipeline.registry import PREV_CHECKPOINT, STEPS, shard_table
from pipeline.rollout import EpisodeSpec, check_env_errors, episode_summary, play_with_params
from pipeline.shards import shard_slices
from pipeline.stagekit import parse_args, stage_errors
from pipeline.tasks import task_seed
from pipeline.tables import STEPS as STEPS_SCHEMA
from pipeline.tables import read_table, write_table
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


def shard_options(ap) -> None:
    """`--shard K` / `--merge`: the jobs of a stage split into `shards` (Snakemake and dvc.yaml run them)."""
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--shard", type=int, metavar="K", help="play only shard K's episodes into its shard table")
    g.add_argument("--merge", action="store_true", help="merge the shards' tables into the stage's outputs")


def shard_of(specs: list[EpisodeSpec], k: int, shards: int, batch_size: int, group_size: int,
             where: str) -> list[EpisodeSpec]:
    slices = shard_slices(len(specs), batch_size, shards, group_size, where)
    if not 0 <= k < shards:
        raise ValueError(f"--shard {k}: expected 0..{shards - 1} ({where} is {shards})")
    return specs[slices[k].start: slices[k].stop]


def merge_shards(ctx, stage: str, shards: int) -> pl.DataFrame:
    """The shards' step tables as one, in episode order (each shard is a contiguous run of episodes)."""
    parts = [read_table(ctx.path(shard_table(stage).replace("{shard}", str(k))), STEPS_SCHEMA)
             for k in range(shards)]
    ctx.log(f"merging {shards} shards: " + ", ".join(str(t.height) for t in parts) + " turns")
    return pl.concat(parts).sort("episode_id", "step").rechunk()


def main(argv=None) -> None:
    ctx = parse_args("rollout", per_iteration=True, argv=argv, options=shard_options)
    p, it, a = ctx.params, ctx.iteration, ctx.args
    seed = p.seed * 1_000_003 + it
    if a.merge:
        with stage_errors(ctx), Tracker(p, "rollout", it) as tracker:
            finish(ctx, merge_shards(ctx, "rollout", p.rollout.shards), tracker)
        return
    name = "rollout" if a.shard is None else f"rollout_shard{a.shard}"
    run_name = None if a.shard is None else f"rollout[{it}] shard {a.shard}/{p.rollout.shards}"
    with stage_errors(ctx), Tracker(p, name, it, run_name=run_name) as tracker:
        specs = training_specs(p, it)
        if a.shard is not None:
            specs = shard_of(specs, a.shard, p.rollout.shards, p.rollout.batch_size, p.rollout.group_size,
                             "rollout.shards")
        sampler, tokenizer = open_sampler(p, ctx.path(PREV_CHECKPOINT), engine_seed=seed)
        ctx.log(f"sampling with {sampler.name}")
        ctx.log(f"{len(specs)} episodes: " + (f"{p.rollout.tasks_per_iteration} tasks x {p.rollout.group_size}"
                                               if a.shard is None else f"shard {a.shard} of {p.rollout.shards}"))
        started = time.perf_counter()
        with closing(sampler):   # vLLM's merged copy of a LoRA checkpoint goes with it
            steps = play_with_params(p, sampler, tokenizer, specs, temperature=p.rollout.temperature,
                                     seed=seed, progress=ctx.log)
        steps = steps.with_columns(pl.lit(it, dtype=pl.Int32).alias("iteration"))
        if a.shard is None:
            finish(ctx, steps, tracker)
            return
        out = ctx.path(shard_table("rollout").replace("{shard}", str(a.shard)))
        write_table(steps, out, STEPS_SCHEMA)
        seconds = time.perf_counter() - started
        tracker.log_metrics({"shard/turns": float(steps.height), "shard/seconds": seconds,
                             "shard/turns_per_s": steps.height / max(seconds, 1e-9)}, step=it)
        ctx.log(f"wrote {out}: {steps.height} turns in {seconds:.1f} s")


def finish(ctx, steps: pl.DataFrame, tracker) -> None:
    """Check the environment's faults, write the iteration's step table and log its metrics."""
    p, it = ctx.params, ctx.iteration
    faults = check_env_errors(steps, p.faults.max_env_error_share, f"rollout, iteration {it}")
    write_table(steps, ctx.path(STEPS), STEPS_SCHEMA)
    summary = episode_summary(steps) | faults
    summary["response_tokens_mean"] = float(steps["response_ids"].list.len().mean())
    tracker.log_metrics({f"train/{k}": v for k, v in summary.items()}, step=it, parent=True)
    ctx.log(f"wrote {ctx.path(STEPS)}: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
