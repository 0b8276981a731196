"""The oracle of docs/credit-assignment.md (Oracle credit): each turn labelled good or bad by the environment's exact
distance to success, and how well a run's advantages separate the two (ROC-AUC). Used by the report stage (a
run's own credit quality) and the credit-quality benchmarks."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import polars as pl

from pipeline.data.paths import iterations_with
from pipeline.data.tables import ADVANTAGES, GROUPS, STEP_REWARDS, STEPS, read_table
from pipeline.envs.base import make_env, require


def oracle_labels(steps: pl.DataFrame, env_cfg) -> pl.Series:
    """1 good, 0 bad, null neither (d unchanged, or both states dead), per row of `steps` (docs/credit-assignment.md,
    Oracle credit), for any environment with an oracle distance (`oracle_replay`)."""
    return oracle_replay(steps, env_cfg)["good"]


def oracle_replay(steps: pl.DataFrame, env_cfg) -> pl.DataFrame:
    """Per row of `steps`, in its order: `good` (1 good, 0 bad, null neither), `distance`, the oracle's exact
    distance to success d(s_t) from the state the turn was taken in (inf for a dead state, null where unknown), and
    `distance_after`, d(s_{t+1}) from the state the turn led to.

    Each episode is replayed in the environment from its task seed with the responses it gave, and the oracle's
    distance is read before and after every turn. A replayed turn must be as valid as the recorded one, or the
    params are not the run's (an error says so). Turns from an episode whose environment raised get no label.
    """
    env = make_env(env_cfg)
    require(env, "oracle_distance", "the credit-quality oracle")
    order = steps.with_row_index("_row").sort("episode_id", "step")
    labels: list[int | None] = [None] * steps.height
    distance: list[float | None] = [None] * steps.height
    after: list[float | None] = [None] * steps.height
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
        distance[row] = float(d0)
        res = env.step(response)
        if res.action_valid != valid:
            raise ValueError(f"replaying episode {episode_id} (task {task_id}), turn {step}: the environment judged "
                             f"the action {'valid' if res.action_valid else 'invalid'}, the step table says "
                             f"otherwise; are these the params the run used?")
        d1 = env.oracle_distance()
        after[row] = float(d1)
        labels[row] = 0 if not valid else 1 if d1 < d0 else 0 if d1 > d0 else None
        d0 = d1
    return pl.DataFrame([pl.Series("good", labels, dtype=pl.Int8),
                         pl.Series("distance", distance, dtype=pl.Float64),
                         pl.Series("distance_after", after, dtype=pl.Float64)])


def state_auc(values: np.ndarray, distance: np.ndarray) -> float:
    """How well per-state values order states by the oracle's distance to success: over every pair of states at
    different distances (a dead state, inf, is the farthest), the probability that the nearer one has the higher
    value, ties in value counted one half (the ROC-AUC's pairwise reading; 0.5 when the values say nothing)."""
    values, distance = np.asarray(values, dtype=np.float64), np.asarray(distance, dtype=np.float64)
    keep = ~np.isnan(distance)
    values, distance = values[keep], distance[keep]
    won, pairs = 0.0, 0
    for b in range(0, len(values), 1024):       # chunks of rows against all columns: memory O(1024 · n)
        nearer = distance[b: b + 1024, None] < distance[None, :]
        dv = values[b: b + 1024, None] - values[None, :]
        won += float((nearer & (dv > 0)).sum()) + 0.5 * float((nearer & (dv == 0)).sum())
        pairs += int(nearer.sum())
    return won / pairs if pairs else math.nan


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Mann-Whitney ROC-AUC with average ranks for ties (0.5 when a turn's score says nothing)."""
    pos, neg = int(labels.sum()), int(len(labels) - labels.sum())
    if pos == 0 or neg == 0:
        return math.nan
    ranks = pl.Series(scores).rank("average").to_numpy()
    return float((ranks[labels == 1].sum() - pos * (pos + 1) / 2) / (pos * neg))


def score_advantages(adv: pl.DataFrame, score_kind: str | None = None) -> dict[str, float]:
    """ROC-AUC of the advantage and of its step term on the judged turns (`good` 1 or 0), and the share of turns with
    a step signal. A method without a step term (all zero) has no step-term AUC (NaN), rather than chance's 0.5.

    With an `action_valid` column, also `auc_valid` and `auc_step_term_valid`: the same on the valid turns alone.
    The oracle calls every invalid turn bad and every method docks it the same penalty, so these say how well a
    method ranks the choices between valid commands.

    With `score_kind` (a learned model's `StepRewardModel.score_kind`) and the table's `score` column, also
    `auc_score`: the ROC-AUC of a per-turn score on the judged turns ("turn"), or `state_auc` of a state value
    against the oracle's `distance` ("state")."""
    judged = adv.filter(pl.col("good").is_not_null())
    labels = judged["good"].to_numpy()
    has_step = bool((adv["step_advantage"] != 0).any())
    out = {"auc": roc_auc(judged["advantage"].to_numpy(), labels),
           "auc_step_term": roc_auc(judged["step_advantage"].to_numpy(), labels) if has_step else math.nan,
           "share_nonzero_step_signal": float((adv["step_advantage"] != 0).mean()) if adv.height else 0.0,
           "turns": adv.height}
    if "action_valid" in judged.columns:
        valid = judged.filter(pl.col("action_valid"))
        valid_labels = valid["good"].to_numpy()
        out["auc_valid"] = roc_auc(valid["advantage"].to_numpy(), valid_labels)
        out["auc_step_term_valid"] = (roc_auc(valid["step_advantage"].to_numpy(), valid_labels) if has_step
                                      else math.nan)
    if score_kind == "turn":
        out["auc_score"] = roc_auc(judged["score"].to_numpy(), labels)
    elif score_kind == "state":
        out["auc_score"] = state_auc(adv["score"].to_numpy(), adv["distance"].to_numpy())
    return out


def run_credit(results: Path, params) -> pl.DataFrame:
    """The oracle credit quality of the advantages a finished run trained on, per iteration: ROC-AUC of the
    advantage and of the step term, the share of turns with a step signal, and the step-group sizes (the share of
    turns in a non-singleton anchor group, docs/credit-assignment.md, GiGPO). For a method with a learned per-turn
    model, also `auc_score`, the oracle score of the model's own output (`score_advantages`)."""
    model = params.credit.method_def.reward_model   # through params: the report's code is not every method's
    rows = []
    for it in iterations_with(results, "advantages.parquet"):
        d = results / f"iter_{it}"
        steps = read_table(d / "steps.parquet", STEPS).sort("episode_id", "step")
        judged = pl.concat([steps.select("episode_id", "step"), oracle_replay(steps, params.env)], how="horizontal")
        adv = read_table(d / "advantages.parquet", ADVANTAGES).join(judged, on=["episode_id", "step"])
        kind = None
        if model is not None and (d / "step_rewards.parquet").is_file():
            scores = read_table(d / "step_rewards.parquet", STEP_REWARDS)
            adv, kind = adv.join(scores, on=["episode_id", "step"], how="left"), model.score_kind
        groups = read_table(d / "groups.parquet", GROUPS)
        rows.append({"iteration": it, **score_advantages(adv, kind),
                     "share_turns_in_nonsingleton": float((groups["step_group_size"] > 1).mean()),
                     "mean_step_group_size": float(groups["step_group_size"].mean())})
    return pl.DataFrame(rows)
