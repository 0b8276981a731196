"""Learned step-reward models: OPRL's implicit PRM and SPA's progress estimator (credit-assignment.md).

Both read turns as (prompt ids, response ids) pairs, exactly as the policy saw and wrote them, and both are
trained with losses defined on *episodes* (a pair of episode scores for OPRL, an episode's summed contributions
for SPA). For OPRL the loss is taken as a function of the episode scores and its gradient is pushed back through
the turns chunk by chunk (the episode score is a sum over turns), so memory does not grow with the number of turns
in an iteration.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.policy import DTYPES, pad_batch, token_logprobs
from pipeline.ppo import NonFiniteError, sequence_logprobs

HEAD_FILE = "progress_head.pt"
OPTIMIZER_FILE = "optimizer.pt"


# ----------------------------------------------------------------------------------------------------------------
# OPRL (credit-assignment.md, OPRL)

def turn_logprob_sums(model, prompts, responses, pad_id: int, batch_size: int) -> np.ndarray:
    """`Σ_{tokens of the response} log π(y|·)` per turn (float64), computed in fixed batches.

    The same function scores the PRM and the rollout policy, so that identical weights give identical sums and
    the implicit rewards are then exactly zero.
    """
    per_token = sequence_logprobs(model, prompts, responses, pad_id, batch_size)
    return np.array([float(x.double().sum()) for x in per_token], dtype=np.float64)


def episode_scores(turn_values: torch.Tensor, turn_episode: torch.Tensor, n_episodes: int, how: str) -> torch.Tensor:
    """`S(τ) = Σ_t r_φ(t)` (`sum`, paper) or the mean over the episode's turns (`mean`, released code)."""
    S = torch.zeros(n_episodes, dtype=turn_values.dtype).index_add(0, turn_episode, turn_values)
    if how == "sum":
        return S
    if how == "mean":
        counts = torch.zeros(n_episodes, dtype=turn_values.dtype).index_add(
            0, turn_episode, torch.ones_like(turn_values))
        return S / counts.clamp(min=1)
    raise ValueError(f"unknown OPRL score {how!r}; expected sum or mean")


def pairwise_loss(S: torch.Tensor, episode_group: torch.Tensor, episode_success: torch.Tensor) -> tuple[torch.Tensor, int]:
    """OPRL's PRM loss (credit-assignment.md, OPRL): per task group, `−mean log σ(S(τ+) − S(τ−))` over all pairs
    of a success τ+ and a failure τ−; groups without such a pair contribute nothing. The iteration's loss is the
    mean over the groups that have pairs. Returns (loss, number of pairs); the loss is 0 without pairs.
    """
    same = episode_group.unsqueeze(1) == episode_group.unsqueeze(0)
    pos = episode_success.bool()
    pair = same & pos.unsqueeze(1) & ~pos.unsqueeze(0)          # [i, j]: i succeeded, j failed, same group
    n_pairs = int(pair.sum())
    if n_pairs == 0:
        return S.sum() * 0.0, 0
    diff = S.unsqueeze(1) - S.unsqueeze(0)
    nll = -F.logsigmoid(diff)
    groups, inverse = torch.unique(episode_group, return_inverse=True)
    pair_group = inverse.unsqueeze(1).expand_as(pair)[pair]
    per_group_sum = torch.zeros(len(groups), dtype=S.dtype).index_add(0, pair_group, nll[pair])
    per_group_n = torch.zeros(len(groups), dtype=S.dtype).index_add(0, pair_group, torch.ones_like(nll[pair]))
    has = per_group_n > 0
    return (per_group_sum[has] / per_group_n[has]).mean(), n_pairs


def prm_update(prm, optimizer, prompts, responses, old_sums: np.ndarray, turn_episode: np.ndarray,
               episode_group: np.ndarray, episode_success: np.ndarray, cfg, pad_id: int,
               progress: Callable[[str], None] | None = None) -> dict[str, float]:
    """`cfg.steps` AdamW steps on the pairwise loss; returns the loss before the first and after the last step.

    Each step scores every turn without a graph, differentiates the loss with respect to the episode scores, then
    backpropagates `Σ_t ∂L/∂S(τ_t) · ∂S/∂r_φ(t) · β · Σ log π_φ` chunk by chunk: the exact gradient, in the memory
    of one chunk.
    """
    n_eps = len(episode_group)
    te = torch.as_tensor(np.array(turn_episode), dtype=torch.long)
    group = torch.as_tensor(np.array(episode_group))
    success = torch.as_tensor(np.array(episode_success))
    counts = np.bincount(turn_episode, minlength=n_eps).astype(np.float64)
    losses = []
    n_pairs = 0
    started = time.perf_counter()
    for s in range(cfg.steps + 1):
        sums = turn_logprob_sums(prm, prompts, responses, pad_id, cfg.batch_size)
        r = torch.tensor(cfg.beta * (sums - old_sums), dtype=torch.float64)
        S = episode_scores(r, te, n_eps, cfg.score).requires_grad_(True)
        loss, n_pairs = pairwise_loss(S, group, success)
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            raise NonFiniteError(f"OPRL PRM loss is {losses[-1]} at step {s}")
        if s == cfg.steps or n_pairs == 0:
            break
        (dS,) = torch.autograd.grad(loss, S)
        per_turn = dS.numpy()[turn_episode] * cfg.beta
        if cfg.score == "mean":
            per_turn = per_turn / counts[turn_episode]
        optimizer.zero_grad(set_to_none=True)
        prm.train()
        for b in range(0, len(prompts), cfg.batch_size):
            ids, _, resp = pad_batch(prompts[b: b + cfg.batch_size], responses[b: b + cfg.batch_size], pad_id)
            logp, _ = token_logprobs(prm, ids, resp)
            seq = (logp * resp.to(logp.device)).sum(1)
            w = torch.as_tensor(per_turn[b: b + cfg.batch_size], dtype=seq.dtype, device=seq.device)
            (seq * w).sum().backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(prm.parameters(), cfg.grad_clip)
        if not torch.isfinite(grad_norm):
            raise NonFiniteError(f"OPRL PRM gradient norm is {float(grad_norm)} at step {s}")
        optimizer.step()
        prm.eval()
        if progress is not None:
            progress(f"PRM step {s + 1}/{cfg.steps}: loss {losses[-1]:.4f} over {n_pairs} pairs, "
                     f"{(s + 1) / (time.perf_counter() - started):.2f} steps/s")
    return {"prm_loss_before": losses[0], "prm_loss_after": losses[-1], "pairs": float(n_pairs)}


# ----------------------------------------------------------------------------------------------------------------
# SPA (credit-assignment.md, SPA)

class ProgressEstimator(torch.nn.Module):
    """The policy's architecture (its base model, without the LM head) plus a scalar head on the final hidden
    state at each turn's last token (**Decision**: on the hidden state, not on the vocabulary logits). The head
    starts at zero, so a new estimator gives every turn c_t = 0."""

    def __init__(self, body, hidden_size: int):
        super().__init__()
        self.body = body
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy(cls, path: str | Path, dtype: str = "float32",
                    device: str | torch.device | None = None) -> ProgressEstimator:
        from transformers import AutoModel

        from pipeline.policy import resolve_device

        body = AutoModel.from_pretrained(Path(path), local_files_only=True, dtype=DTYPES[dtype])
        return cls(body, body.config.hidden_size).to(
            device=None if device is None else resolve_device(device),
            dtype=torch.float32 if dtype == "float32" else DTYPES[dtype])

    @classmethod
    def load(cls, path: str | Path, dtype: str = "float32", device: str | torch.device | None = None
             ) -> ProgressEstimator:
        path = Path(path)
        if not (path / HEAD_FILE).is_file():
            raise FileNotFoundError(f"{path}: not a progress estimator ({HEAD_FILE} missing)")
        est = cls.from_policy(path, dtype, device)
        est.head.load_state_dict(torch.load(path / HEAD_FILE, weights_only=True, map_location="cpu"))
        return est

    def save(self, path: str | Path) -> None:
        path = Path(path)
        self.body.save_pretrained(path)
        torch.save(self.head.state_dict(), path / HEAD_FILE)

    def forward(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        device = next(self.parameters()).device
        ids, attn = ids.to(device), attn.to(device)
        hidden = self.body(input_ids=ids, attention_mask=attn).last_hidden_state
        last = attn.sum(1) - 1
        h = hidden[torch.arange(ids.shape[0], device=device), last]
        return self.head(h.to(self.head.weight.dtype)).squeeze(-1).float()

    def contributions(self, prompts, responses, pad_id: int, batch_size: int, grad: bool = False) -> torch.Tensor:
        """c_t for each turn (prompt + response, right-padded in chunks)."""
        out = []
        with torch.set_grad_enabled(grad):
            for b in range(0, len(prompts), batch_size):
                ids, attn, _ = pad_batch(prompts[b: b + batch_size], responses[b: b + batch_size], pad_id)
                out.append(self(ids, attn))
        return torch.cat(out) if out else torch.zeros(0)


def spa_loss(c: torch.Tensor, turn_episode: torch.Tensor, outcome: torch.Tensor) -> torch.Tensor:
    """SPA's loss (credit-assignment.md, SPA): mean over episodes of `(Σ_t c_t − R_final(τ))²`."""
    total = torch.zeros(len(outcome), dtype=c.dtype, device=c.device).index_add(0, turn_episode.to(c.device), c)
    return ((total - outcome.to(device=c.device, dtype=c.dtype)) ** 2).mean()


def train_progress(est: ProgressEstimator, optimizer, prompts, responses, turn_episode: np.ndarray,
                   outcome: np.ndarray, cfg, pad_id: int, seed: int,
                   progress: Callable[[str], None] | None = None) -> dict[str, float]:
    """`cfg.epochs` passes over the replay in shuffled batches of `cfg.episodes_per_batch` whole episodes."""
    n_eps = len(outcome)
    turns_of = [[] for _ in range(n_eps)]
    for t, e in enumerate(turn_episode):
        turns_of[e].append(t)
    gen = torch.Generator().manual_seed(seed)
    epoch_losses = []
    started = time.perf_counter()
    steps_total = cfg.epochs * math.ceil(n_eps / cfg.episodes_per_batch)
    step = 0
    for epoch in range(cfg.epochs):
        order = torch.randperm(n_eps, generator=gen).tolist()
        batch_losses, weights = [], []
        est.train()
        for b in range(0, n_eps, cfg.episodes_per_batch):
            eps = order[b: b + cfg.episodes_per_batch]
            rows = [t for e in eps for t in turns_of[e]]
            local = torch.tensor([i for i, e in enumerate(eps) for _ in turns_of[e]], dtype=torch.long)
            c = est.contributions([prompts[t] for t in rows], [responses[t] for t in rows], pad_id,
                                  cfg.batch_size, grad=True)
            loss = spa_loss(c, local, torch.as_tensor(outcome[eps]))
            if not torch.isfinite(loss):
                raise NonFiniteError(f"SPA estimator loss is {float(loss)} at epoch {epoch}")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(est.parameters(), cfg.grad_clip)
            optimizer.step()
            batch_losses.append(float(loss.detach()))
            weights.append(len(eps))
            step += 1
            if progress is not None and (step % 10 == 0 or step == steps_total):
                progress(f"estimator step {step}/{steps_total}: loss {batch_losses[-1]:.4f}, "
                         f"{step / (time.perf_counter() - started):.2f} steps/s")
        epoch_losses.append(float(np.average(batch_losses, weights=weights)) if batch_losses else float("nan"))
    est.eval()
    return {f"estimator_loss_epoch_{i}": v for i, v in enumerate(epoch_losses)}
