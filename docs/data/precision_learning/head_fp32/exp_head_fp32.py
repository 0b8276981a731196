"""How far a bf16-served SmolLM2 policy is from the same weights in fp32, and how much of it is the LM head's bf16
matrix product (the logits rounded to 8 significant bits) rather than the body or the rounded weights.

    python docs/data/precision_learning/head_fp32/exp_head_fp32.py CHECKPOINT STEPS_PARQUET N_TURNS OUT_CSV

Per response token of N sampled turns (teacher-forced, temperature 1), against fp32 weights computed in fp32 (A):
  bf16            the merged copy rounded to bf16 and computed in bf16, as vLLM serves it (B)
  bf16 weights    B's rounded weights computed in fp32 (the rounding alone)
  bf16, fp32 head B's body in bf16, its last hidden state and the (bf16) head weights multiplied in fp32
  base rounded    the base rounded to bf16, the adapter merged onto it in fp32, computed in fp32 (the update kept)
  stochastic      the merged copy rounded to bf16 stochastically (policy.merge_rounding: stochastic), in bf16
the mean KL(A || X) over the vocabulary, the mean and max |log p_A(y) - log p_X(y)| of the sampled token, the share
over 0.1, and how often the most probable token differs."""
import sys
from pathlib import Path

import polars as pl
import torch
import torch.nn.functional as F
from peft import PeftModel
from transformers import AutoModelForCausalLM

from pipeline.model.policy import adapter_base, load_weights

torch.set_num_threads(1)
ckpt, steps, n, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
turns = pl.read_parquet(steps).sample(n=n, seed=0, shuffle=True)
A = load_weights(ckpt, "float32").eval()
B = load_weights(ckpt, "bfloat16").eval()
C = load_weights(ckpt, "bfloat16").float().eval()
D = AutoModelForCausalLM.from_pretrained(adapter_base(Path(ckpt)), local_files_only=True, dtype=torch.float32)
base_exact = all(torch.equal(q, q.to(torch.bfloat16).float()) for q in D.parameters())
for q in D.parameters():
    q.data = q.data.to(torch.bfloat16).float()
D = PeftModel.from_pretrained(D, ckpt).merge_and_unload().eval()
E = load_weights(ckpt, "bfloat16", merge_rounding="stochastic").eval()
print("the fp32 base is exactly representable in bf16:", base_exact)


def logps(model, ids, start, head32=False):
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state[0, start - 1:-1]
        if head32:
            z = F.linear(h.float(), model.lm_head.weight.float())
        else:
            z = model.lm_head(h).float()
    return torch.log_softmax(z, dim=-1)


rows = []
for r in turns.iter_rows(named=True):
    p, y = r["prompt_ids"], r["response_ids"]
    ids = torch.tensor([p + y])
    tgt = torch.tensor(y)
    ref = logps(A, ids, len(p))
    for name, model, head32 in (("bf16", B, False), ("bf16 weights", C, False), ("bf16, fp32 head", B, True),
                                ("base rounded", D, False), ("stochastic", E, False)):
        x = logps(model, ids, len(p), head32)
        kl = (ref.exp() * (ref - x)).sum(-1)
        d = (ref.gather(1, tgt[:, None]) - x.gather(1, tgt[:, None])).abs().squeeze(1)
        flip = (ref.argmax(-1) != x.argmax(-1)).float()
        rows += [{"variant": name, "turn": r["episode_id"] * 100 + r["step"], "token": i, "kl": float(kl[i]),
                      "abs_dlogp": float(d[i]), "argmax_differs": float(flip[i])} for i in range(len(y))]
t = pl.DataFrame(rows)
t.write_csv(out)
print(t.group_by("variant", maintain_order=True).agg(
    tokens=pl.len(), kl_mean=pl.col("kl").mean(), dlogp_mean=pl.col("abs_dlogp").mean(),
    dlogp_max=pl.col("abs_dlogp").max(), share_over_0_1=(pl.col("abs_dlogp") > 0.1).mean(),
    argmax_differs=pl.col("argmax_differs").mean()))
