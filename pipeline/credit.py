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


def normalise(x: pl.Expr, group: str | list[str], mode: str, std: str = "unbiased") -> pl.Expr:
    """`norm(x; G)` of credit-assignment.md, Terms; a group of size 1 gives 0."""
    centred = x - x.mean().over(group)
    if mode == "mean_norm":
        out = centred
    elif mode == "mean_std_norm":
        ddof = 1 if std == "unbiased" else 0
        out = centred / (x.std(ddof=ddof).over(group) + EPS)
    else:
        raise ValueError(f"unknown normalisation mode {mode!r}; expected mean_norm or mean_std_norm")
    return pl.when(pl.len().over(group) > 1).then(out).otherwise(0.0)


def penalty(invalid_penalty: float) -> pl.Expr:
    """`invalid_penalty` on rows whose action was invalid, else 0 (credit-assignment.md, Invalid actions)."""
    return pl.when(pl.col("action_valid")).then(0.0).otherwise(invalid_penalty)


def episode_returns(steps: pl.DataFrame) -> pl.DataFrame:
    """One row per episode: `R(τ) = Σ_t r_t` (credit-assignment.md, Terms)."""
    return steps.group_by("episode_id").agg(pl.col("task_group").first(), pl.col("reward").sum().alias("R"))


def episode_advantage(steps: pl.DataFrame, mode: str, episode_stats: str, invalid_penalty: float) -> pl.Expr:
    """`A^E` (credit-assignment.md, GRPO; Invalid actions) as a column of `steps`.

    Group statistics come from one value per episode (`per_episode`, the paper) or one per turn row
    (`per_turn`, the released GiGPO code), always of the unpenalised returns; the penalty is subtracted after
    normalising (module docstring, Decisions).
    """
    R = pl.col("reward").sum().over("episode_id")
    if episode_stats == "per_turn":
        weight_rows = pl.lit(True)
    elif episode_stats == "per_episode":
        weight_rows = pl.col("step") == pl.col("step").min().over("episode_id")
    else:
        raise ValueError(f"unknown episode_stats {episode_stats!r}; expected per_episode or per_turn")
    masked = pl.when(weight_rows).then(R)
    mean = masked.mean().over("task_group")
    count = masked.count().over("task_group")
    if mode == "mean_norm":
        adv = R - mean
    elif mode == "mean_std_norm":
        std = masked.std(ddof=1).over("task_group")
        adv = (R - mean) / (std + EPS)
    else:
        raise ValueError(f"unknown normalisation mode {mode!r}; expected mean_norm or mean_std_norm")
    return pl.when(count > 1).then(adv).otherwise(0.0) - penalty(invalid_penalty)


def discounted_returns(episode_id: np.ndarray, step: np.ndarray, reward: np.ndarray, gamma: float) -> np.ndarray:
    """`G_t = r_t + γ G_{t+1}` within each episode (credit-assignment.md, GiGPO, step level), any row order.

    Vectorised over episodes: one numpy pass per distance from the episode's end, so the work is O(turns) and
    the number of passes is the longest episode's length.
    """
    n = len(reward)
    if n == 0:
        return np.zeros(0)
    order = np.lexsort((step, episode_id))
    ep, r = np.asarray(episode_id)[order], np.asarray(reward, dtype=np.float64)[order]
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


def _sorted(steps: pl.DataFrame) -> pl.DataFrame:
    return steps.sort("episode_id", "step")


def _with_returns(steps: pl.DataFrame, gamma: float, name: str = "G") -> pl.DataFrame:
    G = discounted_returns(steps["episode_id"].to_numpy(), steps["step"].to_numpy(),
                           steps["reward"].to_numpy(), gamma)
    return steps.with_columns(pl.Series(name, G, dtype=pl.Float64))


def _finish(df: pl.DataFrame) -> pl.DataFrame:
    return df.with_columns(
        (pl.col("episode_advantage") + pl.col("step_advantage")).alias("advantage")).select(OUTPUT)


@register("grpo")
def grpo(steps: pl.DataFrame, cfg, invalid_penalty: float) -> pl.DataFrame:
    """GRPO (credit-assignment.md, "GRPO (episode level only)"): `A_t = A^E(τ)`, no step-level term."""
    steps = _sorted(steps)
    return _finish(steps.select(
        "episode_id", "step",
        episode_advantage(steps, cfg.mode, cfg.episode_stats, invalid_penalty).alias("episode_advantage"),
        pl.lit(None, dtype=pl.Float64).alias("step_score"), pl.lit(0.0).alias("step_advantage")))


@register("rloo")
def rloo(steps: pl.DataFrame, cfg, invalid_penalty: float) -> pl.DataFrame:
    """RLOO (credit-assignment.md, RLOO): `A^E = R(τ) − mean of the other episodes' R = N/(N−1)(R − mean_g R)`."""
    steps = _sorted(steps)
    eps = episode_returns(steps).with_columns(
        pl.len().over("task_group").alias("N"), pl.col("R").mean().over("task_group").alias("mean_R"))
    eps = eps.with_columns(
        pl.when(pl.col("N") > 1).then(pl.col("N") / (pl.col("N") - 1) * (pl.col("R") - pl.col("mean_R")))
        .otherwise(0.0).alias("A_E")).select("episode_id", "A_E")
    df = steps.join(eps, on="episode_id", how="left", maintain_order="left")
    return _finish(df.select(
        "episode_id", "step", (pl.col("A_E") - penalty(invalid_penalty)).alias("episode_advantage"),
        pl.lit(None, dtype=pl.Float64).alias("step_score"), pl.lit(0.0).alias("step_advantage")))


@register("gigpo")
def gigpo(steps: pl.DataFrame, cfg, invalid_penalty: float) -> pl.DataFrame:
    """GiGPO (credit-assignment.md, GiGPO): `A_t = A^E(τ) + ω · norm(G_t − p_t; step group of t)`.

    Step groups come from the group stage (`step_group`: same task group, same anchor) or, with
    `similarity_threshold`, from greedy clustering of the anchor strings within each task group.
    """
    steps = _sorted(steps)
    if cfg.similarity_threshold is not None:
        from pipeline.grouping import similarity_groups

        steps = steps.with_columns(similarity_groups(steps, cfg.similarity_threshold).alias("step_group"))
    df = _with_returns(steps, cfg.gamma).with_columns((pl.col("G") - penalty(invalid_penalty)).alias("step_score"))
    return _finish(df.select(
        "episode_id", "step",
        episode_advantage(df, cfg.mode, cfg.episode_stats, invalid_penalty).alias("episode_advantage"),
        "step_score",
        (cfg.step_advantage_w * normalise(pl.col("step_score"), "step_group", cfg.mode)).alias("step_advantage")))


@register("hgpo")
def hgpo(steps: pl.DataFrame, cfg, invalid_penalty: float) -> pl.DataFrame:
    """HGPO (credit-assignment.md, HGPO): `A_t = Σ_k w_k norm(G_t − p_t; key_k group)`, `w_k ∝ (k+1)^α`.

    `history_groups[k-1]` is the id of the key (task group, s_{t−k+1}, …, s_t) from the group stage; the sum runs
    over the depths whose group is not a singleton and the weights are renormalised over them. With
    `base_group`, `A^E` is added as a k = 0 term of weight 1.
    """
    steps = _sorted(steps)
    depth = steps["history_groups"].list.len().min() if steps.height else 0
    if steps.height and steps["history_groups"].list.len().max() != depth:
        raise ValueError("history_groups: rows carry keys of different depths; rerun the group stage")
    df = _with_returns(steps, cfg.gamma).with_columns((pl.col("G") - penalty(invalid_penalty)).alias("step_score"))
    df = df.with_columns(pl.col("history_groups").list.get(k).alias(f"_key{k + 1}") for k in range(depth))
    num, den = pl.lit(0.0), pl.lit(0.0)
    for k in range(1, depth + 1):
        key = f"_key{k}"
        w = pl.when(pl.len().over(key) > 1).then(float((k + 1) ** cfg.alpha)).otherwise(0.0)
        num = num + w * normalise(pl.col("step_score"), key, cfg.mode, cfg.std)
        den = den + w
    step_adv = pl.when(den > 0).then(num / den).otherwise(0.0)
    ep_adv = (episode_advantage(df, cfg.episode_mode, cfg.episode_stats, invalid_penalty) if cfg.base_group
              else pl.lit(0.0))
    return _finish(df.select("episode_id", "step", ep_adv.alias("episode_advantage"), "step_score",
                             step_adv.alias("step_advantage")))


@register("oprl")
def oprl(steps: pl.DataFrame, cfg, invalid_penalty: float) -> pl.DataFrame:
    """OPRL (credit-assignment.md, OPRL): `A_t = A^E(τ) + α · norm(r_φ(t) − p_t; all turns of g)`.

    `score` is the implicit step reward r_φ(t) written by the fit stage (β included).
    """
    steps = _sorted(steps).with_columns((pl.col("score") - penalty(invalid_penalty)).alias("step_score"))
    return _finish(steps.select(
        "episode_id", "step",
        episode_advantage(steps, cfg.episode_mode, cfg.episode_stats, invalid_penalty).alias("episode_advantage"),
        "step_score",
        (cfg.alpha * normalise(pl.col("step_score"), "task_group", cfg.mode)).alias("step_advantage")))


@register("spa")
def spa(steps: pl.DataFrame, cfg, invalid_penalty: float) -> pl.DataFrame:
    """SPA, critic-free (credit-assignment.md, SPA): `A_t = A^E(τ) + ω · norm(G^SPA_t − p_t; all turns of g)`.

    `score` is the progress estimator's contribution c_t (fit stage); the step reward is
    `r^SPA_t = progress_w · c_t + grounding_w · g_t` with g_t = 1 for a valid, executed action, and `G^SPA` its
    γ-discounted return within the episode.
    """
    steps = _sorted(steps)
    r_spa = (cfg.progress_w * pl.col("score")
             + cfg.grounding_w * pl.col("action_valid").cast(pl.Float64))
    tmp = steps.with_columns(r_spa.alias("reward"))
    G = discounted_returns(tmp["episode_id"].to_numpy(), tmp["step"].to_numpy(), tmp["reward"].to_numpy(),
                           cfg.gamma)
    df = steps.with_columns(pl.Series("G", G, dtype=pl.Float64)).with_columns(
        (pl.col("G") - penalty(invalid_penalty)).alias("step_score"))
    return _finish(df.select(
        "episode_id", "step",
        episode_advantage(df, cfg.episode_mode, cfg.episode_stats, invalid_penalty).alias("episode_advantage"),
        "step_score",
        (cfg.step_advantage_w * normalise(pl.col("step_score"), "task_group", cfg.mode)).alias("step_advantage")))


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
