"""Shards: the rollout and evaluate stages split into jobs that each play a contiguous slice of the episodes.

A shard is whole blocks of `rollout.batch_size` episodes, the blocks `pipeline.rollout.episodes.play_episodes` batches
by, so a shard generates exactly the batches the unsharded stage generates for its episodes
(`pipeline.rollout.episodes`).
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from pipeline.data import tables


class ShardError(ValueError):
    pass


def shard_slices(episodes: int, batch_size: int, shards: int, group_size: int, where: str) -> list[range]:
    """The episode index ranges of `shards` shards: contiguous runs of whole blocks of `batch_size` episodes, as
    even as blocks allow, each starting on a task group (`group_size` consecutive episodes)."""
    blocks = -(-episodes // batch_size)
    if shards > blocks:
        raise ShardError(f"{where}: {shards} shards, but its {episodes} episodes make only {blocks} batch(es) of "
                         f"rollout.batch_size {batch_size}; a shard is whole batches, so lower the shards or the "
                         "batch size")
    if shards > 1 and batch_size % group_size:
        raise ShardError(f"{where}: with shards, rollout.batch_size ({batch_size}) must be a multiple of the "
                         f"episodes per task ({group_size}), so that no task's episodes are split between shards")
    cuts = [min(episodes, (k * blocks // shards) * batch_size) for k in range(shards + 1)]
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def shard_options(ap) -> None:
    """`--shard K` / `--merge`: the jobs of a stage split into `shards` (Snakemake and dvc.yaml run them)."""
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--shard", type=int, metavar="K", help="play only shard K's episodes into its shard table")
    g.add_argument("--merge", action="store_true", help="merge the shards' tables into the stage's outputs")


def shard_of(specs: list, k: int, shards: int, batch_size: int, group_size: int, where: str) -> list:
    """Shard `k`'s slice of the episodes `specs` (`shard_slices`)."""
    slices = shard_slices(len(specs), batch_size, shards, group_size, where)
    if not 0 <= k < shards:
        raise ValueError(f"--shard {k}: expected 0..{shards - 1} ({where} is {shards})")
    return specs[slices[k].start: slices[k].stop]


def merge_shards(files: list[Path], log) -> pl.DataFrame:
    """The shards' step tables `files` as one, in episode order (each shard is a contiguous run of episodes)."""
    parts = [tables.read_table(f, tables.STEPS) for f in files]
    log(f"merging {len(files)} shards: " + ", ".join(str(t.height) for t in parts) + " turns")
    return pl.concat(parts).sort("episode_id", "step").rechunk()
