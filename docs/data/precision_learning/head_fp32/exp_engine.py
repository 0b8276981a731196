"""The sampled tokens' log-probabilities as vLLM computed them in bf16 (the rollout's `response_logprobs`), against
the same checkpoint merged in fp32 and computed in fp32 (A) and against the bf16 copy computed by transformers (B):
whether vLLM's own kernels put the sampler further from fp32 than bf16 weights and arithmetic do.

    python docs/data/precision_learning/head_fp32/exp_engine.py CHECKPOINT STEPS_PARQUET N_TURNS

STEPS_PARQUET the rollout that CHECKPOINT sampled (iteration k's checkpoint, iteration k+1's steps); the same turns
as exp_head_fp32.py draws."""
import sys

import polars as pl
import torch

from pipeline.model.policy import load_weights

torch.set_num_threads(1)
ckpt, steps, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
turns = pl.read_parquet(steps).sample(n=n, seed=0, shuffle=True)
A = load_weights(ckpt, "float32").eval()
B = load_weights(ckpt, "bfloat16").eval()


def sampled(model, p, y):
    with torch.no_grad():
        z = model(input_ids=torch.tensor([p + y])).logits[0, len(p) - 1:-1].float()
    return torch.log_softmax(z, -1).gather(1, torch.tensor(y)[:, None]).squeeze(1)


rows = []
for r in turns.iter_rows(named=True):
    p, y = r["prompt_ids"], r["response_ids"]
    a, b, e = sampled(A, p, y), sampled(B, p, y), torch.tensor(r["response_logprobs"], dtype=torch.float32)
    rows += [{"vllm_vs_fp32": float(e[i] - a[i]), "hf_bf16_vs_fp32": float(b[i] - a[i]),
              "vllm_vs_hf_bf16": float(e[i] - b[i])} for i in range(len(y))]
t = pl.DataFrame(rows)
print(f"{len(t)} tokens of {n} turns: mean |difference| (mean signed), max |difference|, share over 0.1")
for c in t.columns:
    x = t[c]
    print(f"  {c:16s} {x.abs().mean():.4f} ({x.mean():+.4f})  max {x.abs().max():.3f}  over 0.1 {(x.abs() > 0.1).mean():.3f}")
