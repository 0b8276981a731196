"""Step-level DPO with margins (docs/credit-assignment.md, Step-level preference updates): LearNAT's margin-aware
DPO on pairs of turns taken in the same state.

Loss per pair (chosen turn w, rejected turn l, margin m), with log-probs summed over each response's tokens:

    −log σ(β · [(log π_θ(y_w|s) − log π_ref(y_w|s)) − (log π_θ(y_l|s) − log π_ref(y_l|s))] − m)
    + sft_weight · (−log π_θ(y_w|s))

averaged over a minibatch's pairs; one AdamW step a minibatch of `minibatch_pairs` pairs (shuffled each epoch),
in micro-batches of the update's `micro_batch_size` turns (two a pair), or with `update.packing: tree` and
`micro_batch_tokens`, of whole pairs whose prefix tree holds at most that many tokens. The log-probs are the model's
own distribution (temperature 1). The chosen and rejected turns of a pair share their prompt, so tree packing runs
it once.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pipeline.data.batches import minibatch_count, minibatches
from pipeline.model.packing import grouped_micro_batches, response_logprobs
from pipeline.model.ppo import UpdateResult
from pipeline.model.precision import NonFiniteError, Stepper
from pipeline.progress import Ticker

STATS = ("loss", "dpo_loss", "sft_loss", "accuracy", "chosen_reward", "rejected_reward", "reward_margin")


def pair_loss(logp_w: torch.Tensor, logp_l: torch.Tensor, ref_w: torch.Tensor, ref_l: torch.Tensor,
              margin: torch.Tensor, beta: float, sft_weight: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of each pair (1-D tensors of summed log-probs, one entry a pair) before the mean, and statistics:
    the implicit rewards β·(log π − log π_ref) of chosen and rejected turns and the share of pairs ranked right."""
    chosen, rejected = beta * (logp_w - ref_w), beta * (logp_l - ref_l)
    dpo = -F.logsigmoid(chosen - rejected - margin)
    sft = -logp_w
    loss = dpo + sft_weight * sft
    with torch.no_grad():
        stats = {"dpo_loss": float(dpo.sum()), "sft_loss": float(sft.sum()),
                 "accuracy": float((chosen > rejected).float().sum()), "chosen_reward": float(chosen.sum()),
                 "rejected_reward": float(rejected.sum()), "reward_margin": float((chosen - rejected).sum())}
    return loss, stats


def summed_logprobs(model, prompts, responses, pad_id: int, packing: str) -> torch.Tensor:
    """Each turn's response log-prob, summed over its tokens, with the graph (for the loss)."""
    logp, _, resp = response_logprobs(model, prompts, responses, pad_id, packing)
    return (logp * resp.to(logp.device).float()).sum(-1)


def step_dpo_update(model, optimizer, prompts: list, responses: list, pairs: list[tuple[int, int, float]],
                    ref_sums: list[float], cfg, update, pad_id: int, seed: int,
                    progress: Callable[[str], None] | None = None) -> UpdateResult:
    """`update.epochs` passes over `pairs` ((chosen turn, rejected turn, margin), indices into `prompts` and
    `responses`) with the `update.step_dpo` settings `cfg`; `ref_sums[i]`: turn i's summed log-prob under π_ref.
    Returns each statistic's mean over the pairs (the loss's over the steps) and every step's loss."""
    n = len(pairs)
    gen = torch.Generator().manual_seed(seed)
    totals = dict.fromkeys(STATS, 0.0)
    losses, grad_norms, seen = [], [], 0
    steps_total = update.epochs * minibatch_count(n, cfg.minibatch_pairs)
    ticker = Ticker(steps_total, every=10)
    stepper = Stepper(model, optimizer, update.grad_clip)
    per_pass = max(1, (update.micro_batch_size or 2 * cfg.minibatch_pairs) // 2)
    model.train()
    for epoch in range(update.epochs):
        order = torch.randperm(n, generator=gen).tolist()
        for mb, idx in enumerate(minibatches(order, cfg.minibatch_pairs)):
            optimizer.zero_grad(set_to_none=True)
            step_loss = 0.0
            for chunk in _passes(prompts, responses, pairs, idx, per_pass, update):
                part = [pairs[k] for k in chunk]
                turns = [w for w, _, _ in part] + [lo for _, lo, _ in part]
                sums = summed_logprobs(model, [prompts[i] for i in turns], [responses[i] for i in turns], pad_id,
                                       update.packing)
                k = len(part)
                device = sums.device
                ref = torch.tensor([ref_sums[i] for i in turns], dtype=sums.dtype, device=device)
                margin = torch.tensor([m for _, _, m in part], dtype=sums.dtype, device=device)
                loss, stats = pair_loss(sums[:k], sums[k:], ref[:k], ref[k:], margin, cfg.beta, cfg.sft_weight)
                loss = loss.sum() / len(idx)
                if not torch.isfinite(loss):
                    raise NonFiniteError(f"step-DPO loss is {float(loss)} at epoch {epoch}, minibatch {mb}")
                stepper.backward(loss)
                step_loss += loss.item()
                for key, v in stats.items():
                    totals[key] += v
                seen += k
            norm = stepper.step(f"epoch {epoch}, minibatch {mb}")
            if math.isfinite(norm):
                grad_norms.append(norm)
            losses.append(step_loss)
            step = len(losses)
            if progress is not None and ticker.due(step):
                progress(f"step-DPO step {step}/{steps_total}: loss {step_loss:.4f}, {ticker.pace(step)}")
    model.eval()
    out = {k: totals[k] / max(seen, 1) for k in STATS if k != "loss"}
    out |= {"loss": sum(losses) / max(len(losses), 1), "grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
            "pairs": float(n), "skipped_steps": float(stepper.skipped)}
    return UpdateResult(out, losses)


def _passes(prompts, responses, pairs, idx: list[int], per_pass: int, update) -> list[list[int]]:
    """A minibatch's pairs `idx` in the passes that go through the model one at a time: prefix trees of at most
    `update.micro_batch_tokens` tokens (packing tree), else `per_pass` pairs each. The loss is a mean over the
    minibatch, whatever the passes."""
    if update.packing == "tree" and update.micro_batch_tokens is not None:
        items = {k: tuple(list(prompts[i]) + list(responses[i]) for i in pairs[k][:2]) for k in idx}
        return grouped_micro_batches(items, idx, update.micro_batch_tokens)
    return [idx[b: b + per_pass] for b in range(0, len(idx), per_pass)]
