"""Stage `group`: task groups and anchor-state step groups for iteration i's step table."""

from __future__ import annotations

from pipeline.grouping import build_groups, group_size_distribution
from pipeline.registry import GROUPS, STEPS
from pipeline.stagekit import parse_args, stage_errors
from pipeline.tables import GROUPS as GROUPS_SCHEMA
from pipeline.tables import STEPS as STEPS_SCHEMA
from pipeline.tables import read_table, write_table
from pipeline.tracking import Tracker


def main(argv=None) -> None:
    ctx = parse_args("group", per_iteration=True, argv=argv)
    with stage_errors(ctx), Tracker(ctx.params, "group", ctx.iteration) as tracker:
        steps = read_table(ctx.path(STEPS), STEPS_SCHEMA)
        groups = build_groups(steps)
        write_table(groups, ctx.path(GROUPS), GROUPS_SCHEMA)
        dist = group_size_distribution(groups)
        tracker.log_metrics({f"group/{k}": v for k, v in dist.items()}, step=ctx.iteration, parent=True)
        ctx.log(f"wrote {ctx.path(GROUPS)}: " + ", ".join(f"{k} {v:.3f}" for k, v in dist.items()))


if __name__ == "__main__":
    main()
