"""Stage `group`: task groups, anchor-state step groups and HGPO's history keys for iteration i's step table.

Logs the step-group size distribution (credit-assignment.md, GiGPO: singletons, 2-5, 6-9, >= 10) and the share of
turns in non-singleton groups.
"""

from __future__ import annotations

from pipeline.grouping import build_groups, group_size_distribution, hgpo_depth
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
        depth = hgpo_depth(ctx.params)
        groups = build_groups(steps, depth)
        write_table(groups, ctx.path(GROUPS), GROUPS_SCHEMA)
        dist = group_size_distribution(groups)
        tracker.log_metrics({f"group/{k}": v for k, v in dist.items()}, step=ctx.iteration, parent=True)
        ctx.log(f"wrote {ctx.path(GROUPS)}: " + ", ".join(f"{k} {v:.3f}" for k, v in dist.items()))


if __name__ == "__main__":
    main()
