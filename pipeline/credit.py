"""Advantage estimators: pure, vectorised functions over the step table, registered by name.

Each estimator takes a polars frame with at least `episode_id`, `step`, `task_group`, `reward`, `action_valid`
(plus whatever columns its method needs) and its config section, and returns the frame's keys with
`episode_advantage`, `step_advantage` and `advantage`. No I/O, no model. The maths is credit-assignment.md's.
"""

from __future__ import annotations

from collections.abc import Callable

import polars as pl

EPS = 1e-6  # credit-assignment.md, Terms: ε in every normalisation

ESTIMATORS: dict[str, Callable[..., pl.DataFrame]] = {}


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


def episode_returns(steps: pl.DataFrame) -> pl.DataFrame:
    """One row per episode: `R(τ) = Σ_t r_t` (credit-assignment.md, Terms)."""
    return steps.group_by("episode_id").agg(pl.col("task_group").first(), pl.col("reward").sum().alias("R"))


def episode_advantage(steps: pl.DataFrame, mode: str, episode_stats: str, invalid_penalty: float) -> pl.Expr:
    """`A^E` (credit-assignment.md, GRPO; Invalid actions) as a column of `steps`.

    Group statistics come from one value per episode (`per_episode`, the paper) or one per turn row
    (`per_turn`, the released GiGPO code), always of the unpenalised returns.

    **Decision** (Invalid actions): the penalty is subtracted from the invalid row's normalised episode score,
    `A^E_row = norm(R(τ)) − invalid_penalty`. Subtracting it before normalising would divide it by `std + ε`,
    which turns a 0.1 penalty into −1e5 in a group whose episodes all have the same return.
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
    penalty = pl.when(pl.col("action_valid")).then(0.0).otherwise(invalid_penalty)
    return pl.when(count > 1).then(adv).otherwise(0.0) - penalty


@register("grpo")
def grpo(steps: pl.DataFrame, cfg, invalid_penalty: float) -> pl.DataFrame:
    """GRPO (credit-assignment.md, "GRPO (episode level only)"): `A_t = A^E(τ)`, no step-level term."""
    return steps.select(
        "episode_id", "step",
        episode_advantage(steps, cfg.mode, cfg.episode_stats, invalid_penalty).alias("episode_advantage"),
    ).with_columns(pl.lit(0.0).alias("step_advantage"), pl.col("episode_advantage").alias("advantage"))


def compute_advantages(steps: pl.DataFrame, credit_cfg) -> pl.DataFrame:
    """Dispatch on `credit.method`; the result is sorted like the step table's keys."""
    method = credit_cfg.method
    if method not in ESTIMATORS:
        raise ValueError(f"credit.method: unknown method {method!r}; expected one of {sorted(ESTIMATORS)}")
    out = ESTIMATORS[method](steps, getattr(credit_cfg, method), credit_cfg.invalid_penalty)
    return out.sort("episode_id", "step")
