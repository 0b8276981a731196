"""One PPO minibatch of the SmolLM2 Sokoban update, eager or with each decoder layer compiled by torch.compile
(inductor): `python docs/data/precision_sokoban/exp_compile_layers.py eager|layers RUN` from the repository root,
RUN a bf16 run's results folder of configs/smollm2-sokoban.yaml. Prints each call's seconds and loss. Run with
the key-value cache off (`git apply docs/data/precision_sokoban/no_cache.patch`): with it on, the layers
recompiled once per layer index and stopped compiling after 8."""
import sys
import time
from pathlib import Path

sys.path.insert(0, ".")
from bench.precision import _minibatch
from pipeline.config.params import load_params, with_overrides
from pipeline.model import adamw
from pipeline.model.policy import load_trainable
from pipeline.model.ppo import ppo_update

mode = sys.argv[1]
run = Path(sys.argv[2])
p = with_overrides(load_params(Path("configs/smollm2-sokoban.yaml")), ["policy.dtype=bfloat16"])
u = p.update
model, tok = load_trainable(run / "iter_0" / "checkpoint", p.policy, p.runtime.device, seed=0, frozen_low_precision=True)
print(type(model), flush=True)
if mode != "eager":
    layers = model.base_model.model.model.layers
    for l in layers:
        l.compile(dynamic=True) if mode == "layers" else None
    if mode == "model":
        model.base_model.model.model.compile(dynamic=True)
opt = adamw.build([q for q in model.parameters() if q.requires_grad], u.lr, u.weight_decay)
warm, timed = _minibatch(run, 1, u.minibatch_size, p.seed)
cfg = u.model_copy(update={"epochs": 1})
args = {"cfg": cfg, "pad_id": tok.pad_token_id, "seed": 0, "temperature": p.rollout.temperature}
for name, mb in [("warm", warm), ("warm2", timed), ("timed", timed), ("timed2", warm)]:
    t0 = time.perf_counter(); r = ppo_update(model, opt, mb, **args); print(mode, name, round(time.perf_counter() - t0, 2), r.stats["loss"], flush=True)
