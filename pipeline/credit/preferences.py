"""Step-level preference pairs (docs/credit-assignment.md, Step-level preference updates): turns taken in the same
state with different actions, ranked by the credit method's step value, the better one chosen.

The state is the group stage's step group (same task group, same anchor), so GiGPO's groups and the branch points
of branching rollouts both give pairs. A turn's step value comes from its credit method (`Method.step_value`):
the discounted return of the environment's rewards for GRPO, RLOO, GiGPO and HGPO, of the learned per-turn score
for OPRL and SPA, the critic's λ-return for GAE; every method feeds both objectives on the same rollouts.

Two turns of a state form a pair when their actions differ (an invalid turn's action is "invalid") and their values
differ by more than `min_gap`; of one state's pairs the `max_pairs_per_state` of the largest gaps are kept (ties by
the turns' order). The margin is `margin_scale` times the values' gap, or with `margin: oracle` times the
difference of the environment's distances after the two turns, d(s'_rejected) − d(s'_chosen), a dead state
counting as the farthest finite distance of the iteration plus one (privileged information, LearNAT's AST
margin for SQL). Turns of an episode whose environment raised never enter a pair.
"""

from __future__ import annotations

import math

import polars as pl

from pipeline.credit.base import StepTable, step_values
from pipeline.credit.methods import get

INVALID = "invalid"       # the action of an invalid turn, for the different-actions rule


def turn_values(table: pl.DataFrame, credit, gamma: float) -> pl.DataFrame:
    """(episode_id, step, value): the chosen method's step value of every turn of `table` (turns joined with their
    groups, and with the fit stage's `score` where the method has one)."""
    method = get(credit.method)
    t = StepTable(table)
    values = step_values(method, t, getattr(credit, method.name), gamma)
    return t.df.select("episode_id", "step").with_columns(pl.Series("value", values, dtype=pl.Float64))


def build_pairs(table: pl.DataFrame, values: pl.DataFrame, cfg, distance_after: pl.DataFrame | None = None
                ) -> pl.DataFrame:
    """The pairs of `table` (columns episode_id, step, task_group, step_group, action, env_error) under
    `update.step_dpo` (`cfg`), in the `tables.PAIRS` layout; `distance_after` (episode_id, step, distance_after)
    for the oracle margin."""
    rows = table.join(values, on=["episode_id", "step"], how="inner")
    broken = rows.filter(pl.col("env_error").is_not_null())["episode_id"].unique().implode()
    rows = rows.filter(~pl.col("episode_id").is_in(broken)).with_columns(
        pl.col("action").fill_null(INVALID)).sort("step_group", "episode_id", "step")
    after: dict[tuple[int, int], float] = {}
    if cfg.margin == "oracle":
        if distance_after is None:
            raise ValueError("update.step_dpo.margin oracle needs the environment's distances")
        finite = [d for d in distance_after["distance_after"].to_list() if d is not None and math.isfinite(d)]
        dead = (max(finite) if finite else 0.0) + 1.0
        for e, s, d in distance_after.iter_rows():
            after[(e, s)] = dead if d is None or not math.isfinite(d) else float(d)
    out = []
    for (group,), g in rows.group_by(["step_group"], maintain_order=True):
        if g.height < 2:
            continue
        ep, st, act, val = (g[c].to_list() for c in ("episode_id", "step", "action", "value"))
        found = []
        for i in range(g.height):
            for j in range(i + 1, g.height):
                if act[i] == act[j] or abs(val[i] - val[j]) <= cfg.min_gap:
                    continue
                w, lo = (i, j) if val[i] > val[j] else (j, i)
                found.append((val[w] - val[lo], w, lo))
        found.sort(key=lambda x: (-x[0], x[1], x[2]))
        for gap, w, lo in found[:cfg.max_pairs_per_state]:
            if cfg.margin == "oracle":
                margin = cfg.margin_scale * (after[(ep[lo], st[lo])] - after[(ep[w], st[w])])
            else:
                margin = cfg.margin_scale * gap
            out.append({"task_group": g["task_group"][0], "step_group": group, "chosen_episode": ep[w],
                        "chosen_step": st[w], "rejected_episode": ep[lo], "rejected_step": st[lo],
                        "chosen_value": val[w], "rejected_value": val[lo], "gap": gap, "margin": margin})
    schema = {"task_group": pl.Int64, "step_group": pl.Int64, "chosen_episode": pl.Int64, "chosen_step": pl.Int32,
              "rejected_episode": pl.Int64, "rejected_step": pl.Int32, "chosen_value": pl.Float64,
              "rejected_value": pl.Float64, "gap": pl.Float64, "margin": pl.Float64}
    return pl.DataFrame(out, schema=schema)


def pair_stats(pairs: pl.DataFrame, turns: int) -> dict[str, float]:
    """How much of an iteration the pairs cover: their number, the share of turns in at least one, the states with
    a pair, the mean gap and margin."""
    ids = set(zip(pairs["chosen_episode"], pairs["chosen_step"])) | set(zip(pairs["rejected_episode"],
                                                                          pairs["rejected_step"]))
    return {"pairs": float(pairs.height), "share_turns_in_pair": len(ids) / max(turns, 1),
            "states_with_pairs": float(pairs["step_group"].n_unique()),
            "gap_mean": float(pairs["gap"].mean()) if pairs.height else 0.0,
            "margin_mean": float(pairs["margin"].mean()) if pairs.height else 0.0}

