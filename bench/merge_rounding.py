"""How much of a LoRA update survives when the adapter is merged into bf16 weights, which is what vLLM samples and
evaluates from under `rollout.vllm.lora: merged` when the policy computes in bf16 (docs/results/speed.md, bf16
against fp32: learning over 3 seeds).

Per adapted linear weight W (the base checkpoint's, cast to bf16 as the merged copy stores it) and the adapter's
update dW = (alpha / r) B A in fp32:

    kept   = <bf16(W + dW) - W, dW> / |dW|^2     the share of the update the merged weights carry (1: all of it)
    error  = |bf16(W + dW) - W - dW| / |dW|      what rounding did to the update, relative to it
    lost   = the share of dW's entries smaller than half a bf16 spacing at their weight (rounded away)

summed over every adapted weight of the checkpoint; the first two also for the merge rounded stochastically
(`policy.merge_rounding: stochastic`, one draw).

    python -m bench.merge_rounding RUN/iter_6/checkpoint [RUN/iter_1/checkpoint ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pipeline.model.policy import adapter_base, is_adapter
from pipeline.model.precision import stochastic_bf16


def rounding(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scale: float,
             generator: torch.Generator | None = None) -> dict[str, float]:
    """The three figures above for `adapter`'s lora_A / lora_B pairs against the `base` state dict; with a
    `generator`, for the merge rounded stochastically (`policy.merge_rounding: stochastic`) instead of to nearest."""
    num = den = err = 0.0
    lost = total = 0
    for key, a in adapter.items():
        if "lora_A" not in key:
            continue
        b = adapter[key.replace("lora_A", "lora_B")].float()
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        if name not in base:
            raise KeyError(f"adapter weight {key}: the base has no {name}")
        w = base[name].to(torch.bfloat16).float()
        dw = scale * (b @ a.float())
        got = (w + dw).to(torch.bfloat16) if generator is None else stochastic_bf16(w + dw, generator)
        got = got.float() - w
        num += float((got * dw).sum())
        den += float((dw * dw).sum())
        err += float(((got - dw) ** 2).sum())
        _, e = torch.frexp(w)                  # |w| in [2^(e-1), 2^e): bf16's spacing there is 2^(e-8)
        half = torch.ldexp(torch.ones_like(w), e - 9)
        lost += int(((dw.abs() < half) & (w != 0)).sum())     # at 0 bf16 holds a small update as it is
        total += dw.numel()
    if den == 0.0:
        raise ValueError("the adapter's update is zero (B = 0): nothing to round")
    return {"kept": num / den, "error": (err / den) ** 0.5, "lost": lost / total}


def load(checkpoint: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
    from safetensors.torch import load_file  # start-up cost: safetensors

    if not is_adapter(checkpoint):
        raise SystemExit(f"{checkpoint}: not a LoRA adapter folder (adapter_config.json missing)")
    cfg = json.loads((checkpoint / "adapter_config.json").read_text())
    base_files = sorted(adapter_base(checkpoint).glob("*.safetensors"))
    if not base_files:
        raise SystemExit(f"{adapter_base(checkpoint)}: no safetensors weights in the adapter's base")
    base = {k: v for f in base_files for k, v in load_file(str(f)).items()}
    return base, load_file(str(checkpoint / "adapter_model.safetensors")), cfg["lora_alpha"] / cfg["r"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", type=Path, help="LoRA checkpoint folders (a run's iter_<i>/checkpoint)")
    for c in ap.parse_args(argv).checkpoints:
        base, adapter, scale = load(c)
        r = rounding(base, adapter, scale)
        st = rounding(base, adapter, scale, torch.Generator().manual_seed(0))
        print(f"{c}: bf16 merge keeps {r['kept']:.3f} of the update, rounding error {r['error']:.3f} of it, "
              f"{r['lost']:.1%} of its entries below half a bf16 spacing; rounded stochastically it keeps "
              f"{st['kept']:.3f}, rounding error {st['error']:.3f}")


if __name__ == "__main__":
    main()
