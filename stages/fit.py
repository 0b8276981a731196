"""Stage `fit`: the learned step-reward model of iteration i, and its per-turn scores (only for OPRL and SPA).

OPRL (credit-assignment.md, OPRL): the implicit PRM of i-1 scores each turn, `r_φ(t) = β Σ (log π_φ − log π_old)`,
then takes `credit.oprl.steps` AdamW steps on the pairwise success/failure loss of each task group and is saved
as the PRM of i (`score_with: after` scores with the updated PRM instead). `log π_old` is recomputed from the
rollout checkpoint with the same code that scores the PRM (so a PRM equal to the rollout policy gives exactly 0);
the rollout engine's own log-probs are only compared with it.

SPA (credit-assignment.md, SPA): the replay of i-1 is trimmed to the last `replay_iterations` iterations and
extended with iteration i's turns; the estimator of i-1 trains on it so that each episode's contributions sum to
its outcome, is saved as the estimator of i, and then scores iteration i's turns (c_t).

Writes `step_rewards.parquet` (`tables.STEP_REWARDS`); the advantages stage turns the scores into advantages.
"""

from __future__ import annotations

import math

import polars as pl
import torch

from pipeline.registry import PREV_CHECKPOINT, PREV_REPLAY, PREV_REWARD_MODEL, REPLAY, REWARD_MODEL, STEP_REWARDS, STEPS
from pipeline.stagekit import parse_args, stage_errors
from pipeline.tables import REPLAY as REPLAY_SCHEMA
from pipeline.tables import STEP_REWARDS as STEP_REWARDS_SCHEMA
from pipeline.tables import STEPS as STEPS_SCHEMA
from pipeline.tables import atomic_dir, read_table, write_table
from pipeline.tracking import Tracker

OPTIMIZER_FILE = "optimizer.pt"


def _optimizer(model, prev_dir, lr: float):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    if (prev_dir / OPTIMIZER_FILE).is_file():
        opt.load_state_dict(torch.load(prev_dir / OPTIMIZER_FILE, weights_only=True, map_location="cpu"))
        for g in opt.param_groups:
            g["lr"] = lr
    return opt


def fit_oprl(ctx, steps: pl.DataFrame, tracker) -> pl.DataFrame:
    from pipeline.fitting import oprl_iteration
    from pipeline.policy import load_policy

    p, cfg = ctx.params, ctx.params.credit.oprl
    old_model, tokenizer = load_policy(ctx.path(PREV_CHECKPOINT), p.policy.dtype, p.runtime.device)
    prm_dir = ctx.path(PREV_REWARD_MODEL)
    prm, _ = load_policy(prm_dir, p.policy.dtype, p.runtime.device)
    ctx.log(f"scoring {steps.height} turns with the rollout policy and the PRM of iteration {ctx.iteration - 1}")
    optimizer = _optimizer(prm, prm_dir, cfg.lr)
    scores, stats = oprl_iteration(prm, old_model, optimizer, steps, cfg, tokenizer.pad_token_id, ctx.log)
    out = ctx.path(REWARD_MODEL)
    with atomic_dir(out) as tmp:
        prm.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
    ctx.log(f"wrote {out}")
    tracker.log_metrics({f"fit/{k}": v for k, v in stats.items()}, step=ctx.iteration, parent=True)
    return steps.select("episode_id", "step").with_columns(pl.Series("score", scores, dtype=pl.Float64))


def fit_spa(ctx, steps: pl.DataFrame, tracker) -> pl.DataFrame:
    from transformers import AutoTokenizer

    from pipeline.fitting import spa_iteration
    from pipeline.reward_models import ProgressEstimator

    p, cfg, it = ctx.params, ctx.params.credit.spa, ctx.iteration
    prev_dir = ctx.path(PREV_REWARD_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(prev_dir, local_files_only=True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    est = ProgressEstimator.load(prev_dir, p.policy.dtype, p.runtime.device)
    replay = read_table(ctx.path(PREV_REPLAY), REPLAY_SCHEMA)
    optimizer = _optimizer(est, prev_dir, cfg.lr)
    scores, replay, stats = spa_iteration(est, optimizer, replay, steps, it, cfg, pad,
                                          seed=p.seed * 7919 + 17 * it, log=ctx.log)
    out = ctx.path(REWARD_MODEL)
    with atomic_dir(out) as tmp:
        est.save(tmp)
        tokenizer.save_pretrained(tmp)
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
    write_table(replay, ctx.path(REPLAY), REPLAY_SCHEMA)
    ctx.log(f"wrote {out} and {ctx.path(REPLAY)}")
    tracker.log_metrics({f"fit/{k}": v for k, v in stats.items() if math.isfinite(v)}, step=it, parent=True)
    return steps.select("episode_id", "step").with_columns(pl.Series("score", scores, dtype=pl.Float64))


def main(argv=None) -> None:
    ctx = parse_args("fit", per_iteration=True, argv=argv)
    p = ctx.params
    with stage_errors(ctx), Tracker(p, "fit", ctx.iteration) as tracker:
        if not p.credit.needs_fit:
            raise ValueError(f"credit.method {p.credit.method!r} has no learned step-reward model to fit")
        steps = read_table(ctx.path(STEPS), STEPS_SCHEMA).sort("episode_id", "step")
        fit = fit_oprl if p.credit.method == "oprl" else fit_spa
        rewards = fit(ctx, steps, tracker)
        write_table(rewards, ctx.path(STEP_REWARDS), STEP_REWARDS_SCHEMA)
        s = rewards["score"]
        ctx.log(f"wrote {ctx.path(STEP_REWARDS)}: {len(s)} turns, score mean {s.mean() or 0:.4g}, "
                f"std {s.std() or 0:.4g}")


if __name__ == "__main__":
    main()
