"""AdamW, the one optimiser of the policy and of every learned step-reward model, and its state between
iterations: `results/iter_i/optimizer/<name>.pt`, beside the checkpoint, not in it.

The update of iteration i (and a step-reward model's fit) resumes AdamW from the state of i-1 and saves its own.
The state is not a declared stage output: the checkpoint folder stays a plain model folder that DVC and Snakemake
hash and time as before. `runtime.keep_optimizer: last` (`all` keeps every one): the stage of i deletes the states
before i-1, keeping the one it resumed from, since Snakemake counts the job as finished only once its process
has exited and reruns it from i-1's state if it is killed before; the report stage, the run's last job, deletes
all but the newest, so a finished run holds one optimiser state per model.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.data.tables import atomic_file

if TYPE_CHECKING:
    import torch

FOLDER = "optimizer"
ITER = re.compile(r"iter_(\d+)$")


def build(parameters, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """A fresh AdamW on `parameters` (those with `requires_grad` of a model: LoRA trains its adapters only);
    `restore` loads a saved state into it."""
    import torch  # here, not at the top: the report stage prunes states and does not import torch

    return torch.optim.AdamW([q for q in parameters if q.requires_grad], lr=lr, weight_decay=weight_decay)


def state_file(iter_dir: str | Path, name: str) -> Path:
    return Path(iter_dir) / FOLDER / f"{name}.pt"


def save(optimizer, iter_dir: str | Path, name: str) -> Path:
    """Write `optimizer`'s state for the iteration of `iter_dir`, atomically."""
    path = state_file(iter_dir, name)
    import torch

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
    import torch

    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(torch.load(path, weights_only=True, map_location="cpu"))
    for group, own in zip(optimizer.param_groups, settings, strict=True):
        group.update(own)
    return True


def prune(iter_dir: str | Path, name: str, keep: str) -> list[Path]:
    """With `keep` == "last", delete `name`'s state of every iteration before the one preceding `iter_dir`'s (the
    state this stage resumed from stays until the next stage of the same model has written its own); returns the
    files deleted."""
    if keep == "all":
        return []
    iter_dir = Path(iter_dir)
    current = int(ITER.search(iter_dir.name).group(1))
    return _delete(iter_dir.parent, lambda it, n: n == name and it < current - 1)


def prune_finished(results: str | Path, keep: str) -> list[Path]:
    """With `keep` == "last", every model's states but its newest, in the run's results folder `results` (the
    report stage, once every update and fit has finished); returns the files deleted."""
    if keep == "all":
        return []
    results = Path(results)
    newest: dict[str, int] = {}
    for f in results.glob(f"iter_*/{FOLDER}/*.pt"):
        if m := ITER.search(f.parent.parent.name):
            newest[f.stem] = max(newest.get(f.stem, -1), int(m.group(1)))
    return _delete(results, lambda it, n: it < newest[n])


def _delete(results: Path, doomed) -> list[Path]:
    gone = []
    for f in sorted(results.glob(f"iter_*/{FOLDER}/*.pt")):
        m = ITER.search(f.parent.parent.name)
        if m and doomed(int(m.group(1)), f.stem):
            f.unlink()
            gone.append(f)
            if not any(f.parent.iterdir()):
                f.parent.rmdir()
    return gone
