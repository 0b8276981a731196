"""Stage `advantages`: per-turn advantages with `credit.method` (docs/credit-assignment.md)."""

from __future__ import annotations

import polars as pl

from pipeline.credit.methods import compute_advantages, credit_table
from pipeline.data import paths, tables
from pipeline.workflow.cli import parse_args, stage_job
from pipeline.workflow.tracking import Tracker


class NonFiniteAdvantageError(ValueError):
    pass


def advantages_excluding_env_errors(table: pl.DataFrame, credit) -> pl.DataFrame:
    """`compute_advantages` on the episodes whose environment never raised; the others get advantage 0.

    A crashed episode (`env_error` set on its last row, see `pipeline.rollout.episodes`) says nothing about the
    policy: it neither enters the group statistics nor trains the policy.
    """
    broken = table.filter(pl.col("env_error").is_not_null())["episode_id"].unique()
    if broken.is_empty():
        return compute_advantages(table, credit)
    ok = table.filter(~pl.col("episode_id").is_in(broken.implode()))
    zeros = table.filter(pl.col("episode_id").is_in(broken.implode())).select(
        "episode_id", "step", pl.lit(0.0).alias("episode_advantage"), pl.lit(None, pl.Float64).alias("step_score"),
        pl.lit(0.0).alias("step_advantage"), pl.lit(0.0).alias("penalty"), pl.lit(0.0).alias("advantage"))
    return pl.concat([compute_advantages(ok, credit), zeros]).sort("episode_id", "step")


def main(argv=None) -> None:
    ctx = parse_args("advantages", per_iteration=True, argv=argv)
    p = ctx.params
    with stage_job(ctx), Tracker(p, "advantages", ctx.iteration) as tracker:
        table = credit_table(p, ctx.path(paths.STEPS), ctx.path(paths.GROUPS), ctx.path(paths.STEP_REWARDS))
        adv = advantages_excluding_env_errors(table, p.credit)
        bad = adv.join(table.select("episode_id", "step", "task_group"), on=["episode_id", "step"]).filter(
            ~pl.col("advantage").is_finite())
        if bad.height:
            raise NonFiniteAdvantageError(
                f"iteration {ctx.iteration}: {bad.height} non-finite advantages, first in task_group "
                f"{bad['task_group'][0]} (episode {bad['episode_id'][0]})")
        tables.write_table(adv, ctx.path(paths.ADVANTAGES), tables.ADVANTAGES)
        stats = {
            "advantage_mean": float(adv["advantage"].mean()),
            "advantage_std": float(adv["advantage"].std()),
            "advantage_abs_max": float(adv["advantage"].abs().max()),
            "share_nonzero_step_advantage": float((adv["step_advantage"] != 0).mean()),
            "share_zero_advantage": float((adv["advantage"] == 0).mean()),
        }
        tracker.log_metrics({f"adv/{k}": v for k, v in stats.items()}, step=ctx.iteration, parent=True)
        ctx.log(f"wrote {ctx.path(paths.ADVANTAGES)} with {p.credit.method}: "
                + ", ".join(f"{k} {v:.3f}" for k, v in stats.items()))


if __name__ == "__main__":
    main()
