"""Stage `reward_init`: the learned step-reward model before any RL (only for methods that have one).

The method's `StepRewardModel.init` builds it from the initial policy (docs/credit-assignment.md): OPRL's implicit PRM
is an exact copy of it, SPA's progress estimator is its base model with a zero scalar head and an empty replay.
"""

from __future__ import annotations

from pipeline.credit.methods import get
from pipeline.credit.reward_model import save_state
from pipeline.data import paths
from pipeline.workflow.cli import parse_args, stage_job
from pipeline.workflow.tracking import Tracker


def main(argv=None) -> None:
    ctx = parse_args("reward_init", per_iteration=False, argv=argv)
    p = ctx.params
    with stage_job(ctx), Tracker(p, "reward_init", None):
        model = get(p.credit.method).reward_model
        if model is None:
            raise ValueError(f"credit.method {p.credit.method!r} has no learned step-reward model; nothing to "
                             "initialise")
        policy = ctx.path(paths.CHECKPOINT, 0)
        if not (policy / "config.json").is_file():
            raise FileNotFoundError(f"{policy}: initial policy checkpoint missing; run the init stage")
        out = ctx.path(paths.REWARD_MODEL, 0)
        save_state(model, model.init(policy, p), out, ctx.path(paths.ITER_DIR, 0))
        ctx.log(f"wrote {out} ({p.credit.method}'s step-reward model before any RL)"
                + "".join(f" and {ctx.path(paths.ITER_DIR, 0) / n}" for n in model.extra_tables))


if __name__ == "__main__":
    main()
