"""Advantage estimators: pure, vectorised functions over the step table, registered by name.

Each estimator takes a polars frame with the step table's keys and `task_group`, `reward`, `action_valid`, plus
what its method needs (`step_group` and `anchor` for GiGPO, `history_groups` for HGPO, `score` from the fit stage
for OPRL and SPA), its config section and the invalid-action penalty. It returns, sorted by (`episode_id`,
`step`): `episode_advantage` (A^E), `step_score` (the per-turn value its step level normalises, null for
episode-level methods), `step_advantage` (the weighted step-level term) and `advantage` (their sum, what PPO
uses). No I/O, no model. The maths is credit-assignment.md's; each function names its section.

Invalid actions (credit-assignment.md, Invalid actions). **Decisions**:
- Episode level: the penalty is subtracted from the invalid row's *normalised* score, `norm(R(τ)) − p`.
  The statistics are per episode while the penalty is per row; subtracting before normalising would divide it
  by `std + ε`, which turns p = 0.1 into −1e5 in a group whose episodes all have the same return.
- Step level: the penalty is subtracted from the row's own step value (`G_t`, `r_φ(t)`, `G^SPA_t`) *before*
  normalising, without discounting it into earlier turns. There every row is its own value, so the penalty takes
  part in the group statistics like any other difference, a singleton still gives 0, and mean_norm step
  advantages still sum to zero within each group.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import polars as pl

EPS = 1e-6  # credit-assignment.md, Terms: ε in every normalisation

ESTIMATORS: dict[str, Callable[..., pl.DataFrame]] = {}

# Columns each method needs besides the step keys, task_group, reward and action_valid.
EXTRA_COLUMNS: dict[str, tuple[str, ...]] = {
    "grpo": (), "rloo": (), "gigpo": ("step_group",), "hgpo": ("history_groups",),
    "oprl": ("score",), "spa": ("score",),
}
OUTPUT = ("episode_id", "step", "episode_advantage", "step_score", "step_advantage", "advantage")


def register(name: str):
    def deco(fn):
        ESTIMATORS[name] = fn
        return fn

    return deco


def _dense_keys(keys: np.ndarray) -> np.ndarray:
    """Small non-negative integer ids for `keys`: the keys themselves when already in [0, 2n), else dense ranks."""
    keys = np.asarray(keys)
    n = len(keys)
    if n and keys.dtype.kind in "iu" and keys.min() >= 0 and keys.max() < 2 * n:
        return keys.astype(np.int64, copy=False)
    return np.unique(keys, return_inverse=True)[1].reshape(-1).astype(np.int64)


def group_norm(x: np.ndarray, keys: np.ndarray, mode: str, std: str = "unbiased") -> np.ndarray:
    """`norm(x; G)` of credit-assignment.md, Terms, for every row at once; a group of size 1 gives 0.

    `keys` names each row's group. `mean_norm`: x − mean_G(x); `mean_std_norm`: (x − mean_G(x)) / (std_G(x) + ε),
    std unbiased (ddof 1) or population (ddof 0). Two passes of `np.bincount`: O(rows), no sorting.
    """
    x = np.asarray(x, dtype=np.float64)
    if len(x) == 0:
        return np.zeros(0)
    k = _dense_keys(keys)
    count = np.bincount(k)
    mean = np.bincount(k, x) / np.maximum(count, 1)
    out = x - mean[k]
    if mode == "mean_std_norm":
        ddof = 1 if std == "unbiased" else 0
        var = np.bincount(k, out * out) / np.maximum(count - ddof, 1)
        out = out / (np.sqrt(var)[k] + EPS)
    elif mode != "mean_norm":
        raise ValueError(f"unknown normalisation mode {mode!r}; expected mean_norm or mean_std_norm")
    return np.where(count[k] > 1, out, 0.0)


def penalty(valid: np.ndarray, invalid_penalty: float) -> np.ndarray:
    """`invalid_penalty` on rows whose action was invalid, else 0 (credit-assignment.md, Invalid actions)."""
    return np.where(valid, 0.0, invalid_penalty)


class _Table:
    """The step table's columns as numpy arrays, rows sorted by (episode_id, step), with episode boundaries."""

    def __init__(self, steps: pl.DataFrame):
        df = steps.sort("episode_id", "step")
        self.df = df
        self.episode_id = df["episode_id"].to_numpy()
        self.step = df["step"].to_numpy()
        self.task = df["task_group"].to_numpy()
        self.reward = df["reward"].to_numpy().astype(np.float64)
        self.valid = df["action_valid"].to_numpy().astype(bool)
        n = df.height
        first = np.r_[True, self.episode_id[1:] != self.episode_id[:-1]] if n else np.zeros(0, bool)
        self.starts = np.flatnonzero(first)
        self.lengths = np.diff(np.r_[self.starts, n])

    def col(self, name: str) -> np.ndarray:
        return self.df[name].to_numpy()

    def episode_sum(self, values: np.ndarray) -> np.ndarray:
        """Σ over each episode's rows, one value per episode."""
        return np.add.reduceat(values, self.starts) if len(self.starts) else np.zeros(0)

    def returns(self, reward: np.ndarray, gamma: float) -> np.ndarray:
        return discounted_returns(self.episode_id, self.step, reward, gamma)

    def output(self, episode_adv: np.ndarray, step_score: np.ndarray | None, step_adv: np.ndarray) -> pl.DataFrame:
        n = self.df.height
        score = (pl.Series("step_score", step_score, dtype=pl.Float64) if step_score is not None
                 else pl.Series("step_score", [None] * n, dtype=pl.Float64))
        return pl.DataFrame([
            self.df["episode_id"], self.df["step"],
            pl.Series("episode_advantage", episode_adv, dtype=pl.Float64), score,
            pl.Series("step_advantage", step_adv, dtype=pl.Float64),
            pl.Series("advantage", episode_adv + step_adv, dtype=pl.Float64),
        ])


def episode_advantage(t: _Table, mode: str, episode_stats: str, invalid_penalty: float) -> np.ndarray:
    """`A^E` (credit-assignment.md, GRPO; Invalid actions) for every row of `t`.

    Group statistics come from one value per episode (`per_episode`, the paper) or one per turn row
    (`per_turn`, the released GiGPO code), always of the unpenalised returns; the penalty is subtracted after
    normalising (module docstring, Decisions).
    """
    R = t.episode_sum(t.reward)
    if episode_stats == "per_episode":
        adv = np.repeat(group_norm(R, t.task[t.starts], mode), t.lengths)
    elif episode_stats == "per_turn":
        adv = group_norm(np.repeat(R, t.lengths), t.task, mode)
    else:
        raise ValueError(f"unknown episode_stats {episode_stats!r}; expected per_episode or per_turn")
    return adv - penalty(t.valid, invalid_penalty)


def discounted_returns(episode_id: np.ndarray, step: np.ndarray, reward: np.ndarray, gamma: float) -> np.ndarray:
    """`G_t = r_t + γ G_{t+1}` within each episode (credit-assignment.md, GiGPO, step level), any row order.

    Vectorised over episodes: one numpy pass per distance from the episode's end, so the work is O(turns) and
    the number of passes is the longest episode's length.
    """
    n = len(reward)
    if n == 0:
        return np.zeros(0)
    episode_id, step = np.asarray(episode_id), np.asarray(step)
    presorted = n < 2 or bool(np.all((episode_id[1:] > episode_id[:-1])
                                     | ((episode_id[1:] == episode_id[:-1]) & (step[1:] > step[:-1]))))
    order = np.arange(n) if presorted else np.lexsort((step, episode_id))
    ep, r = episode_id[order], np.asarray(reward, dtype=np.float64)[order]
    last = np.r_[ep[1:] != ep[:-1], True]                     # row ends its episode
    end_idx = np.flatnonzero(last)
    ends = np.repeat(end_idx, np.diff(np.r_[-1, end_idx]))   # index of each row's episode end
    dist = ends - np.arange(n)                                # turns to the episode's end
    by_dist = np.argsort(dist, kind="stable")
    bounds = np.searchsorted(dist[by_dist], np.arange(dist.max() + 2))
    G = np.empty(n)
    idx = by_dist[bounds[0]:bounds[1]]
    G[idx] = r[idx]
    for d in range(1, dist.max() + 1):
        idx = by_dist[bounds[d]:bounds[d + 1]]
        G[idx] = r[idx] + gamma * G[idx + 1]
    out = np.empty(n)
    out[order] = G
    return out


@register("grpo")
def grpo(steps: pl.DataFrame, cfg, invalid_penalty: float) -> pl.DataFrame:
    """GRPO (credit-assignment.md, "GRPO (episode level only)"): `A_t = A^E(τ)`, no step-level term."""
    t = _Table(steps)
    return t.output(episode_advantage(t, cfg.mode, cfg.episode_stats, invalid_penalty), None,
                    np.zeros(t.df.height))


@register("rloo")
def rloo(steps: pl.DataFrame, cfg, invalid_penalty: float) -> pl.DataFrame:
    """RLOO (credit-assignment.md, RLOO): `A^E = R(τ) − mean of the other episodes' R = N/(N−1)(R − mean_g R)`."""
    t = _Table(steps)
    task_ep = t.task[t.starts]
    k = _dense_keys(task_ep)
    N = np.bincount(k)[k]
    centred = group_norm(t.episode_sum(t.reward), task_ep, "mean_norm")
    a_ep = np.where(N > 1, N / np.maximum(N - 1, 1) * centred, 0.0)
    return t.output(np.repeat(a_ep, t.lengths) - penalty(t.valid, invalid_penalty), None, np.zeros(t.df.height))


@register("gigpo")
def gigpo(steps: pl.DataFrame, cfg, invalid_penalty: float) -> pl.DataFrame:
    """GiGPO (credit-assignment.md, GiGPO): `A_t = A^E(τ) + ω · norm(G_t − p_t; step group of t)`.

    Step groups come from the group stage (`step_group`: same task group, same anchor) or, with
    `similarity_threshold`, from greedy clustering of the anchor strings within each task group.
    """
    t = _Table(steps)
    if cfg.similarity_threshold is not None:
        from pipeline.grouping import similarity_groups

        groups = similarity_groups(t.df, cfg.similarity_threshold).to_numpy()
    else:
        groups = t.col("step_group")
    score = t.returns(t.reward, cfg.gamma) - penalty(t.valid, invalid_penalty)
    return t.output(episode_advantage(t, cfg.mode, cfg.episode_stats, invalid_penalty), score,
                    cfg.step_advantage_w * group_norm(score, groups, cfg.mode))


@register("hgpo")
def hgpo(steps: pl.DataFrame, cfg, invalid_penalty: float) -> pl.DataFrame:
    """HGPO (credit-assignment.md, HGPO): `A_t = Σ_k w_k norm(G_t − p_t; key_k group)`, `w_k ∝ (k+1)^α`.

    `history_groups[k-1]` is the id of the key (task group, s_{t−k+1}, …, s_t) from the group stage; the sum runs
    over the depths whose group is not a singleton and the weights are renormalised over them. With
    `base_group`, `A^E` is added as a k = 0 term of weight 1.
    """
    t = _Table(steps)
    n = t.df.height
    lens = t.df["history_groups"].list.len()
    depth = int(lens.min()) if n else 0
    if n and lens.max() != depth:
        raise ValueError("history_groups: rows carry keys of different depths; rerun the group stage")
    keys = (t.df["history_groups"].list.to_array(depth).to_numpy().reshape(n, depth) if n
            else np.zeros((0, 0), np.int64))
    score = t.returns(t.reward, cfg.gamma) - penalty(t.valid, invalid_penalty)
    num, den = np.zeros(n), np.zeros(n)
    for k in range(1, depth + 1):
        key = _dense_keys(keys[:, k - 1])
        w = np.where(np.bincount(key)[key] > 1, float((k + 1) ** cfg.alpha), 0.0)
        num += w * group_norm(score, key, cfg.mode, cfg.std)
        den += w
    step_adv = np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)
    ep_adv = (episode_advantage(t, cfg.episode_mode, cfg.episode_stats, invalid_penalty) if cfg.base_group
              else np.zeros(n))
    return t.output(ep_adv, score, step_adv)


@register("oprl")
def oprl(steps: pl.DataFrame, cfg, invalid_penalty: float) -> pl.DataFrame:
    """OPRL (credit-assignment.md, OPRL): `A_t = A^E(τ) + α · norm(r_φ(t) − p_t; all turns of g)`.

    `score` is the implicit step reward r_φ(t) written by the fit stage (β included).
    """
    t = _Table(steps)
    score = t.col("score").astype(np.float64) - penalty(t.valid, invalid_penalty)
    return t.output(episode_advantage(t, cfg.episode_mode, cfg.episode_stats, invalid_penalty), score,
                    cfg.alpha * group_norm(score, t.task, cfg.mode))


@register("spa")
def spa(steps: pl.DataFrame, cfg, invalid_penalty: float) -> pl.DataFrame:
    """SPA, critic-free (credit-assignment.md, SPA): `A_t = A^E(τ) + ω · norm(G^SPA_t − p_t; all turns of g)`.

    `score` is the progress estimator's contribution c_t (fit stage); the step reward is
    `r^SPA_t = progress_w · c_t + grounding_w · g_t` with g_t = 1 for a valid, executed action, and `G^SPA` its
    γ-discounted return within the episode.
    """
    t = _Table(steps)
    r_spa = cfg.progress_w * t.col("score").astype(np.float64) + cfg.grounding_w * t.valid.astype(np.float64)
    score = t.returns(r_spa, cfg.gamma) - penalty(t.valid, invalid_penalty)
    return t.output(episode_advantage(t, cfg.episode_mode, cfg.episode_stats, invalid_penalty), score,
                    cfg.step_advantage_w * group_norm(score, t.task, cfg.mode))


def compute_advantages(steps: pl.DataFrame, credit_cfg) -> pl.DataFrame:
    """Dispatch on `credit.method`; the result is sorted by (`episode_id`, `step`)."""
    method = credit_cfg.method
    if method not in ESTIMATORS:
        raise ValueError(f"credit.method: unknown method {method!r}; expected one of {sorted(ESTIMATORS)}")
    need = ("episode_id", "step", "task_group", "reward", "action_valid") + EXTRA_COLUMNS[method]
    missing = [c for c in need if c not in steps.columns]
    if missing:
        raise ValueError(f"credit.method {method!r} needs columns {missing}, which the input table lacks")
    return ESTIMATORS[method](steps, getattr(credit_cfg, method), credit_cfg.invalid_penalty)
