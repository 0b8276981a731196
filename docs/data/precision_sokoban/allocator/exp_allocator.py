"""One process of the allocator experiment: the SmolLM2 Sokoban update's PPO minibatch (bf16, 64 turns of iteration
1) after one that warms up, REPEATS times, and one log-prob pass; prints seconds and minor page faults of each.
The allocator is chosen by the caller (LD_PRELOAD, MALLOC_* variables):
`python exp_allocator.py REPEATS RUN` from the repository root."""
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, ".")
from bench.precision import _minibatch
from pipeline.config.params import load_params, with_overrides
from pipeline.model import adamw
from pipeline.model.policy import load_trainable
from pipeline.model.ppo import ppo_update, sequence_logprobs


def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


run = Path(sys.argv[2])
p = with_overrides(load_params(Path("configs/smollm2-sokoban.yaml")), ["policy.dtype=bfloat16"])
u = p.update
model, tok = load_trainable(run / "iter_0" / "checkpoint", p.policy, p.runtime.device, seed=0, frozen_low_precision=True)
opt = adamw.build([q for q in model.parameters() if q.requires_grad], u.lr, 0.0)
warm, timed = _minibatch(run, 1, u.minibatch_size, p.seed)
cfg = u.model_copy(update={"epochs": 1, "lr": 0.0})
args = {"cfg": cfg, "pad_id": tok.pad_token_id, "seed": 0, "temperature": p.rollout.temperature}
ppo_update(model, opt, warm, **args)
out = []
for r in range(int(sys.argv[1])):
    f0, t0 = faults(), time.perf_counter()
    ppo_update(model, opt, timed, **args)
    out.append(("step", time.perf_counter() - t0, faults() - f0))
f0, t0 = faults(), time.perf_counter()
sequence_logprobs(model, timed.prompts, timed.responses, tok.pad_token_id, 64, 1.0, None, "tree", 2048)
out.append(("logprobs", time.perf_counter() - t0, faults() - f0))
print(" ".join(f"{k}={s:.2f}s/{f}" for k, s, f in out), f"maxrss={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}MB", flush=True)
