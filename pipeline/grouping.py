"""Task groups and anchor-state step groups (credit-assignment.md, Terms; GiGPO, step level).

Anchors are keyed by xxh3-64 of their string; two different strings with the same hash are an error, never a
merge. A step group is the set of turns of one task group taken in the same anchor state (repeat visits within an
episode join the same group).
"""

from __future__ import annotations

import polars as pl
import xxhash


class AnchorCollisionError(ValueError):
    pass


def anchor_hashes(anchors: pl.Series) -> pl.Series:
    """xxh3-64 of each anchor, hashing each distinct string once; raises on a collision."""
    uniq = anchors.unique()
    table = pl.DataFrame({
        "anchor": uniq,
        "anchor_hash": pl.Series([xxhash.xxh3_64_intdigest(a.encode()) for a in uniq.to_list()], dtype=pl.UInt64),
    })
    clash = table.group_by("anchor_hash").agg(pl.col("anchor")).filter(pl.col("anchor").list.len() > 1)
    if clash.height:
        row = clash.row(0, named=True)
        raise AnchorCollisionError(
            f"xxh3-64 collision: anchors {row['anchor'][:2]!r} share hash {row['anchor_hash']}; "
            "different states must not be merged")
    return anchors.to_frame("anchor").join(table, on="anchor", how="left", maintain_order="left")["anchor_hash"]


def build_groups(steps: pl.DataFrame) -> pl.DataFrame:
    """Keys of every turn with its task group, anchor hash, step group id and step group size."""
    df = steps.select("episode_id", "step", "task_group", "anchor").with_columns(
        anchor_hashes(steps["anchor"]).alias("anchor_hash"))
    df = df.with_columns(
        pl.struct("task_group", "anchor_hash").rank("dense").cast(pl.Int64).sub(1).alias("step_group"))
    return df.with_columns(pl.len().over("step_group").cast(pl.Int32).alias("step_group_size")).select(
        "episode_id", "step", "task_group", "anchor_hash", "step_group", "step_group_size").sort("episode_id", "step")


def group_size_distribution(groups: pl.DataFrame) -> dict[str, float]:
    """Share of step groups that are singletons, of size 2-5, 6-9, >= 10; share of turns in non-singletons."""
    sizes = groups.group_by("step_group").agg(pl.len().alias("n"))["n"]
    n = max(len(sizes), 1)
    return {
        "step_groups": float(len(sizes)),
        "share_singleton": float((sizes == 1).sum() / n),
        "share_2_5": float(((sizes >= 2) & (sizes <= 5)).sum() / n),
        "share_6_9": float(((sizes >= 6) & (sizes <= 9)).sum() / n),
        "share_10_plus": float((sizes >= 10).sum() / n),
        "share_turns_in_nonsingleton": float((groups["step_group_size"] > 1).mean()) if groups.height else 0.0,
    }
