"""Task groups and anchor-state step groups (docs/credit-assignment.md, Terms; GiGPO, step level).

Anchors are keyed by xxh3-64 of their string; two different strings with the same hash are an error, never a
merge. A step group is the set of turns of one task group taken in the same anchor state (repeat visits within an
episode join the same group).
"""

from __future__ import annotations

from difflib import SequenceMatcher

import numpy as np
import polars as pl
import xxhash


class AnchorCollisionError(ValueError):
    pass


def _check_collisions(uniq: list[str], hashes: np.ndarray) -> None:
    order = np.argsort(hashes, kind="stable")
    same = np.flatnonzero(hashes[order][1:] == hashes[order][:-1])
    if len(same):
        i, j = order[same[0]], order[same[0] + 1]
        raise AnchorCollisionError(
            f"xxh3-64 collision: anchors {uniq[i]!r} and {uniq[j]!r} share hash {int(hashes[i])}; "
            "different states must not be merged")


def anchor_codes(anchors: pl.Series) -> tuple[np.ndarray, np.ndarray]:
    """(code of each row's anchor, xxh3-64 of each distinct anchor); raises on a hash collision.

    Codes index the sorted distinct strings, so equal strings share a code and each string is hashed once.
    """
    codes = (anchors.rank("dense").cast(pl.Int64) - 1).to_numpy()
    uniq = anchors.unique().sort().to_list()
    hashes = np.fromiter((xxhash.xxh3_64_intdigest(a.encode()) for a in uniq), dtype=np.uint64, count=len(uniq))
    _check_collisions(uniq, hashes)
    return codes, hashes


def anchor_hashes(anchors: pl.Series) -> pl.Series:
    """xxh3-64 of each anchor, hashing each distinct string once; raises on a collision."""
    codes, hashes = anchor_codes(anchors)
    return pl.Series("anchor_hash", hashes[codes] if len(codes) else np.zeros(0, np.uint64), dtype=pl.UInt64)


def dense_rank(keys: np.ndarray) -> np.ndarray:
    """Each key's rank among the distinct keys (0, 1, ...): dense group ids."""
    return np.unique(keys, return_inverse=True)[1].reshape(-1).astype(np.int64)


def build_groups(steps: pl.DataFrame, depth: int = 1) -> pl.DataFrame:
    """Keys of every turn: task group, anchor hash, step group id and size, and HGPO's history groups.

    `step_group` is the dense id of (task_group, anchor) (docs/credit-assignment.md, GiGPO, step level).
    `history_groups[k-1]` is the dense id of (task_group, s_{t-k+1}, ..., s_t) for k = 1..depth (HGPO); turns
    with fewer than k anchors behind them pad the missing ones with a "before the start" marker, so that the
    first turns of a task group's episodes share their keys at every depth. Vectorised: anchors become integer
    codes once, and each deeper key is the dense id of (the key one level up, the anchor one turn earlier).
    """
    if depth < 1:
        raise ValueError(f"HGPO depth must be at least 1, got {depth}")
    df = steps.select("episode_id", "step", "task_group", "anchor").sort("episode_id", "step")
    n = df.height
    codes, hashes = anchor_codes(df["anchor"])
    n_codes = len(hashes) + 1                       # the last code stands for "before the start"
    task = dense_rank(df["task_group"].to_numpy())
    key = dense_rank(task * n_codes + codes) if n else np.zeros(0, np.int64)
    ep = df["episode_id"].to_numpy()
    first = np.r_[True, ep[1:] != ep[:-1]] if n else np.zeros(0, bool)
    keys = [key]
    lagged = codes                                  # lag j: the anchor code j turns earlier, or the padding
    for _ in range(1, depth):
        prev = np.empty_like(lagged)
        prev[1:] = lagged[:-1]
        prev[first] = n_codes - 1
        lagged = prev
        keys.append(dense_rank(keys[-1] * n_codes + lagged))
    history = np.stack(keys, axis=1) if n else np.zeros((0, depth), np.int64)
    sizes = np.bincount(key)[key] if n else np.zeros(0, np.int64)
    return pl.DataFrame({
        "episode_id": ep, "step": df["step"], "task_group": df["task_group"],
        "anchor_hash": pl.Series(hashes[codes] if n else np.zeros(0, np.uint64), dtype=pl.UInt64),
        "step_group": key, "step_group_size": pl.Series(sizes, dtype=pl.Int32),
        "history_groups": pl.Series(history).cast(pl.List(pl.Int64)),
    })


def similarity_groups(steps: pl.DataFrame, threshold: float) -> pl.Series:
    """Step groups by anchor similarity (docs/credit-assignment.md, GiGPO: optional similarity grouping).

    Within each task group, distinct anchors are visited in order of first appearance (rows sorted by
    episode and step) and each joins the first cluster whose first member it matches with a difflib ratio of at
    least `threshold`, else opens a new cluster. Returns one global cluster id per row of `steps`.

    The work is one comparison per (distinct anchor, cluster head) of a task group. Each new anchor is indexed
    once (difflib's matcher keeps its second sequence's index across heads), and the length bound
    2·min(|a|, |b|) / (|a| + |b|) ≥ ratio rejects most heads before any matching.
    """

    order = steps.with_row_index("_row").sort("episode_id", "step")
    cluster_of: dict[tuple[int, str], int] = {}
    heads: dict[int, list[tuple[str, int]]] = {}
    next_id = 0
    ids = []
    matcher = SequenceMatcher(None, autojunk=False)
    for g, a in zip(order["task_group"].to_list(), order["anchor"].to_list(), strict=True):
        key = (g, a)
        if key not in cluster_of:
            found = None
            matcher.set_seq2(a)
            la = len(a)
            for head, cid in heads.setdefault(g, []):
                lh = len(head)
                if 2 * min(la, lh) < threshold * (la + lh):      # real_quick_ratio, without the call
                    continue
                matcher.set_seq1(head)
                if matcher.quick_ratio() >= threshold and matcher.ratio() >= threshold:
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
