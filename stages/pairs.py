"""Stage `pairs`: iteration i's step-level preference pairs (`update.objective: step_dpo`): turns of one state with
different actions, ranked by the credit method's step values (`pipeline.credit.preferences`;
docs/credit-assignment.md, Step-level preference updates)."""

from __future__ import annotations

import polars as pl

from pipeline.credit.methods import credit_table
from pipeline.credit.oracle import oracle_replay
from pipeline.credit.preferences import build_pairs, oracle_rewards, pair_stats, turn_values
from pipeline.data import paths, tables
from pipeline.workflow.cli import parse_args, stage_job
from pipeline.workflow.tracking import Tracker


def main(argv=None) -> None:
    ctx = parse_args("pairs", per_iteration=True, argv=argv)
    p = ctx.params
    cfg = p.update.step_dpo
    with stage_job(ctx), Tracker(p, "pairs", ctx.iteration) as tracker:
        table = credit_table(p, ctx.path(paths.STEPS), ctx.path(paths.GROUPS), ctx.path(paths.STEP_REWARDS))
        values = turn_values(table, p.credit, cfg.gamma)
        oracle = None
        if cfg.margin == "oracle":
            ordered = table.sort("episode_id", "step")
            oracle = oracle_rewards(pl.concat([ordered.select("episode_id", "step"), oracle_replay(
                ordered, p.env).select("distance", "distance_after")], how="horizontal"))
        pairs, undefined = build_pairs(table, values, cfg, oracle, p.credit.attribution)
        tables.write_table(pairs, ctx.path(paths.PAIRS), tables.PAIRS)
        stats = pair_stats(pairs, table.height, undefined)
        tracker.log_metrics({f"pairs/{k}": v for k, v in stats.items()}, step=ctx.iteration, parent=True)
        ctx.log(f"wrote {ctx.path(paths.PAIRS)} ({p.credit.method}'s step values, margin {cfg.margin}, form "
                f"{cfg.margin_form}): " + ", ".join(f"{k} {v:.3f}" for k, v in stats.items()))


if __name__ == "__main__":
    main()
