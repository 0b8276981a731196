"""GAE's critic (docs/credit-assignment.md, GAE): the policy's body with a scalar head read at the last prompt token
of each turn, V(s_t), and its training on the value loss (verl's clipped one). The advantage computation and the
method's registration stay in `pipeline.credit.methods.gae`.

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


class Critic(ScalarHeadModel):
    """The policy's body and a zero-initialised scalar head read at the last prompt token of each turn."""
    head_file = "value_head.pt"
    kind = "critic"

    def state_values(self, prompts, pad_id: int, batching: FitBatching, grad: bool = False):
        """V(s_t) for each turn's prompt (the state before its response)."""
        return self.values(prompts, [[] for _ in prompts], pad_id, batching, grad)


def value_loss(v, v_old, target, clip: float | None):
    """`½ (V − target)²`, with `clip`: `½ max((V − target)², (V_old + clamp(V − V_old, ±clip) − target)²)`
    (verl's clipped value loss), averaged over the turns."""
    import torch  # start-up cost: torch

    loss = (v - target) ** 2
    if clip is not None:
        clipped = v_old + torch.clamp(v - v_old, -clip, clip)
        loss = torch.maximum(loss, (clipped - target) ** 2)
    return 0.5 * loss.mean()


def explained_variance(values: np.ndarray, returns: np.ndarray) -> float:
    """`1 − Var(returns − values) / Var(returns)`: 1 a perfect critic, 0 one no better than the mean."""
    var = float(np.var(returns))
    return 1.0 - float(np.var(returns - values)) / var if var > 0 else math.nan


def train_critic(critic: Critic, optimizer, prompts, v_old: np.ndarray, target: np.ndarray, cfg, pad_id: int,
                 seed: int, progress=None) -> dict[str, float]:
    """`cfg.epochs` shuffled passes over the turns in near-equal minibatches of at most `cfg.minibatch_size`
    (`pipeline.data.batches.minibatches`, as the policy update cuts them)."""
    import torch  # start-up cost: torch

    from pipeline.model.precision import Stepper  # start-up cost: torch

    n = len(prompts)
    gen = torch.Generator().manual_seed(seed)
    stepper = Stepper(critic.modules, optimizer, cfg.grad_clip)
    v_old_t, target_t = torch.as_tensor(v_old, dtype=torch.float32), torch.as_tensor(target, dtype=torch.float32)
    steps_total = cfg.epochs * minibatch_count(n, cfg.minibatch_size)
    ticker = Ticker(steps_total, every=10)
    step, losses = 0, []
    critic.train()
    for epoch in range(cfg.epochs):
        order = torch.randperm(n, generator=gen).tolist()
        for rows in minibatches(order, cfg.minibatch_size):
            idx = torch.tensor(rows)
            loss = critic.fit_step([prompts[i] for i in rows], [[] for _ in rows], pad_id, cfg,
                                   lambda v, idx=idx: value_loss(v, v_old_t[idx].to(v.device),
                                                                 target_t[idx].to(v.device), cfg.value_clip),
                                   stepper, f"GAE critic epoch {epoch}")
            losses.append(loss)
            step += 1
            if progress is not None and ticker.due(step):
                progress(f"critic step {step}/{steps_total}: loss {losses[-1]:.4f}, {ticker.pace(step)}")
    critic.eval()
    return {"critic_steps": float(step)}
