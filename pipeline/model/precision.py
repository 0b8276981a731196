"""Mixed-precision training: fp32 master weights, compute in the policy's dtype (`policy.dtype`).

A model that is trained (the policy in the warm start and the update, OPRL's PRM, SPA's estimator) is loaded with
fp32 weights and marked with the dtype its forward passes run in; `autocast(model)` then casts the matrix
multiplications to bf16 or fp16. The optimiser updates the fp32 weights, so an update far below bf16's resolution
(lr 1e-6 on weights of size 1e-2) still accumulates instead of rounding away, and checkpoints keep the fp32
weights: rollout and evaluate load them cast to `policy.dtype`. fp16 also scales the loss (`GradScaler`) so that
small gradients do not flush to zero; a step whose scaled gradients overflow is skipped, as torch.amp does.

`policy.dtype: auto` is bf16 where the device computes it natively (`native_bf16`: a CUDA GPU of compute
capability 8.0 or later; a CPU with the `avx512_bf16` or `amx_bf16` instructions), fp32 elsewhere. The run decides
once: the init stage resolves it on its machine and records the outcome beside iteration 0's checkpoint
(`RECORD`); every later stage of the run computes in the recorded dtype (`pipeline.model.policy.resolve_params`),
whichever machine it runs on,
so that one run never mixes precisions (docs/models.md, Precision).
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTR = "creditrl_compute_dtype"
RECORD = "precision.json"           # in iteration 0's checkpoint folder: the dtype the run computes in, and why
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")     # /proc/cpuinfo flags of CPUs with bf16 arithmetic


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags as Linux lists them (the first processor's `flags` line); empty where unreadable."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cpu_bf16_flags(flags: set[str] | None = None) -> list[str]:
    """Which of `CPU_BF16_FLAGS` the CPU has (`flags`: its flags, read from /proc/cpuinfo when None)."""
    flags = cpu_flags() if flags is None else flags
    return [f for f in CPU_BF16_FLAGS if f in flags]


def native_bf16(device: torch.device, flags: set[str] | None = None) -> tuple[bool, str]:
    """Whether `device` computes bf16 natively, and the evidence in words. A CPU does where it has one of
    `CPU_BF16_FLAGS` (`flags`: the CPU's, read from /proc/cpuinfo when None); a CUDA GPU from compute capability 8.0
    (Ampere) on; anything else is taken not to."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        return major >= 8, f"{name}, compute capability {major}.{minor}"
    if device.type == "cpu":
        have = cpu_bf16_flags(flags)
        return bool(have), ("CPU flags " + ", ".join(have) if have
                            else "CPU without " + " or ".join(CPU_BF16_FLAGS))
    return False, f"{device.type} device"


def resolve(name: str, device: torch.device, flags: set[str] | None = None) -> tuple[str, str]:
    """`policy.dtype` `name` on `device` as a dtype name, and why: `auto` by `native_bf16`, any other as it is."""
    if name != "auto":
        return name, f"policy.dtype {name}"
    native, why = native_bf16(device, flags)
    return ("bfloat16" if native else "float32"), f"policy.dtype auto: {why}"


def write_record(folder: Path, requested: str, dtype: str, why: str) -> None:
    """Record in `folder` (iteration 0's checkpoint, being written) the dtype the run computes in."""
    (Path(folder) / RECORD).write_text(json.dumps({"requested": requested, "dtype": dtype, "why": why}) + "\n")


def read_record(folder: Path) -> dict | None:
    """The record `write_record` left in `folder`; None where there is none (a checkpoint made without one)."""
    path = Path(folder) / RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from None
    if record.get("dtype") not in DTYPES:
        raise ValueError(f"{path}: dtype {record.get('dtype')!r} is none of {', '.join(DTYPES)}")
    return record


def mark(model, dtype: str):
    """Keep `model`'s weights in fp32 and have its forward passes run in `dtype` (a `policy.dtype` name)."""
    model.float()
    setattr(model, ATTR, DTYPES[dtype])
    return model


def frozen_in_compute_dtype(model) -> int:
    """Store the frozen linear weights of `model` (the base under LoRA adapters) in its compute dtype where that is
    bf16 or fp16; returns how many. Autocast casts a weight that does not train anew on every forward (it caches
    only those that require gradients); these are the same values cast once, so every product is unchanged while
    the casts and half of the frozen weights' memory go. The input embedding (and an LM head tied to it) keeps
    fp32: it is no autocast product, and the residual stream it starts stays fp32."""
    dtype = compute_dtype(model)
    if dtype not in (torch.bfloat16, torch.float16):
        return 0
    tied = model.get_input_embeddings().weight
    n = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and not w.requires_grad and w is not tied and w.dtype != dtype:
            module.weight.data = w.data.to(dtype)
            n += 1
    return n


def stochastic_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`x` rounded to bf16 stochastically: to the neighbour above its magnitude with probability equal to how far
    along the spacing it lies, else to the one below, so that the rounded value equals `x` in expectation. A value
    bf16 holds exactly comes back unchanged. (fp32 keeps bf16's sign and exponent bits and 16 more mantissa bits:
    adding a uniform 16-bit integer to the fp32 pattern carries into bf16's last bit with that probability, and
    the 16 low bits are then dropped.)"""
    bits = x.detach().to(torch.float32).contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=generator, dtype=torch.int32, device="cpu")
    return ((bits + noise.to(bits.device)) & -65536).view(torch.float32).to(torch.bfloat16)


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
