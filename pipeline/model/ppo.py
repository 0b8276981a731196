"""PPO-clip on response tokens (docs/credit-assignment.md, Policy update).

`log π_old` is recomputed here from the rollout checkpoint, at the sampling temperature (the distribution the sampler
drew from, as verl does); the rollout engine's log-probs only serve to report the mismatch. Loss per token:
`−min(ρA, clip(ρ, 1−ε, 1+ε)A)`, bounded by `−c·A` for A < 0 (dual clip), token-mean over the minibatch, plus
`kl_coef · low_var_kl` to a frozen reference and `− entropy_coef · H`.

One step off-policy (`loop.off_policy_lag: 1`) the loss is the decoupled one (AReaL's): `log π_old` is the proximal
policy's (the checkpoint the update starts from), and each token's loss is multiplied by its behaviour weight
`min(π_prox / π_behav, cap)`, a constant (docs/credit-assignment.md, One step off-policy).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline.data.batches import minibatch_count, minibatches
from pipeline.model.distributed import Processes, all_reduce_grads, all_reduce_sums, gather_shares, share
from pipeline.model.packing import passes, response_logprobs
from pipeline.model.precision import NonFiniteError, Stepper
from pipeline.progress import Ticker

__all__ = ["NonFiniteError", "Placement", "Turns", "UpdateResult", "low_var_kl", "minibatches", "policy_loss",
           "ppo_update", "sequence_logprobs", "shared_logprobs"]


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, clip_ratio: float,
                dual_clip: float, tokens: float | None = None,
                weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean dual-clip PPO loss; `adv` is broadcast per sequence ([B, 1]) or per token ([B, L]). `tokens`: the
    number of response tokens to average over (a micro-batch's share of its minibatch's mean; default this batch's
    own count). `weight` ([B, L], no gradient): each token's behaviour weight of the decoupled loss, with
    `old_logp` the proximal policy's; None: today's on-policy loss."""
    mask = mask.float()
    ratio = torch.exp(logp - old_logp)
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1 - clip_ratio, 1 + clip_ratio)
    clipped = torch.maximum(loss1, loss2)
    dual = torch.minimum(-adv * dual_clip, clipped)
    per_token = torch.where(adv < 0, dual, clipped)
    if weight is not None:
        per_token = per_token * weight
    n = mask.sum().clamp(min=1.0) if tokens is None else tokens
    loss = (per_token * mask).sum() / n
    with torch.no_grad():
        clipfrac = (((loss2 > loss1).float()) * mask).sum() / n
        approx_kl = ((old_logp - logp) * mask).sum() / n
    return loss, {"clipfrac": float(clipfrac), "approx_kl": float(approx_kl)}


def low_var_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(π‖π_ref) per token, clamped as verl does."""
    kl = ref_logp - logp
    return torch.clamp(torch.exp(kl) - kl - 1, -10, 10)


@torch.no_grad()
def sequence_logprobs(model, prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                      batch_size: int, temperature: float = 1.0,
                      progress: Callable[[str], None] | None = None, packing: str = "none",
                      max_tokens: int | None = None) -> list[torch.Tensor]:
    """Per-token log-probs of each response under `model` at `temperature` (one 1-D tensor per turn, in the turns'
    order), `batch_size` turns or (`packing` tree) `max_tokens` packed tokens a forward pass; a progress line where
    `Ticker` says one is due (at most 30 s apart)."""
    model.eval()
    out: list[torch.Tensor | None] = [None] * len(prompts)
    ticker = Ticker()
    done = 0
    for part in passes(prompts, responses, list(range(len(prompts))), batch_size, packing, max_tokens):
        if progress is not None and done and ticker.due(done):
            progress(f"log-probs of {done}/{len(prompts)} turns, {ticker.pace(done, 'turn')}")
        logp, _, resp = response_logprobs(model, [prompts[i] for i in part], [responses[i] for i in part], pad_id,
                                          packing, temperature=temperature)
        logp = logp.cpu()
        for row, i in enumerate(part):
            out[i] = logp[row][resp[row]]
        done += len(part)
    return out


def shared_logprobs(model, prompts, responses, pad_id: int, batch_size: int, temperature: float,
                    procs: Processes, progress: Callable[[str], None] | None = None, packing: str = "none",
                    max_tokens: int | None = None) -> list[torch.Tensor]:
    """`sequence_logprobs` of every turn, each process computing its share and gathering the others'."""
    mine = sequence_logprobs(model, share(prompts, procs.rank, procs.world), share(responses, procs.rank, procs.world),
                             pad_id, batch_size, temperature, progress, packing, max_tokens)
    return gather_shares(mine, procs.world)


STATS = ("loss", "pg_loss", "kl", "entropy", "clipfrac", "approx_kl")


@dataclass(frozen=True)
class Turns:
    """The turns an update trains on, one entry per turn in (episode_id, step) order: the token ids, the advantage,
    and the per-token log-probs the loss reads (one 1-D tensor per turn over its response tokens, at the sampling
    temperature). Shared by the update stage, which fills them phase by phase, and `ppo_update`."""
    prompts: list[list[int]]
    responses: list[list[int]]
    advantages: list[float]
    old_logps: list | None = None          # log π_old
    ref_logps: list | None = None          # the KL reference's, where `update.kl_coef` > 0
    weights: list | None = None            # behaviour weights min(π_prox / π_behav, cap), one step off-policy
    engine_logprobs: list | None = None    # the rollout engine's, as the rollout wrote them


@dataclass(frozen=True)
class Placement:
    """Where an update runs: process `rank` of `world` (torch.distributed initialised when `world` > 1), each with
    the whole model or (`sharded`) an FSDP shard of it (`pipeline.model.fsdp`)."""
    rank: int = 0
    world: int = 1
    sharded: bool = False


@dataclass(frozen=True)
class UpdateResult:
    stats: dict[str, float]       # each statistic's mean over the optimiser steps, and `skipped_steps`
    step_losses: list[float]      # every optimiser step's loss, in order


def ppo_update(model, optimizer, turns: Turns, cfg, pad_id: int, seed: int, temperature: float = 1.0,
               placement: Placement = Placement(), progress: Callable[[str], None] | None = None) -> UpdateResult:
    """`cfg.epochs` (`UpdateConfig`) passes of shuffled minibatches of `turns` (`minibatches`: near-equal sizes of
    at most `cfg.minibatch_size`), from `turns.old_logps` (and `ref_logps`, `weights` where given). The new
    log-probs are taken at `temperature`, as the turns' must be.

    With `placement.world` > 1 processes, every process draws the same minibatches, runs its own share of each
    (`share`), and the gradients and statistics are summed across processes before the same clipped optimiser step
    on each: the update is that of one process, up to float summation order. `sharded` (FSDP): the backward passes
    reduce the gradients themselves, so every process runs as many micro-batches as the busiest one (a process
    short of turns runs one more with its loss times 0: FSDP's collectives must pair up)."""
    if turns.old_logps is None:
        raise ValueError("ppo_update: the turns carry no log pi_old (Turns.old_logps)")
    n = len(turns.prompts)
    world, sharded = placement.world, placement.sharded
    gen = torch.Generator().manual_seed(seed)
    stats: dict[str, list[float]] = {k: [] for k in (*STATS, "grad_norm")}
    losses: list[float] = []
    steps_total = cfg.epochs * minibatch_count(n, cfg.minibatch_size)
    ticker = Ticker(steps_total, every=10)
    step = 0
    stepper = Stepper(model, optimizer, cfg.grad_clip)
    model.train()
    for epoch in range(cfg.epochs):
        order = torch.randperm(n, generator=gen).tolist()
        for mb, idx in enumerate(minibatches(order, cfg.minibatch_size)):
            where = f"epoch {epoch}, minibatch {mb}"
            optimizer.zero_grad(set_to_none=True)
            sums = _minibatch_backward(model, stepper, turns, pad_id, idx, cfg, temperature, placement, where)
            if world > 1:
                if not sharded:
                    all_reduce_grads(stepper.params)
                sums = all_reduce_sums(sums, stepper.params[0].device)
            sums["grad_norm"] = stepper.step(where)
            losses.append(sums["loss"])
            step += 1
            for k, v in sums.items():
                if math.isfinite(v):      # an fp16 step skipped for overflow has no norm to average
                    stats[k].append(v)
            if progress is not None and ticker.due(step):
                progress(f"update step {step}/{steps_total}: loss {sums['loss']:.4f}, "
                         f"clipfrac {sums['clipfrac']:.3f}, {ticker.pace(step)}")
    model.eval()
    out = {k: (sum(v) / len(v) if v else 0.0) for k, v in stats.items()}
    out["skipped_steps"] = float(stepper.skipped)
    return UpdateResult(out, losses)


def _minibatch_backward(model, stepper, turns: Turns, pad_id: int, idx: list[int], cfg, temperature: float,
                        placement: Placement, where: str) -> dict[str, float]:
    """Backward passes of this process's share of minibatch `idx`, in micro-batches; the sums of its statistics.
    The loss is a token mean over the whole minibatch: each micro-batch's sums are divided by its tokens."""
    tokens = float(max(sum(len(turns.responses[i]) for i in idx), 1))
    rank, world, sharded = placement.rank, placement.world, placement.sharded
    sums = dict.fromkeys(STATS, 0.0)
    parts = [_micro(turns, share(idx, r, world), cfg) for r in range(world)]
    mine = parts[rank]
    rounds = max(map(len, parts)) if sharded else len(mine)
    for m in range(rounds):
        part = mine[m] if m < len(mine) else []
        idle = not part          # a sharded process with no turns left: a pass that adds nothing
        if idle:
            part = idx[:1]
        loss, parts = _micro_batch_loss(model, turns, pad_id, part, cfg, temperature, tokens, where)
        if idle:
            stepper.backward(loss * 0.0)
            continue
        stepper.backward(loss * world if sharded else loss)   # FSDP averages what it reduces
        for k, v in parts.items():
            sums[k] += v
    return sums


def _micro(turns: Turns, mine: list[int], cfg) -> list[list[int]]:
    """A process's share of a minibatch in micro-batches: `micro_batch_size` turns each in the minibatch's order,
    or (`packing` tree with `micro_batch_tokens`) prefix trees of at most that many tokens."""
    return passes(turns.prompts, turns.responses, mine, cfg.micro_batch_size or cfg.minibatch_size, cfg.packing,
                  cfg.micro_batch_tokens)


def _micro_batch_loss(model, turns: Turns, pad_id: int, part: list[int], cfg, temperature: float, tokens: float,
                      where: str) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of the turns `part` (its sums over `tokens`, the minibatch's) and its statistics."""
    logp, entropy, resp = response_logprobs(model, [turns.prompts[i] for i in part],
                                            [turns.responses[i] for i in part], pad_id, cfg.packing,
                                            with_entropy=cfg.entropy_coef > 0, temperature=temperature)
    resp = resp.to(logp.device)
    old = torch.zeros_like(logp)
    old[resp] = torch.cat([turns.old_logps[i] for i in part]).to(logp.device)
    adv = torch.tensor([turns.advantages[i] for i in part], dtype=logp.dtype, device=logp.device).unsqueeze(1)
    weight = None
    if turns.weights is not None:
        weight = torch.ones_like(logp)
        weight[resp] = torch.cat([turns.weights[i] for i in part]).to(logp.device, logp.dtype)
    pg_loss, info = policy_loss(logp, old, adv, resp, cfg.clip_ratio, cfg.dual_clip, tokens, weight)
    loss = pg_loss
    mask = resp.float()
    out = {}
    if turns.ref_logps is not None and cfg.kl_coef > 0:
        ref = torch.zeros_like(logp)
        ref[resp] = torch.cat([turns.ref_logps[i] for i in part]).to(logp.device)
        kl = (low_var_kl(logp, ref) * mask).sum() / tokens
        loss = loss + cfg.kl_coef * kl
        out["kl"] = kl.item()
    if entropy is not None:
        ent = (entropy * mask).sum() / tokens
        loss = loss - cfg.entropy_coef * ent
        out["entropy"] = ent.item()
    if not torch.isfinite(loss):
        raise NonFiniteError(f"PPO loss is {float(loss)} at {where}")
    out |= {"loss": loss.item(), "pg_loss": pg_loss.item(), "clipfrac": info["clipfrac"],
            "approx_kl": info["approx_kl"]}
    return loss, out
