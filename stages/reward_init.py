"""Stage `reward_init`: the learned step-reward model before any RL (only for OPRL and SPA).

OPRL: the implicit PRM starts as an exact copy of the initial policy (credit-assignment.md, OPRL). SPA: the
progress estimator is the initial policy's base model with a zero scalar head, and its replay starts empty
(credit-assignment.md, SPA).
"""

from __future__ import annotations

import shutil

from pipeline.registry import CHECKPOINT, REPLAY, REWARD_MODEL
from pipeline.stagekit import parse_args, stage_errors
from pipeline.tables import REPLAY as REPLAY_SCHEMA
from pipeline.tables import atomic_dir, empty_table, write_table
from pipeline.tracking import Tracker


def main(argv=None) -> None:
    ctx = parse_args("reward_init", per_iteration=False, argv=argv)
    p = ctx.params
    method = p.credit.method
    with stage_errors(ctx), Tracker(p, "reward_init", None):
        if not p.credit.needs_fit:
            raise ValueError(f"credit.method {method!r} has no learned step-reward model; nothing to initialise")
        policy = ctx.path(CHECKPOINT, 0)
        out = ctx.path(REWARD_MODEL, 0)
        if not (policy / "config.json").is_file():
            raise FileNotFoundError(f"{policy}: initial policy checkpoint missing; run the init stage")
        with atomic_dir(out) as tmp:
            if method == "oprl":
                for f in policy.iterdir():
                    if f.is_file() and f.name != "optimizer.pt":
                        shutil.copy2(f, tmp / f.name)
                ctx.log(f"wrote {out}: the implicit PRM, a copy of {policy}")
            else:
                from pipeline.policy import load_policy
                from pipeline.reward_models import ProgressEstimator

                _, tokenizer = load_policy(policy, p.policy.dtype)
                est = ProgressEstimator.from_policy(policy, p.policy.dtype)
                est.save(tmp)
                tokenizer.save_pretrained(tmp)
                ctx.log(f"wrote {out}: progress estimator on the body of {policy}, zero head")
        if method == "spa":
            write_table(empty_table(REPLAY_SCHEMA), ctx.path(REPLAY, 0), REPLAY_SCHEMA)
            ctx.log(f"wrote {ctx.path(REPLAY, 0)} (empty)")


if __name__ == "__main__":
    main()
