"""Mixed-precision training: fp32 master weights, compute in the policy's dtype (`policy.dtype`).

A model that is trained (the policy in the warm start and the update, OPRL's PRM, SPA's estimator) is loaded with
fp32 weights and marked with the dtype its forward passes run in; `autocast(model)` then casts the matrix
multiplications to bf16 or fp16. The optimiser updates the fp32 weights, so an update far below bf16's resolution
(lr 1e-6 on weights of size 1e-2) still accumulates instead of rounding away, and checkpoints keep the fp32
weights: rollout and evaluate load them cast to `policy.dtype`. fp16 also scales the loss (`GradScaler`) so that
small gradients do not flush to zero; a step whose scaled gradients overflow is skipped, as torch.amp does.
"""

from __future__ import annotations

import contextlib
import math

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTR = "creditrl_compute_dtype"


def mark(model, dtype: str):
    """Keep `model`'s weights in fp32 and have its forward passes run in `dtype` (a `policy.dtype` name)."""
    model.float()
    setattr(model, ATTR, DTYPES[dtype])
    return model


def compute_dtype(model) -> torch.dtype | None:
    return getattr(model, ATTR, None)


def autocast(model):
    """A context running `model`'s forward in its marked compute dtype (nothing for fp32 or unmarked models)."""
    dtype = compute_dtype(model)
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    device = next(model.parameters()).device
    return torch.autocast(device.type, dtype=dtype)


class Stepper:
    """Backward and optimiser step with fp16 loss scaling where the model computes in fp16."""

    def __init__(self, model, optimizer, grad_clip: float):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer
        self.grad_clip = grad_clip
        device = self.params[0].device if self.params else torch.device("cpu")
        self.scaler = torch.amp.GradScaler(device.type, enabled=compute_dtype(model) == torch.float16)
        self.skipped = 0  # fp16 steps skipped for overflowing gradients

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def backward_through(self, parts, forward, g: torch.Tensor) -> None:
        """Accumulate the gradient of a loss `L(v)` over the per-sequence values `v` of several forward passes,
        one pass's graph at a time: `g = ∂L/∂v` was taken on values computed without a graph; each pass (`parts`,
        lists of sequence indices) runs again with its graph, `forward(part)`, and back-propagates `Σ_i g_i v_i`,
        which by the chain rule accumulates the same gradient (exact where the forward is deterministic, as it is
        without dropout). SPA's, GAE's and OPRL's fits step this way, so that memory is bounded by a pass, not by
        the batch their loss couples."""
        for part in parts:
            v = forward(part)
            self.backward((v * g[torch.tensor(part, device=g.device)].to(device=v.device, dtype=v.dtype)).sum())

    def minimize(self, loss: torch.Tensor, where: str) -> float:
        """One whole optimiser step on `loss`: a non-finite loss stops training before any gradient is taken
        (`NonFiniteError` naming `where`); then zero the gradients, backward and `step`."""
        self.check(loss, where)
        self.optimizer.zero_grad(set_to_none=True)
        self.backward(loss)
        return self.step(where)

    @staticmethod
    def check(loss: torch.Tensor, where: str) -> None:
        """A non-finite loss stops training before any gradient is taken (`NonFiniteError` naming `where`)."""
        if not torch.isfinite(loss):
            raise NonFiniteError(f"loss is {float(loss)} at {where}")

    def step(self, where: str) -> float:
        """Clip and apply the accumulated gradients; returns the gradient norm. A non-finite norm stops training
        (`NonFiniteError` naming `where`), except under fp16 scaling, where the scaler skips the step and lowers
        its scale."""
        self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)   # FSDP: a DTensor
        if not math.isfinite(norm) and not self.scaler.is_enabled():
            raise NonFiniteError(f"gradient norm is {norm} at {where}")
        self.skipped += not math.isfinite(norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return norm


class NonFiniteError(FloatingPointError):
    """A loss or gradient went NaN/inf: training stops before anything is written."""
