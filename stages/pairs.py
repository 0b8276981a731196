"""Stage `pairs`: iteration i's step-level preference pairs (`update.objective: step_dpo`): turns of one state with
different actions, ranked by the credit method's step values (`pipeline.credit.preferences`;
docs/credit-assignment.md, Step-level preference updates)."""

from __future__ import annotations

import polars as pl

from pipeline.credit.oracle import oracle_replay
from pipeline.credit.preferences import build_pairs, pair_stats, turn_values
from pipeline.data import paths, tables
from pipeline.workflow.cli import parse_args, stage_job
from pipeline.workflow.tracking import Tracker


def main(argv=None) -> None:
    ctx = parse_args("pairs", per_iteration=True, argv=argv)
    p = ctx.params
    cfg = p.update.step_dpo
    with stage_job(ctx), Tracker(p, "pairs", ctx.iteration) as tracker:
        steps = tables.read_table(ctx.path(paths.STEPS), tables.STEPS)
        groups = tables.read_table(ctx.path(paths.GROUPS), tables.GROUPS).drop("task_group", "history_groups")
        tables.check_same_turns(steps, ctx.path(paths.STEPS), groups, ctx.path(paths.GROUPS), "group")
        table = steps.join(groups, on=["episode_id", "step"], how="inner", validate="1:1")
        if p.credit.needs_fit:
            rewards = tables.read_table(ctx.path(paths.STEP_REWARDS), tables.STEP_REWARDS)
            tables.check_same_turns(steps, ctx.path(paths.STEPS), rewards, ctx.path(paths.STEP_REWARDS), "fit")
            table = table.join(rewards, on=["episode_id", "step"], how="inner", validate="1:1")
        values = turn_values(table, p.credit, cfg.gamma)
        after = None
        if cfg.margin == "oracle":
            ordered = steps.sort("episode_id", "step")
            after = pl.concat([ordered.select("episode_id", "step"),
                               oracle_replay(ordered, p.env).select("distance_after")], how="horizontal")
        pairs = build_pairs(table, values, cfg, after)
        tables.write_table(pairs, ctx.path(paths.PAIRS), tables.PAIRS)
        stats = pair_stats(pairs, steps.height)
        tracker.log_metrics({f"pairs/{k}": v for k, v in stats.items()}, step=ctx.iteration, parent=True)
        ctx.log(f"wrote {ctx.path(paths.PAIRS)} ({p.credit.method}'s step values, margin {cfg.margin}): "
                + ", ".join(f"{k} {v:.3f}" for k, v in stats.items()))


if __name__ == "__main__":
    main()
