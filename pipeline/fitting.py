"""One iteration of each learned step-reward model, on in-memory tables and models (credit-assignment.md, OPRL;
SPA). The fit stage wraps these with its files; the credit-quality benchmark replays them over a saved run."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import polars as pl
import torch

from pipeline.reward_models import prm_update, spa_loss, train_progress, turn_logprob_sums


def oprl_iteration(prm, old_model, optimizer, steps: pl.DataFrame, cfg, pad_id: int,
                   log: Callable[[str], None] | None = None) -> tuple[np.ndarray, dict[str, float]]:
    """Score the turns of `steps` (sorted by episode and step) with `prm` before (or after, `score_with`) its
    update on this iteration's success/failure pairs; `old_model` is the rollout policy. Returns r_φ per turn."""
    prompts, responses = steps["prompt_ids"].to_list(), steps["response_ids"].to_list()
    old_sums = turn_logprob_sums(old_model, prompts, responses, pad_id, cfg.batch_size)
    engine = np.array([float(np.sum(x)) for x in steps["response_logprobs"].to_list()])
    before = cfg.beta * (turn_logprob_sums(prm, prompts, responses, pad_id, cfg.batch_size) - old_sums)
    episodes = steps.group_by("episode_id", maintain_order=True).agg(
        pl.col("task_group").first(), pl.col("success").first())
    ep_index = {e: i for i, e in enumerate(episodes["episode_id"].to_list())}
    turn_episode = np.array([ep_index[e] for e in steps["episode_id"].to_list()], dtype=np.int64)
    stats = prm_update(prm, optimizer, prompts, responses, old_sums, turn_episode,
                       episodes["task_group"].to_numpy(), episodes["success"].to_numpy(), cfg, pad_id, log)
    scores = before
    if cfg.score_with == "after":
        scores = cfg.beta * (turn_logprob_sums(prm, prompts, responses, pad_id, cfg.batch_size) - old_sums)
    stats.update({"logprob_mismatch_abs_mean": float(np.abs(engine - old_sums).mean()) if len(engine) else 0.0,
                  "score_abs_mean": float(np.abs(scores).mean()) if len(scores) else 0.0})
    return scores, stats


def spa_iteration(est, optimizer, replay: pl.DataFrame, steps: pl.DataFrame, iteration: int, cfg, pad_id: int,
                  seed: int, log: Callable[[str], None] | None = None
                  ) -> tuple[np.ndarray, pl.DataFrame, dict[str, float]]:
    """Extend the replay with this iteration's turns (keeping the last `replay_iterations` iterations), train the
    progress estimator on it, then score this iteration's turns. Returns (c_t per turn, new replay, stats)."""
    current = steps.select(
        "iteration", "episode_id", "step", "prompt_ids", "response_ids",
        pl.col("success").cast(pl.Float64).alias("outcome"))
    keep = pl.col("iteration") > iteration - cfg.replay_iterations
    replay = pl.concat([replay.filter(keep), current.filter(keep)]).sort("episode_id", "step")
    ep_ids = replay["episode_id"].unique(maintain_order=True).to_list()
    ep_index = {e: i for i, e in enumerate(ep_ids)}
    turn_episode = np.array([ep_index[e] for e in replay["episode_id"].to_list()], dtype=np.int64)
    outcome = replay.group_by("episode_id", maintain_order=True).agg(pl.col("outcome").first())["outcome"].to_numpy()
    if log is not None:
        log(f"training the progress estimator on {len(ep_ids)} episodes ({replay.height} turns) of iterations "
            f"{replay['iteration'].min()}..{replay['iteration'].max()}")
    stats = train_progress(est, optimizer, replay["prompt_ids"].to_list(), replay["response_ids"].to_list(),
                           turn_episode, outcome, cfg, pad_id, seed=seed, progress=log)
    c = est.contributions(steps["prompt_ids"].to_list(), steps["response_ids"].to_list(), pad_id,
                          cfg.batch_size).double().cpu()
    if not torch.isfinite(c).all():
        raise ValueError(f"iteration {iteration}: the progress estimator gave non-finite contributions")
    cur_eps = steps["episode_id"].unique(maintain_order=True).to_list()
    cur_index = {e: i for i, e in enumerate(cur_eps)}
    te = torch.tensor([cur_index[e] for e in steps["episode_id"].to_list()], dtype=torch.long)
    cur_outcome = torch.tensor(steps.group_by("episode_id", maintain_order=True).agg(
        pl.col("success").first())["success"].cast(pl.Float64).to_numpy())
    stats["estimator_loss_current"] = float(spa_loss(c, te, cur_outcome)) if len(cur_eps) else 0.0
    stats["score_abs_mean"] = float(c.abs().mean()) if len(c) else 0.0
    return c.numpy(), replay, stats
