"""One PPO minibatch and one log-prob pass of the SmolLM2 Sokoban update with the Hugging Face key-value cache on
(as the model defaults) and off, alternating in one process: `python docs/data/precision_sokoban/exp_use_cache.py
REPEATS RUN` from the repository root after `git apply docs/data/precision_sokoban/no_cache.patch` (the change was not
kept). Prints each variant's seconds."""
import sys
import time
from pathlib import Path

sys.path.insert(0, ".")
from bench.precision import _minibatch
from pipeline.config.params import load_params, with_overrides
from pipeline.model import adamw, packing
from pipeline.model.policy import load_trainable, no_cache
from pipeline.model.ppo import ppo_update, sequence_logprobs

run = Path(sys.argv[2])
p = with_overrides(load_params(Path("configs/smollm2-sokoban.yaml")), ["policy.dtype=bfloat16"])
u = p.update
model, tok = load_trainable(run / "iter_0" / "checkpoint", p.policy, p.runtime.device, seed=0, frozen_low_precision=True)
opt = adamw.build([q for q in model.parameters() if q.requires_grad], u.lr, 0.0)
warm, timed = _minibatch(run, 1, u.minibatch_size, p.seed)
cfg = u.model_copy(update={"epochs": 1, "lr": 0.0})
args = {"cfg": cfg, "pad_id": tok.pad_token_id, "seed": 0, "temperature": p.rollout.temperature}
ppo_update(model, opt, warm, **args)
res = {"cache": [], "nocache": [], "cache_fwd": [], "nocache_fwd": []}
for r in range(int(sys.argv[1])):
    for mode in (["cache", "nocache"] if r % 2 == 0 else ["nocache", "cache"]):
        packing.no_cache = (lambda m: {"use_cache": True}) if mode == "cache" else no_cache
        t0 = time.perf_counter(); ppo_update(model, opt, timed, **args); res[mode].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        sequence_logprobs(model, timed.prompts, timed.responses, tok.pad_token_id, 64, 1.0, None, "tree", 2048)
        res[mode + "_fwd"].append(time.perf_counter() - t0)
for k, v in res.items():
    print(k, " ".join(f"{x:.2f}" for x in v), "median", f"{sorted(v)[len(v)//2]:.2f}", flush=True)
