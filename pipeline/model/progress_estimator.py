"""SPA's progress estimator (docs/credit-assignment.md, SPA): the policy's body with a scalar head read at each turn's
last token, c_t, and its training on SPA's loss (each episode's contributions summed against its outcome). The
advantage computation, the replay and the method's registration stay in `pipeline.credit.methods.spa`.

torch is imported inside the functions (start-up cost: loading params imports the credit methods, which import
this module).
"""

from __future__ import annotations

import math

import numpy as np

from pipeline.data.batches import minibatch_count, minibatches
from pipeline.data.section import FitBatching
from pipeline.model.scalar_head import ScalarHeadModel
from pipeline.progress import Ticker

HEAD_FILE = "progress_head.pt"


class ProgressEstimator(ScalarHeadModel):
    """The policy's body and a zero-initialised scalar head read at each turn's last token (prompt + response)."""
    head_file = HEAD_FILE
    kind = "progress estimator"

    def contributions(self, prompts, responses, pad_id: int, batching: FitBatching, grad: bool = False):
        """c_t for each turn (prompt + response, in passes: right-padded or prefix trees)."""
        return self.values(prompts, responses, pad_id, batching, grad)


def spa_loss(c, turn_episode, outcome):
    """SPA's loss (docs/credit-assignment.md, SPA): mean over episodes of `(Σ_t c_t − R_final(τ))²`."""
    import torch  # start-up cost: torch

    total = torch.zeros(len(outcome), dtype=c.dtype, device=c.device).index_add(0, turn_episode.to(c.device), c)
    return ((total - outcome.to(device=c.device, dtype=c.dtype)) ** 2).mean()


def train_progress(est: ProgressEstimator, optimizer, prompts, responses, turn_episode: np.ndarray,
                   outcome: np.ndarray, cfg, pad_id: int, seed: int, progress=None) -> dict[str, float]:
    """`cfg.epochs` passes over the replay in shuffled near-equal batches of at most `cfg.episodes_per_batch` whole
    episodes (`pipeline.data.batches.minibatches`, as the policy update cuts its turns); a batch's turns go through
    the estimator a pass at a time (`ScalarHeadModel.fit_step`), so memory is bounded by the pass, not the batch."""
    import torch  # start-up cost: torch

    from pipeline.model.precision import Stepper  # start-up cost: torch

    n_eps = len(outcome)
    turns_of = [[] for _ in range(n_eps)]
    for t, e in enumerate(turn_episode):
        turns_of[e].append(t)
    gen = torch.Generator().manual_seed(seed)
    stepper = Stepper(est.modules, optimizer, cfg.grad_clip)
    epoch_losses = []
    steps_total = cfg.epochs * minibatch_count(n_eps, cfg.episodes_per_batch)
    ticker = Ticker(steps_total, every=10)
    step = 0
    for epoch in range(cfg.epochs):
        order = torch.randperm(n_eps, generator=gen).tolist()
        batch_losses, weights = [], []
        est.train()
        for eps in minibatches(order, cfg.episodes_per_batch):
            rows = [t for e in eps for t in turns_of[e]]
            local = torch.tensor([i for i, e in enumerate(eps) for _ in turns_of[e]], dtype=torch.long)
            target = torch.as_tensor(outcome[eps])
            loss = est.fit_step([prompts[t] for t in rows], [responses[t] for t in rows], pad_id, cfg,
                                lambda c, local=local, target=target: spa_loss(c, local, target), stepper,
                                f"SPA estimator epoch {epoch}")
            batch_losses.append(loss)
            weights.append(len(eps))
            step += 1
            if progress is not None and ticker.due(step):
                progress(f"estimator step {step}/{steps_total}: loss {batch_losses[-1]:.4f}, "
                         f"{ticker.pace(step)}")
        epoch_losses.append(float(np.average(batch_losses, weights=weights)) if batch_losses else float("nan"))
    est.eval()
    return {f"estimator_loss_epoch_{i}": v for i, v in enumerate(epoch_losses) if math.isfinite(v)}
