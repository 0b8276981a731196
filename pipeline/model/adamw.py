"""AdamW, the one optimiser of the policy and of every learned step-reward model, and its state between
iterations: `results/iter_i/optimizer/<name>.pt`, beside the checkpoint, not in it.

The update of iteration i (and a step-reward model's fit) resumes AdamW from the state of i-1 and saves its own.
The state is not a declared stage output: the checkpoint folder stays a plain model folder that DVC and Snakemake
hash and time as before, and `runtime.keep_optimizer: last` deletes the state of older iterations once the newer
one is written, so a finished run holds one optimiser state per model (`all` keeps every one). The newer state is
written before the stage's outputs and the older ones are deleted only after them, so a stage killed before its
outputs are written resumes from a state that is still there. Not covered: a stage killed in the moment after the
older state is deleted and before its process exits (its last metrics). Snakemake then counts the job as
incomplete and reruns it, and the state it resumes from is gone: the error names the file and says to rerun from
iteration 1. `keep_optimizer: all` avoids that window.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from pipeline.data.tables import atomic_file

FOLDER = "optimizer"
ITER = re.compile(r"iter_(\d+)$")


def build(parameters, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """A fresh AdamW on `parameters` (those with `requires_grad` of a model: LoRA trains its adapters only);
    `restore` loads a saved state into it."""
    return torch.optim.AdamW([q for q in parameters if q.requires_grad], lr=lr, weight_decay=weight_decay)


def state_file(iter_dir: str | Path, name: str) -> Path:
    return Path(iter_dir) / FOLDER / f"{name}.pt"


def save(optimizer, iter_dir: str | Path, name: str) -> Path:
    """Write `optimizer`'s state for the iteration of `iter_dir`, atomically."""
    path = state_file(iter_dir, name)
    with atomic_file(path) as tmp:
        torch.save(optimizer.state_dict(), tmp)
    return path


def restore(optimizer, iter_dir: str | Path, name: str, required: bool) -> bool:
    """Load the moments and step counts saved for the iteration of `iter_dir` into `optimizer`, keeping its own
    hyperparameters (learning rate, weight decay: the params may have changed them). Returns whether a state was
    found; a missing one is an error when `required` (an iteration after the first)."""
    path = state_file(iter_dir, name)
    if not path.is_file():
        if required:
            raise FileNotFoundError(
                f"{path}: the optimiser state this stage resumes from is missing. runtime.keep_optimizer: last keeps "
                f"only the newest iteration's state, so an iteration can be rerun alone only after the one before it "
                f"was rerun; rerun from iteration 1, or set runtime.keep_optimizer: all")
        return False
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(torch.load(path, weights_only=True, map_location="cpu"))
    for group, own in zip(optimizer.param_groups, settings, strict=True):
        group.update(own)
    return True


def prune(iter_dir: str | Path, name: str, keep: str) -> list[Path]:
    """With `keep` == "last", delete `name`'s state of every iteration before that of `iter_dir`; returns the
    files deleted."""
    if keep == "all":
        return []
    iter_dir = Path(iter_dir)
    current = int(ITER.search(iter_dir.name).group(1))
    gone = []
    for d in iter_dir.parent.glob("iter_*"):
        m = ITER.search(d.name)
        f = state_file(d, name)
        if m and int(m.group(1)) < current and f.is_file():
            f.unlink()
            gone.append(f)
            if not any(f.parent.iterdir()):
                f.parent.rmdir()
    return gone
