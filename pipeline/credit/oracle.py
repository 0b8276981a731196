"""The oracle of docs/credit-assignment.md (Oracle credit): each turn labelled good or bad by the environment's exact
distance to success, and how well a run's advantages separate the two (ROC-AUC). Used by the report stage (a
run's own credit quality) and the credit-quality benchmarks."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import polars as pl

from pipeline.data.tables import ADVANTAGES, GROUPS, STEPS, read_table
from pipeline.envs.base import make_env, require


def oracle_labels(steps: pl.DataFrame, env_cfg) -> pl.Series:
    """1 good, 0 bad, null neither (d unchanged, or both states dead), per row of `steps` (docs/credit-assignment.md,
    Oracle credit), for any environment with an oracle distance.

    Each episode is replayed in the environment from its task seed with the responses it gave, and the oracle's
    distance is read before and after every turn. A replayed turn must be as valid as the recorded one, or the
    params are not the run's (an error says so). Turns from an episode whose environment raised get no label.
    """
    env = make_env(env_cfg)
    require(env, "oracle_distance", "the credit-quality oracle")
    order = steps.with_row_index("_row").sort("episode_id", "step")
    labels: list[int | None] = [None] * steps.height
    rows = order.select("_row", "episode_id", "task_id", "step", "response", "action_valid", "env_error").iter_rows()
    episode, d0 = None, math.inf
    for row, episode_id, task_id, step, response, valid, error in rows:
        if episode_id != episode:
            episode = episode_id
            env.reset(task_id)
            d0, broken = env.oracle_distance(), False
        if broken or error is not None:
            broken = True
            continue
        res = env.step(response)
        if res.action_valid != valid:
            raise ValueError(f"replaying episode {episode_id} (task {task_id}), turn {step}: the environment judged "
                             f"the action {'valid' if res.action_valid else 'invalid'}, the step table says "
                             f"otherwise; are these the params the run used?")
        d1 = env.oracle_distance()
        labels[row] = 0 if not valid else 1 if d1 < d0 else 0 if d1 > d0 else None
        d0 = d1
    return pl.Series("good", labels, dtype=pl.Int8)


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Mann-Whitney ROC-AUC with average ranks for ties (0.5 when a turn's score says nothing)."""
    pos, neg = int(labels.sum()), int(len(labels) - labels.sum())
    if pos == 0 or neg == 0:
        return math.nan
    ranks = pl.Series(scores).rank("average").to_numpy()
    return float((ranks[labels == 1].sum() - pos * (pos + 1) / 2) / (pos * neg))


def score_advantages(adv: pl.DataFrame) -> dict[str, float]:
    """ROC-AUC of the advantage and of its step term on the judged turns (`good` 1 or 0), and the share of turns with
    a step signal. A method without a step term (all zero) has no step-term AUC (NaN), rather than chance's 0.5."""
    judged = adv.filter(pl.col("good").is_not_null())
    labels = judged["good"].to_numpy()
    has_step = bool((adv["step_advantage"] != 0).any())
    return {"auc": roc_auc(judged["advantage"].to_numpy(), labels),
            "auc_step_term": roc_auc(judged["step_advantage"].to_numpy(), labels) if has_step else math.nan,
            "share_nonzero_step_signal": float((adv["step_advantage"] != 0).mean()) if adv.height else 0.0,
            "turns": adv.height}


def run_credit(results: Path, params) -> pl.DataFrame:
    """The oracle credit quality of the advantages a finished run trained on, per iteration: ROC-AUC of the
    advantage and of the step term, the share of turns with a step signal, and the step-group sizes (the share of
    turns in a non-singleton anchor group, docs/credit-assignment.md, GiGPO)."""
    rows = []
    for it in sorted(int(p.parent.name.split("_")[1]) for p in results.glob("iter_*/advantages.parquet")):
        d = results / f"iter_{it}"
        steps = read_table(d / "steps.parquet", STEPS).sort("episode_id", "step")
        adv = read_table(d / "advantages.parquet", ADVANTAGES).join(
            steps.select("episode_id", "step", oracle_labels(steps, params.env)), on=["episode_id", "step"])
        groups = read_table(d / "groups.parquet", GROUPS)
        rows.append({"iteration": it, **score_advantages(adv),
                     "share_turns_in_nonsingleton": float((groups["step_group_size"] > 1).mean()),
                     "mean_step_group_size": float(groups["step_group_size"].mean())})
    return pl.DataFrame(rows)
