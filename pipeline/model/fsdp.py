"""FSDP2 for the update stage (`runtime.update_sharding: fsdp`): each of torchrun's processes keeps a 1/N shard of
the weights, gradients and AdamW moments instead of a whole replica.

Every decoder layer (the classes the model lists in `_no_split_modules`, as accelerate and TRL wrap them) and then the
root become FSDP modules: a layer's weights are gathered for its forward and backward, and its gradients are
reduce-scattered. FSDP averages them over the processes (gloo has no pre-scaled sum), so `ppo_update` scales each
process's loss by N: the loss is already a mean over the whole minibatch, its gradient a sum of shares. The optimiser
state is saved and restored in the same file format as an unsharded run's (`pipeline.model.adamw`), so runs and
iterations can switch between one process, replicas and shards.
"""

from __future__ import annotations

import torch

__all__ = ["full_state", "shard_model", "unsharded"]


def _indexed(osd: dict) -> dict:
    """An optimiser state keyed by parameter name (torch.distributed.checkpoint's form) as `Optimizer.state_dict()`
    keys it: by each parameter's position across the parameter groups."""
    state, groups, k = {}, [], 0
    for g in osd["param_groups"]:
        ids = []
        for name in g["params"]:
            if name in osd["state"]:
                state[k] = osd["state"][name]
            ids.append(k)
            k += 1
        groups.append({**g, "params": ids})
    return {"state": state, "param_groups": groups}


def shard_model(model, optimizer, make_optimizer, device: torch.device):
    """Shard `model` across the process group and return a new optimiser (from `make_optimizer(params)`) holding
    `optimizer`'s state, sharded. Every process calls this with the whole model loaded."""
    from torch.distributed import get_world_size  # start-up cost: torch
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )  # start-up cost: torch
    from torch.distributed.device_mesh import init_device_mesh  # start-up cost: torch
    from torch.distributed.fsdp import fully_shard  # start-up cost: torch

    full = StateDictOptions(full_state_dict=True)
    state = get_optimizer_state_dict(model, optimizer, options=full) if optimizer.state else None
    mesh = init_device_mesh(device.type, (get_world_size(),))
    layers = set(getattr(model, "_no_split_modules", None) or ())
    base = getattr(model, "get_base_model", None)       # a peft model lists them on the model it wraps
    if base is not None:
        layers |= set(getattr(base(), "_no_split_modules", None) or ())
    wrapped = [m for m in model.modules() if type(m).__name__ in layers]
    if not wrapped:
        raise ValueError(f"runtime.update_sharding: fsdp: {type(model).__name__} names no decoder layer classes "
                         f"(_no_split_modules) to shard")
    for m in wrapped:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = make_optimizer([q for q in model.parameters() if q.requires_grad])
    if state is not None:
        set_optimizer_state_dict(model, sharded, state, options=full)
    return sharded


def full_state(model, optimizer) -> tuple[dict, dict]:
    """The whole weights (by name) and optimiser state (`Optimizer.state_dict()`'s form) of a sharded model, on
    the CPU of process 0 (empty elsewhere). Every process calls this."""
    from torch.distributed import get_rank  # start-up cost: torch
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )  # start-up cost: torch

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=opts)
    state = get_optimizer_state_dict(model, optimizer, options=opts)
    return (weights, _indexed(state)) if get_rank() == 0 else ({}, {})


def unsharded(model, optimizer, load_model, make_optimizer):
    """(model, optimizer) holding the whole weights and AdamW state of a sharded `model` on process 0: a model from
    `load_model()` and an optimiser from `make_optimizer(params)` that take them; (None, None) on the other
    processes. Every process calls this."""
    weights, state = full_state(model, optimizer)
    from torch.distributed import get_rank  # start-up cost: torch

    if get_rank() != 0:
        return None, None
    whole = load_model()
    whole.load_state_dict(weights)
    whole_optimizer = make_optimizer(whole.parameters())
    whole_optimizer.load_state_dict(state)
    return whole, whole_optimizer
