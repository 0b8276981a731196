"""Stage `fit`: the learned per-turn model of iteration i and its per-turn scores (methods that have one).

The method's `StepRewardModel` (docs/credit-assignment.md: OPRL's implicit PRM, SPA's progress estimator, GAE's
critic) is loaded as it was after iteration i-1, prepares iteration i's turns, fits on them and scores them, in the
order the method says (OPRL scores with the PRM as it was before its update unless `score_with: after`; GAE's
critic scores before its fit), and is saved as the model of i. Writes `step_rewards.parquet`
(`tables.STEP_REWARDS`), which the advantages stage turns into advantages, and `fit_metrics.json`, the fit's
statistics (the model's losses; GAE's critic: its loss before and after the fit and the explained variance of its
values).
"""

from __future__ import annotations

import json
import math

import polars as pl

from pipeline.credit.methods import get
from pipeline.credit.reward_model import OPTIMIZER, fit_iteration, load_state, save_state
from pipeline.data import paths, tables
from pipeline.model import adamw
from pipeline.workflow.cli import parse_args, stage_job
from pipeline.workflow.tracking import Tracker


def main(argv=None) -> None:
    ctx = parse_args("fit", per_iteration=True, argv=argv)
    p, it = ctx.params, ctx.iteration
    with stage_job(ctx), Tracker(p, "fit", it) as tracker:
        model = get(p.credit.method).reward_model
        if model is None:
            raise ValueError(f"credit.method {p.credit.method!r} has no learned step-reward model to fit")
        steps = tables.read_table(ctx.path(paths.STEPS), tables.STEPS).sort("episode_id", "step")
        state = load_state(model, ctx.path(paths.REWARD_MODEL, it - 1), ctx.path(paths.ITER_DIR, it - 1), p)
        ctx.log(f"fitting {p.credit.method}'s step-reward model of iteration {it - 1} on {steps.height} turns")
        scores, stats = fit_iteration(model, state, steps, ctx.path(paths.ROLLOUT_CHECKPOINT),
                                      ctx.path(paths.CHECKPOINT, 0), it, p, ctx.log)
        save_state(model, state, ctx.path(paths.REWARD_MODEL), ctx.path(paths.ITER_DIR))
        rewards = steps.select("episode_id", "step").with_columns(pl.Series("score", scores, dtype=pl.Float64))
        tables.write_table(rewards, ctx.path(paths.STEP_REWARDS), tables.STEP_REWARDS)
        finite = {k: v for k, v in stats.items() if math.isfinite(v)}
        tables.write_text_atomic(ctx.path(paths.FIT_METRICS), json.dumps({"iteration": it, **finite}, indent=2) + "\n")
        adamw.prune(ctx.path(paths.ITER_DIR), OPTIMIZER, p.runtime.keep_optimizer)
        tracker.log_metrics({f"fit/{k}": v for k, v in finite.items()}, step=it, parent=True)
        s = rewards["score"]
        ctx.log(f"wrote {ctx.path(paths.REWARD_MODEL)} and {ctx.path(paths.STEP_REWARDS)}: {len(s)} turns, score mean "
                f"{s.mean() or 0:.4g}, std {s.std() or 0:.4g}; " + ", ".join(f"{k} {v:.4g}" for k, v in stats.items()))


if __name__ == "__main__":
    main()
