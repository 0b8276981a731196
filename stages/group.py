"""Stage `group`: task groups, anchor-state step groups and HGPO's history keys for iteration i's step table.

Logs the step-group size distribution (docs/credit-assignment.md, GiGPO: singletons, 2-5, 6-9, >= 10) and the share of
turns in non-singleton groups; for a branching rollout also the share of its branch points in one step group and
of its sampled turns with a step signal (`pipeline.rollout.branching.branch_point_groups`).
"""

from __future__ import annotations

from pipeline.credit.grouping import build_groups, group_size_distribution
from pipeline.data import paths, tables
from pipeline.rollout.branching import branch_point_groups
from pipeline.workflow.cli import parse_args, stage_job
from pipeline.workflow.tracking import Tracker


def main(argv=None) -> None:
    ctx = parse_args("group", per_iteration=True, argv=argv)
    with stage_job(ctx), Tracker(ctx.params, "group", ctx.iteration) as tracker:
        steps = tables.read_table(ctx.path(paths.STEPS), tables.STEPS)
        depth = ctx.params.credit.history_depth(ctx.params.prompt.history_turns)
        groups = build_groups(steps, depth)
        tables.write_table(groups, ctx.path(paths.GROUPS), tables.GROUPS)
        dist = group_size_distribution(groups)
        if steps["parent_episode"].is_not_null().any():   # a branching rollout: its branch points and step signal
            dist |= branch_point_groups(steps, groups)
        tracker.log_metrics({f"group/{k}": v for k, v in dist.items()}, step=ctx.iteration, parent=True)
        ctx.log(f"wrote {ctx.path(paths.GROUPS)}: " + ", ".join(f"{k} {v:.3f}" for k, v in dist.items()))


if __name__ == "__main__":
    main()
