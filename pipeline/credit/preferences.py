"""Step-level preference pairs (docs/credit-assignment.md, Step-level preference updates): turns taken in the same
state with different actions, ranked by the credit method's step value, the better one chosen.

The state is the group stage's step group (same task group, same anchor), so GiGPO's groups and the branch points
of branching rollouts both give pairs. A turn's step value comes from its credit method (`Method.step_value`):
the discounted return of the environment's rewards for GRPO, RLOO, GiGPO and HGPO, of the learned per-turn score
for OPRL and SPA, the critic's λ-return for GAE; every method feeds both objectives on the same rollouts.

Two turns of a state form a pair when their actions differ (an invalid turn's action is "invalid") and their values
differ by more than `min_gap`; of one state's pairs the `max_pairs_per_state` of the largest gaps are kept (ties by
the turns' order). The margin is LearNAT's offset, computed from each turn's reward r (its step value, or with
`margin: oracle` the oracle's similarity of the state after the turn to the goal): α·log(r_w − r_l) (`log`),
α·log(r_w / r_l) (`ratio`) or `margin_scale`·(r_w − r_l) (`linear`). A pair whose rewards leave its form undefined
(r_w <= r_l; a non-positive reward under `ratio`) is not made, and counted. Turns of an episode whose environment
raised never enter a pair.

On a branching tree a sampled turn and the copies of it that its branches hold (`shared`) are one turn: under
`credit.attribution: hard` it enters the pairs once, with the mean of its copies' values; under `soft` each copy
keeps its own value, but no turn is paired with a copy of itself, and a (prompt, chosen, rejected) is made at most
once, in one order (the first of the state's pairs by gap).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import polars as pl

from pipeline.credit.base import StepTable, step_values
from pipeline.credit.methods import get
from pipeline.rollout.branching import origin_keys

INVALID = "invalid"       # the action of an invalid turn, for the different-actions rule

PAIR_COLUMNS = {"task_group": pl.Int64, "step_group": pl.Int64, "chosen_episode": pl.Int64, "chosen_step": pl.Int32,
                "rejected_episode": pl.Int64, "rejected_step": pl.Int32, "chosen_value": pl.Float64,
                "rejected_value": pl.Float64, "gap": pl.Float64, "chosen_reward": pl.Float64,
                "rejected_reward": pl.Float64, "margin": pl.Float64}


class Pairs(NamedTuple):
    table: pl.DataFrame      # the `tables.PAIRS` layout
    undefined: int           # candidate pairs (before the cap) not made: their margin's form is undefined


def turn_values(table: pl.DataFrame, credit, gamma: float) -> pl.DataFrame:
    """(episode_id, step, value): the chosen method's step value of every turn of `table` (turns joined with their
    groups, and with the fit stage's `score` where the method has one)."""
    method = get(credit.method)
    t = StepTable(table)
    values = step_values(method, t, getattr(credit, method.name), gamma)
    return t.df.select("episode_id", "step").with_columns(pl.Series("value", values, dtype=pl.Float64))


def oracle_rewards(replayed: pl.DataFrame) -> pl.DataFrame:
    """(episode_id, step, reward): each turn's oracle reward for `margin: oracle`, the similarity in [0, 1] of the
    state after the turn to the goal, 1 − d(s_{t+1}) / d(s_0), clipped (a dead state 0, the goal 1), from the
    replayed table (episode_id, step, distance, distance_after: `pipeline.credit.oracle.oracle_replay`). On SQL the
    distance counts the gold query's AST components no query has covered plus the answer, so this is the share of
    the gold AST covered (LearNAT's AST reward). A turn the oracle could not replay has no reward (null)."""
    first = replayed.sort("episode_id", "step").group_by("episode_id", maintain_order=True).agg(
        pl.col("distance").first().alias("_d0"))
    t = replayed.join(first, on="episode_id", how="left")
    rewards = []
    for d0, d1 in zip(t["_d0"].to_list(), t["distance_after"].to_list(), strict=True):
        if d0 is None or d1 is None:
            rewards.append(None)
        elif math.isinf(d1):
            rewards.append(0.0)
        elif d0 == 0 or math.isinf(d0):
            rewards.append(1.0 if d1 == 0 else 0.0)
        else:
            rewards.append(min(1.0, max(0.0, 1.0 - d1 / d0)))
    return t.select("episode_id", "step").with_columns(pl.Series("reward", rewards, dtype=pl.Float64))


def margin_of(form: str, r_w: float, r_l: float, cfg) -> float | None:
    """LearNAT's offset for rewards r_w (chosen) and r_l (rejected) under `form`, or None where it is undefined
    (r_w <= r_l; under `ratio` a non-positive reward)."""
    if not r_w > r_l:
        return None
    if form == "log":
        return cfg.alpha * math.log(r_w - r_l)
    if form == "ratio":
        return cfg.alpha * math.log(r_w / r_l) if r_l > 0 else None
    return cfg.margin_scale * (r_w - r_l)


def _branched(rows: pl.DataFrame) -> bool:
    """Whether `rows` hold copies of shared turns (a branching rollout's tree)."""
    return "shared" in rows.columns and bool(rows["shared"].any())


def _with_origin(rows: pl.DataFrame) -> pl.DataFrame:
    """`rows` with `origin`, the episode that sampled the turn (itself but for a branch's copied turns)."""
    if not _branched(rows):
        return rows.with_columns(pl.col("episode_id").alias("origin"))
    return rows.join(origin_keys(rows).rename({"origin_episode": "origin"}), on=["episode_id", "step"])


def _as_turns(rows: pl.DataFrame, attribution: str) -> pl.DataFrame:
    """Under hard attribution on a branching tree, each sampled turn once (the sampled row where it is there, else
    its first copy: a turn whose own episode crashed still pairs through its copies) with the mean value of its
    copies; else `rows` as they are. (`pipeline.rollout.branching.attribute` does the same for the update's
    advantages, keeping the sampled rows only.)"""
    if attribution == "soft" or not _branched(rows):
        return rows
    mean = rows.group_by("origin", "step").agg(pl.col("value").mean().alias("_mean"))
    one = rows.sort("shared", "episode_id").unique(["origin", "step"], keep="first", maintain_order=True)
    return one.join(mean, on=["origin", "step"]).with_columns(pl.col("_mean").alias("value")).drop("_mean")


def build_pairs(table: pl.DataFrame, values: pl.DataFrame, cfg, oracle: pl.DataFrame | None = None,
                attribution: str = "soft") -> Pairs:
    """The pairs of `table` (columns episode_id, step, task_group, step_group, action, env_error, and on branching
    trees parent_episode, branch_turn, shared) under `update.step_dpo` (`cfg`) and `credit.attribution`;
    `oracle` (episode_id, step, reward: `oracle_rewards`) for the oracle margin."""
    rows = _with_origin(table.join(values, on=["episode_id", "step"], how="inner"))
    broken = rows.filter(pl.col("env_error").is_not_null())["episode_id"].unique().implode()
    rows = rows.filter(~pl.col("episode_id").is_in(broken)).with_columns(pl.col("action").fill_null(INVALID))
    rows = _as_turns(rows, attribution).sort("step_group", "episode_id", "step")
    reward: dict[tuple[int, int], float | None] = {}
    if cfg.margin == "oracle":
        if oracle is None:
            raise ValueError("update.step_dpo.margin oracle needs the environment's oracle rewards")
        reward = {(e, s): r for e, s, r in oracle.select("episode_id", "step", "reward").iter_rows()}
    out, undefined = [], 0
    for (group,), g in rows.group_by(["step_group"], maintain_order=True):
        if g.height < 2:
            continue
        ep, st, act, val, origin = (g[c].to_list() for c in ("episode_id", "step", "action", "value", "origin"))
        found = []
        for i in range(g.height):
            for j in range(i + 1, g.height):
                if act[i] == act[j] or (origin[i], st[i]) == (origin[j], st[j]) or abs(val[i] - val[j]) <= cfg.min_gap:
                    continue
                w, lo = (i, j) if val[i] > val[j] else (j, i)
                found.append((val[w] - val[lo], w, lo))
        found.sort(key=lambda x: (-x[0], x[1], x[2]))
        made, kept = set(), 0
        for gap, w, lo in found:
            turns = frozenset({(origin[w], st[w]), (origin[lo], st[lo])})
            if turns in made:            # the same two turns through copies: once, in the order of the larger gap
                continue
            made.add(turns)
            if cfg.margin == "oracle":
                r_w, r_l = reward.get((ep[w], st[w])), reward.get((ep[lo], st[lo]))
            else:
                r_w, r_l = val[w], val[lo]
            margin = None if r_w is None or r_l is None else margin_of(cfg.margin_form, r_w, r_l, cfg)
            if margin is None:
                undefined += 1
                continue
            if kept == cfg.max_pairs_per_state:
                continue
            kept += 1
            out.append({"task_group": g["task_group"][0], "step_group": group, "chosen_episode": ep[w],
                        "chosen_step": st[w], "rejected_episode": ep[lo], "rejected_step": st[lo],
                        "chosen_value": val[w], "rejected_value": val[lo], "gap": gap, "chosen_reward": r_w,
                        "rejected_reward": r_l, "margin": margin})
    return Pairs(pl.DataFrame(out, schema=PAIR_COLUMNS), undefined)


def pair_stats(pairs: pl.DataFrame, turns: int, undefined: int | None = None) -> dict[str, float]:
    """How much of an iteration the pairs cover: their number, the share of turns in at least one, the states with
    a pair, the mean gap and margin, and (given) the candidate pairs whose margin was undefined."""
    ids = set(zip(pairs["chosen_episode"], pairs["chosen_step"])) | set(zip(pairs["rejected_episode"],
                                                                          pairs["rejected_step"]))
    out = {"pairs": float(pairs.height), "share_turns_in_pair": len(ids) / max(turns, 1),
           "states_with_pairs": float(pairs["step_group"].n_unique()),
           "gap_mean": float(pairs["gap"].mean()) if pairs.height else 0.0,
           "margin_mean": float(pairs["margin"].mean()) if pairs.height else 0.0}
    if undefined is not None:
        out["pairs_undefined_margin"] = float(undefined)
    return out
