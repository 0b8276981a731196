"""Per-row reference implementations, written the way reference RL codebases write them: loops over rows and dicts
of lists. They exist to check the vectorised estimators of `pipeline.credit.methods` (tests) and to measure the speed-up
(bench/throughput.py); the pipeline never calls them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from difflib import SequenceMatcher

EPS = 1e-6


def _norm(values: list[float], mode: str, ddof: int = 1) -> list[float]:
    n = len(values)
    if n == 1:
        return [0.0]
    mean = sum(values) / n
    if mode == "mean_norm":
        return [v - mean for v in values]
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - ddof))
    return [(v - mean) / (std + EPS) for v in values]


def gigpo_naive(rows: list[dict], episode_mode: str = "mean_std_norm", step_mode: str = "mean_norm",
                    episode_stats: str = "per_turn", gamma: float = 0.95, weight: float = 1.0,
                    invalid_penalty: float = 0.1) -> dict:
    """GiGPO (docs/credit-assignment.md, GiGPO; Invalid actions) row by row. `rows`: dicts with episode_id, step,
    task_group, anchor, reward, action_valid. Returns {(episode_id, step): advantage}."""
    episodes: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        episodes[r["episode_id"]].append(r)
    for turns in episodes.values():
        turns.sort(key=lambda r: r["step"])
    # episode level
    returns = {e: sum(r["reward"] for r in turns) for e, turns in episodes.items()}
    by_group: dict[int, list[float]] = defaultdict(list)
    for e, turns in episodes.items():
        g = turns[0]["task_group"]
        if episode_stats == "per_episode":
            by_group[g].append(returns[e])
        else:
            by_group[g].extend([returns[e]] * len(turns))
    stats = {}
    for g, vals in by_group.items():
        n = len(vals)
        mean = sum(vals) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 0.0
        stats[g] = (n, mean, std)
    episode_adv = {}
    for e, turns in episodes.items():
        n, mean, std = stats[turns[0]["task_group"]]
        if n == 1:
            episode_adv[e] = 0.0
        elif episode_mode == "mean_norm":
            episode_adv[e] = returns[e] - mean
        else:
            episode_adv[e] = (returns[e] - mean) / (std + EPS)
    # step level
    step_value: dict[tuple, float] = {}
    groups: dict[tuple, list[tuple]] = defaultdict(list)
    for e, turns in episodes.items():
        G = 0.0
        for r in reversed(turns):
            G = r["reward"] + gamma * G
            key = (e, r["step"])
            step_value[key] = G
            groups[(r["task_group"], r["anchor"])].append(key)
    step_adv = {}
    for members in groups.values():
        for key, a in zip(members, _norm([step_value[k] for k in members], step_mode), strict=True):
            step_adv[key] = a
    out = {}
    for e, turns in episodes.items():
        for r in turns:
            key = (e, r["step"])
            pen = 0.0 if r["action_valid"] else invalid_penalty
            out[key] = episode_adv[e] - pen + weight * step_adv[key]
    return out


def similarity_groups_naive(rows: list[dict], threshold: float) -> dict[tuple, int]:
    """Greedy similarity clustering of anchors (docs/credit-assignment.md, GiGPO) the plain way: a new `SequenceMatcher`
    for every (anchor, cluster head) pair, every row looked at. `rows`: dicts with episode_id, step, task_group,
    anchor. Returns {(episode_id, step): cluster id}, ids numbered in order of first appearance."""

    heads: dict[int, list[tuple[str, int]]] = defaultdict(list)
    out, next_id = {}, 0
    for r in sorted(rows, key=lambda r: (r["episode_id"], r["step"])):
        found = None
        for head, cid in heads[r["task_group"]]:
            if SequenceMatcher(None, head, r["anchor"], autojunk=False).ratio() >= threshold:
                found = cid
                break
        if found is None:
            found, next_id = next_id, next_id + 1
            heads[r["task_group"]].append((r["anchor"], found))
        out[(r["episode_id"], r["step"])] = found
    return out
