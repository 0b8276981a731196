"""Task groups and anchor-state step groups (credit-assignment.md, Terms; GiGPO, step level).

Anchors are keyed by xxh3-64 of their string; two different strings with the same hash are an error, never a
merge. A step group is the set of turns of one task group taken in the same anchor state (repeat visits within an
episode join the same group).
"""

from __future__ import annotations

import numpy as np
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


def hgpo_depth(params) -> int:
    """K + 1 anchors deep (credit-assignment.md, HGPO), K = prompt.history_turns, unless credit.hgpo.depth says."""
    return params.credit.hgpo.depth or params.prompt.history_turns + 1


PAD_HASH = 0  # stands for "before the episode's first turn" in HGPO keys


def build_groups(steps: pl.DataFrame, depth: int = 1) -> pl.DataFrame:
    """Keys of every turn: task group, anchor hash, step group id and size, and HGPO's history groups.

    `step_group` is the dense id of (task_group, anchor) (credit-assignment.md, GiGPO, step level).
    `history_groups[k-1]` is the dense id of (task_group, s_{t-k+1}, ..., s_t) for k = 1..depth (HGPO); turns
    with fewer than k anchors behind them pad the missing ones with a "before the start" marker, so that the
    first turns of a task group's episodes share their keys at every depth.
    """
    if depth < 1:
        raise ValueError(f"HGPO depth must be at least 1, got {depth}")
    df = steps.select("episode_id", "step", "task_group", "anchor").sort("episode_id", "step")
    df = df.with_columns(anchor_hashes(df["anchor"]).alias("anchor_hash"))
    df = df.with_columns(
        pl.struct("task_group", "anchor_hash").rank("dense").cast(pl.Int64).sub(1).alias("step_group"))
    lagged = [f"_h{j}" for j in range(depth)]
    df = df.with_columns(
        pl.col("anchor_hash").shift(j).over("episode_id").fill_null(PAD_HASH).alias(f"_h{j}") for j in range(depth))
    keys = [pl.struct("task_group", *lagged[:k]).rank("dense").cast(pl.Int64).sub(1) for k in range(1, depth + 1)]
    df = df.with_columns(pl.concat_list(keys).alias("history_groups")).drop(lagged)
    return df.with_columns(pl.len().over("step_group").cast(pl.Int32).alias("step_group_size")).select(
        "episode_id", "step", "task_group", "anchor_hash", "step_group", "step_group_size", "history_groups")


def similarity_groups(steps: pl.DataFrame, threshold: float) -> pl.Series:
    """Step groups by anchor similarity (credit-assignment.md, GiGPO: optional similarity grouping).

    Within each task group, distinct anchors are visited in order of first appearance (rows sorted by
    episode and step) and each joins the first cluster whose first member it matches with a difflib ratio of at
    least `threshold`, else opens a new cluster. Returns one global cluster id per row of `steps`.
    """
    from difflib import SequenceMatcher

    order = steps.with_row_index("_row").sort("episode_id", "step")
    cluster_of: dict[tuple[int, str], int] = {}
    heads: dict[int, list[tuple[str, int]]] = {}
    next_id = 0
    ids = []
    for g, a in zip(order["task_group"].to_list(), order["anchor"].to_list(), strict=True):
        key = (g, a)
        if key not in cluster_of:
            found = None
            for head, cid in heads.setdefault(g, []):
                m = SequenceMatcher(None, head, a, autojunk=False)
                if m.real_quick_ratio() >= threshold and m.quick_ratio() >= threshold and m.ratio() >= threshold:
                    found = cid
                    break
            if found is None:
                found = next_id
                next_id += 1
                heads[g].append((a, found))
            cluster_of[key] = found
        ids.append(cluster_of[key])
    out = np.empty(len(ids), dtype=np.int64)
    out[order["_row"].to_numpy()] = ids
    return pl.Series("step_group", out)


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
