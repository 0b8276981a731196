"""OPRL: online implicit process reward (docs/credit-assignment.md, OPRL).

`A_t = A^E(τ) + α · norm(r_φ(t); all turns of g)`, with the implicit step reward
`r_φ(t) = β Σ_{tokens of the turn's response} [log π_φ − log π_old]` written by the fit stage (`score`).

The implicit PRM `π_φ` starts as a copy of the initial policy. Each iteration it scores the turns (before its
update, or after with `score_with: after`), then takes `steps` AdamW steps on the pairwise loss
`−mean log σ(S(τ+) − S(τ−))` of each task group's success/failure pairs, `S(τ) = Σ_t r_φ(t)` (or the mean). The loss
is a function of the episode scores, so its exact gradient is pushed back through the turns chunk by chunk and
memory does not grow with the iteration's size. `log π_old` is recomputed from the rollout checkpoint with the
same code that scores the PRM, so a PRM equal to the rollout policy gives exactly 0.

Drift report (`fit/prm_drift`, `fit/policy_drift`, `fit/drift_corr`): how far the PRM and the rollout policy have
moved from the initial policy (mean |Σ log π − Σ log π_init| per turn, in nats), and the correlation of r_φ with
`β (log π_init − log π_old)`. A PRM that barely moves while the policy does gives `r_φ ≈ β (log π_init − log π_old)`
(drift_corr near 1): it then measures the policy's own movement, not the preferences.

Loading params imports this module (the schema is assembled from the method registry), so torch, transformers
and `pipeline.model` are imported inside the functions that train or score (start-up cost).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import polars as pl
from pydantic import Field

from pipeline.credit.base import (
    EpisodeConfig,
    Method,
    StepTable,
    Terms,
    episode_advantage,
    group_norm,
    learned_return,
    register,
)
from pipeline.credit.reward_model import Log, StepRewardModel, check_lora, episode_index
from pipeline.data.section import FitBatching, LoraSettings, Mode
from pipeline.data.seeds import stage_seed
from pipeline.progress import Ticker


class OprlConfig(FitBatching):
    """Implicit PRM step rewards; the episode level is the shared `credit.episode`."""
    beta: float = Field(0.05, gt=0.0, description="β of the implicit reward")
    score: Literal["sum", "mean"] = Field("sum", description="episode score S: sum (paper) or mean over turns")
    score_with: Literal["before", "after"] = Field("before", description="PRM that scores the turns: as before "
                                                   "or after this iteration's update")
    alpha: float = Field(1.0, ge=0.0, description="weight of the step-level advantage")
    lr: float = Field(1e-6, gt=0.0, description="PRM AdamW learning rate")
    steps: int = Field(1, ge=0, description="PRM optimiser steps per iteration")
    grad_clip: float = Field(10.0, gt=0.0)
    mode: Mode = Field("mean_std_norm", description="normalisation of the step level")
    report_drift: bool = Field(True, description="score the turns with the initial policy too, to report how far "
                               "the PRM and the policy have drifted from it (one more forward pass)")
    lora: LoraSettings | None = Field(None, description="train LoRA adapters on the frozen initial policy as the "
                                      "PRM (null: all its weights train)")


def terms(t: StepTable, cfg: OprlConfig, episode: EpisodeConfig) -> Terms:
    """OPRL (implicit PRM): `A^E + α · norm(r_φ(t); all turns of g)`. In: the step table `t` with the fit
    stage's `score` (r_φ), the section and the episode settings; out: the terms per row, the step score r_φ."""
    r = t.col("score").astype(np.float64)
    return Terms(episode_advantage(t, episode), r, cfg.alpha * group_norm(r, t.task, cfg.mode))


# ----------------------------------------------------------------------------------------------------------------
# The implicit PRM

def turn_logprob_sums(model, prompts, responses, pad_id: int, batching: FitBatching) -> np.ndarray:
    """`Σ_{tokens of the response} log π(y|·)` per turn (float64), computed in passes of `batching.batch_size`
    turns (each one prefix tree with `packing` tree; with `micro_batch_tokens` too, trees of at most that many
    tokens).

    The same function scores the PRM and the rollout policy, so that identical weights give identical sums and
    the implicit rewards are then exactly zero.
    """
    from pipeline.model.ppo import sequence_logprobs  # start-up cost: torch

    per_token = sequence_logprobs(model, prompts, responses, pad_id, batching.batch_size, packing=batching.packing,
                                  max_tokens=batching.micro_batch_tokens)
    return np.array([float(x.double().sum()) for x in per_token], dtype=np.float64)


def episode_scores(turn_values, turn_episode, n_episodes: int, how: str):
    """`S(τ) = Σ_t r_φ(t)` (`sum`, paper) or the mean over the episode's turns (`mean`, released code)."""
    import torch  # start-up cost: torch

    S = torch.zeros(n_episodes, dtype=turn_values.dtype).index_add(0, turn_episode, turn_values)
    if how == "sum":
        return S
    if how == "mean":
        counts = torch.zeros(n_episodes, dtype=turn_values.dtype).index_add(
            0, turn_episode, torch.ones_like(turn_values))
        return S / counts.clamp(min=1)
    raise ValueError(f"unknown OPRL score {how!r}; expected sum or mean")


def pairwise_loss(S, episode_group, episode_success):
    """OPRL's PRM loss: per task group, `−mean log σ(S(τ+) − S(τ−))` over all pairs of a success τ+ and a failure
    τ−; groups without such a pair contribute nothing. The iteration's loss is the mean over the groups that have
    pairs. Returns (loss, number of pairs); the loss is 0 without pairs.
    """
    import torch  # start-up cost: torch
    import torch.nn.functional as F  # start-up cost: torch

    same = episode_group.unsqueeze(1) == episode_group.unsqueeze(0)
    pos = episode_success.bool()
    pair = same & pos.unsqueeze(1) & ~pos.unsqueeze(0)          # [i, j]: i succeeded, j failed, same group
    n_pairs = int(pair.sum())
    if n_pairs == 0:
        return S.sum() * 0.0, 0
    nll = -F.logsigmoid(S.unsqueeze(1) - S.unsqueeze(0))
    groups, inverse = torch.unique(episode_group, return_inverse=True)
    pair_group = inverse.unsqueeze(1).expand_as(pair)[pair]
    per_group_sum = torch.zeros(len(groups), dtype=S.dtype).index_add(0, pair_group, nll[pair])
    per_group_n = torch.zeros(len(groups), dtype=S.dtype).index_add(0, pair_group, torch.ones_like(nll[pair]))
    has = per_group_n > 0
    return (per_group_sum[has] / per_group_n[has]).mean(), n_pairs


def prm_update(prm, optimizer, prompts, responses, old_sums: np.ndarray, turn_episode: np.ndarray,
               episode_group: np.ndarray, episode_success: np.ndarray, cfg, pad_id: int,
               progress: Log = None) -> dict[str, float]:
    """`cfg.steps` AdamW steps on the pairwise loss; returns the loss before the first and after the last step.

    Each step scores every turn without a graph, differentiates the loss with respect to the episode scores, then
    backpropagates `Σ_t ∂L/∂S(τ_t) · ∂S/∂r_φ(t) · β · Σ log π_φ` pass by pass (`Stepper.backward_through`): the
    exact gradient, in the memory of one pass.
    """
    import torch  # start-up cost: torch

    from pipeline.model.packing import passes, response_logprobs  # start-up cost: torch
    from pipeline.model.precision import Stepper  # start-up cost: torch

    n_eps = len(episode_group)
    te = torch.as_tensor(np.array(turn_episode), dtype=torch.long)
    group = torch.as_tensor(np.array(episode_group))
    success = torch.as_tensor(np.array(episode_success))
    counts = np.bincount(turn_episode, minlength=n_eps).astype(np.float64)
    stepper = Stepper(prm, optimizer, cfg.grad_clip)
    losses = []
    n_pairs = 0
    ticker = Ticker(cfg.steps, every=1)
    parts = passes(prompts, responses, list(range(len(prompts))), cfg.batch_size, cfg.packing, cfg.micro_batch_tokens)

    def turn_sums(part):
        """`Σ log π_φ` over each response of one pass, with its graph."""
        logp, _, resp = response_logprobs(prm, [prompts[i] for i in part], [responses[i] for i in part], pad_id,
                                          cfg.packing)
        return (logp * resp.to(logp.device)).sum(1)
    for s in range(cfg.steps + 1):
        sums = turn_logprob_sums(prm, prompts, responses, pad_id, cfg)
        r = torch.tensor(cfg.beta * (sums - old_sums), dtype=torch.float64)
        S = episode_scores(r, te, n_eps, cfg.score).requires_grad_(True)
        loss, n_pairs = pairwise_loss(S, group, success)
        losses.append(float(loss.detach()))
        stepper.check(loss.detach(), f"OPRL PRM step {s}")
        if s == cfg.steps or n_pairs == 0:
            break
        (dS,) = torch.autograd.grad(loss, S)
        per_turn = dS.numpy()[turn_episode] * cfg.beta
        if cfg.score == "mean":
            per_turn = per_turn / counts[turn_episode]
        optimizer.zero_grad(set_to_none=True)
        prm.train()
        stepper.backward_through(parts, turn_sums, torch.as_tensor(per_turn))
        stepper.step(f"OPRL PRM step {s}")
        prm.eval()
        if progress is not None and ticker.due(s + 1):
            progress(f"PRM step {s + 1}/{cfg.steps}: loss {losses[-1]:.4f} over {n_pairs} pairs, {ticker.pace(s + 1)}")
    return {"prm_loss_before": losses[0], "prm_loss_after": losses[-1], "pairs": float(n_pairs)}


@dataclass
class PrmState:
    prm: object          # the implicit PRM, a causal LM (fp32 master weights), or LoRA adapters on the initial policy
    tokenizer: object
    optimizer: object
    base: Path | None    # the initial policy a LoRA PRM adapts (None: a whole model)


@dataclass
class PrmBatch:
    prompts: list
    responses: list
    old_sums: np.ndarray          # Σ log π_old per turn, recomputed from the rollout checkpoint
    init_sums: np.ndarray | None  # Σ log π_init per turn (drift report)
    engine_sums: np.ndarray       # Σ of the rollout engine's own log-probs (mismatch report)
    turn_episode: np.ndarray
    episode_group: np.ndarray
    episode_success: np.ndarray


def _sums_of(path: Path, batch_prompts, batch_responses, params, cfg) -> np.ndarray:
    from pipeline.model.policy import load_policy  # start-up cost: torch

    model, tok = load_policy(path, params.policy.dtype, params.runtime.device, train=True)
    out = turn_logprob_sums(model, batch_prompts, batch_responses, tok.pad_token_id, cfg)
    del model
    return out


class ImplicitPRM(StepRewardModel):
    def init(self, policy_dir: Path, params) -> PrmState:
        from pipeline.model.policy import load_policy, with_lora  # start-up cost: torch

        cfg = params.credit.oprl
        prm, tok = load_policy(policy_dir, params.policy.dtype, params.runtime.device, train=True)
        if cfg.lora is not None:   # B = 0: the PRM still computes exactly the initial policy
            prm = with_lora(prm, cfg.lora, seed=stage_seed("reward_init", params.seed))
        return self._state(prm, tok, Path(policy_dir) if cfg.lora is not None else None, cfg)

    def load(self, model_dir: Path, tables, params) -> PrmState:
        from pipeline.model.policy import adapter_base, load_policy  # start-up cost: torch

        cfg = params.credit.oprl
        base = adapter_base(model_dir) if check_lora(model_dir, cfg.lora, "credit.oprl.lora") else None
        prm, tok = load_policy(model_dir, params.policy.dtype, params.runtime.device, train=True)
        return self._state(prm, tok, base, cfg)

    @staticmethod
    def _state(prm, tok, base, cfg) -> PrmState:
        from pipeline.model import adamw  # start-up cost: torch

        return PrmState(prm, tok, adamw.build(prm.parameters(), cfg.lr), base)

    def save(self, state: PrmState, model_dir: Path) -> dict[str, pl.DataFrame]:
        from pipeline.model.policy import save_policy  # start-up cost: torch

        save_policy(state.prm, state.tokenizer, model_dir, base=state.base)
        return {}

    def prepare(self, state: PrmState, steps, rollout_policy, initial_policy, iteration, params) -> PrmBatch:
        cfg = params.credit.oprl
        prompts, responses = steps["prompt_ids"].to_list(), steps["response_ids"].to_list()
        episodes = steps.group_by("episode_id", maintain_order=True).agg(
            pl.col("task_group").first(), pl.col("success").first())
        turn_episode, _ = episode_index(steps["episode_id"])
        return PrmBatch(
            prompts, responses,
            old_sums=_sums_of(rollout_policy, prompts, responses, params, cfg),
            init_sums=_sums_of(initial_policy, prompts, responses, params, cfg) if cfg.report_drift else None,
            engine_sums=np.array([float(np.sum(x)) for x in steps["response_logprobs"].to_list()]),
            turn_episode=turn_episode,
            episode_group=episodes["task_group"].to_numpy(), episode_success=episodes["success"].to_numpy())

    def fit(self, state: PrmState, b: PrmBatch, iteration, params, log: Log = None) -> dict[str, float]:
        return prm_update(state.prm, state.optimizer, b.prompts, b.responses, b.old_sums, b.turn_episode,
                          b.episode_group, b.episode_success, params.credit.oprl, state.tokenizer.pad_token_id, log)

    def score(self, state: PrmState, b: PrmBatch, params) -> np.ndarray:
        cfg = params.credit.oprl
        sums = turn_logprob_sums(state.prm, b.prompts, b.responses, state.tokenizer.pad_token_id, cfg)
        return cfg.beta * (sums - b.old_sums)

    def score_first(self, params) -> bool:
        return params.credit.oprl.score_with == "before"

    def diagnostics(self, state: PrmState, b: PrmBatch, scores, params) -> dict[str, float]:
        out = {"logprob_mismatch_abs_mean": float(np.abs(b.engine_sums - b.old_sums).mean()) if len(scores)
               else 0.0}
        if b.init_sums is not None and len(scores):
            beta = params.credit.oprl.beta
            prm_sums = scores / beta + b.old_sums        # Σ log π_φ of the PRM that scored the turns
            drift = b.init_sums - b.old_sums
            out["prm_drift"] = float(np.abs(prm_sums - b.init_sums).mean())
            out["policy_drift"] = float(np.abs(drift).mean())
            if scores.std() > 0 and drift.std() > 0:
                out["drift_corr"] = float(np.corrcoef(scores, drift)[0, 1])
        return out


METHOD = register(Method("oprl", "A^E + α · norm(r_φ(t); all turns of g), r_φ = β Σ (log π_φ − log π_old)",
                         OprlConfig, terms, columns=("score",), step_weight="alpha", reward_model=ImplicitPRM(),
                         order=4, step_value=learned_return))
