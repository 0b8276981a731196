"""Shards: the rollout and evaluate stages split into jobs that each play a contiguous slice of the episodes.

A shard is whole blocks of `rollout.batch_size` episodes, the blocks `pipeline.rollout.play_episodes` batches by,
so a shard generates exactly the batches the unsharded stage generates for its episodes (`pipeline.rollout`).
"""

from __future__ import annotations


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
