"""Stage `update`: PPO-clip on the response tokens of iteration i's turns, from the checkpoint of i-1 to that of i.

`log π_old` is recomputed from the rollout checkpoint at the sampling temperature (credit-assignment.md, Policy
update); its mismatch with the rollout engine's log-probs is reported. The policy trains with fp32 master weights
whose forward passes run in `policy.dtype` (`pipeline.precision`), and the checkpoint keeps the fp32 weights.
AdamW resumes from the state of i-1 (`pipeline.optstate`: beside the checkpoint; `runtime.keep_optimizer`). A
non-finite loss or advantage stops the stage before anything is written.

With `runtime.update_processes: N` the workflow starts the stage under torchrun with N processes (one GPU each on
a GPU, gloo on the CPU): each recomputes log π_old for its share of the turns, takes its share of every minibatch,
and the gradients are summed across processes before each optimiser step (`pipeline.ppo`); process 0 writes.
Each process holds the whole model (`runtime.update_sharding: replicate`), or a shard of its weights, gradients
and moments (`fsdp`: FSDP2, `pipeline.sharding`).
Every optimiser step's loss goes to the stage's MLflow run as `update/step_loss`.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import polars as pl
import torch

from pipeline import optstate
from pipeline.policy import load_policy, save_policy, with_lora
from pipeline.ppo import ppo_update, sequence_logprobs
from pipeline.registry import ADVANTAGES, CHECKPOINT, ITER_DIR, PREV_CHECKPOINT, STEPS
from pipeline.stagekit import parse_args, stage_errors
from pipeline.tables import ADVANTAGES as ADV_SCHEMA
from pipeline.tables import STEPS as STEPS_SCHEMA
from pipeline.tables import atomic_dir, check_same_turns, read_table
from pipeline.tracking import Tracker

OPTIMIZER = "policy"   # results/iter_i/optimizer/policy.pt


def start_processes(device: str) -> tuple[int, int, str]:
    """(rank, world size, device) of this process: one process, or one of torchrun's (WORLD_SIZE set), whose process
    group this starts (NCCL and a GPU per process on a GPU, gloo on the CPU)."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, device
    import torch.distributed as dist

    from pipeline.policy import resolve_device

    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if resolve_device(device).type == "cuda":
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return rank, world, device


def shared_logprobs(model, prompts, responses, pad_id, batch_size, temperature, rank, world):
    """`sequence_logprobs` of every turn, each process computing its share and all gathering the rest."""
    if world == 1:
        return sequence_logprobs(model, prompts, responses, pad_id, batch_size, temperature)
    import torch.distributed as dist

    from pipeline.ppo import share

    mine = sequence_logprobs(model, share(prompts, rank, world), share(responses, rank, world), pad_id, batch_size,
                             temperature)
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    return [t for part in parts for t in part]


class _Silent:
    """The tracker of a process other than 0: logs nothing."""
    def log_metrics(self, *args, **kwargs) -> None:
        pass


def main(argv=None) -> None:
    ctx = parse_args("update", per_iteration=True, argv=argv)
    p, it = ctx.params, ctx.iteration
    rank, world, device = start_processes(p.runtime.device)
    if rank:
        ctx.log = lambda msg: None
    with stage_errors(ctx), (Tracker(p, "update", it) if rank == 0 else nullcontext(_Silent())) as tracker:
        steps = read_table(ctx.path(STEPS), STEPS_SCHEMA).select(
            "episode_id", "step", "task_group", "prompt_ids", "response_ids", "response_logprobs")
        adv = read_table(ctx.path(ADVANTAGES), ADV_SCHEMA)     # finite advantages: checked on read
        check_same_turns(steps, ctx.path(STEPS), adv, ctx.path(ADVANTAGES), "advantages")
        table = steps.join(adv, on=["episode_id", "step"], how="inner").sort("episode_id", "step")
        table = table.filter(pl.col("response_ids").list.len() > 0)
        prev = ctx.path(PREV_CHECKPOINT)

        def policy(where):
            model, tokenizer = load_policy(prev, p.policy.dtype, where, train=True)
            if p.policy.lora is not None:   # iteration 1 wraps the initial policy; later ones load their adapter
                model = with_lora(model, p.policy.lora, seed=p.seed * 7919 + it)
            return model, tokenizer

        model, tokenizer = policy(device)
        if p.update.gradient_checkpointing:   # non-reentrant: works with frozen inputs (LoRA) as with full training
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        temperature = p.rollout.temperature
        prompts = table["prompt_ids"].to_list()
        responses = table["response_ids"].to_list()
        advantages = table["advantage"].to_list()
        ctx.log(f"recomputing log pi_old for {len(prompts)} turns")
        old = shared_logprobs(model, prompts, responses, tokenizer.pad_token_id, p.update.minibatch_size,
                              temperature, rank, world)
        engine = torch.cat([torch.tensor(x, dtype=torch.float32) for x in table["response_logprobs"].to_list()])
        recomputed = torch.cat(old)
        gap = (engine - recomputed).abs()   # the rollout engine's log-probs against the trainer's (as verl logs)
        mismatch = {"logprob_mismatch_abs_mean": float(gap.mean()), "logprob_mismatch_abs_max": float(gap.max()),
                    "logprob_mismatch_share_over_0.1": float((gap > 0.1).float().mean())}
        ref = None
        if p.update.kl_coef > 0:
            ref_model, _ = load_policy(ctx.path(CHECKPOINT, 0), p.policy.dtype, device, train=True)
            ref = shared_logprobs(ref_model, prompts, responses, tokenizer.pad_token_id, p.update.minibatch_size,
                                  temperature, rank, world)
            del ref_model
        def adamw(params):
            return torch.optim.AdamW(params, lr=p.update.lr, weight_decay=p.update.weight_decay)

        optimizer = adamw([q for q in model.parameters() if q.requires_grad])
        optstate.restore(optimizer, ctx.path(ITER_DIR, it - 1), OPTIMIZER, required=it > 1)
        sharded = world > 1 and p.runtime.update_sharding == "fsdp"
        if sharded:   # after log pi_old: every process held the whole model for it
            from pipeline.sharding import shard_model

            optimizer = shard_model(model, optimizer, adamw, next(model.parameters()).device)
            ctx.log(f"FSDP: each of {world} processes holds 1/{world} of the weights, gradients and moments")
        trace: list[float] = []
        stats = ppo_update(model, optimizer, prompts, responses, advantages, old, p.update,
                           tokenizer.pad_token_id, seed=p.seed * 7919 + it, ref_logps=ref, progress=ctx.log,
                           temperature=temperature, rank=rank, world=world, trace=trace, sharded=sharded)
        stats.update(mismatch)
        if not all(math.isfinite(v) for v in stats.values()):
            raise ValueError(f"iteration {it}: non-finite update statistics {stats}")
        if sharded:   # the whole weights and moments, gathered on process 0 into an unsharded model
            from pipeline.sharding import full_state

            weights, state = full_state(model, optimizer)
        if rank:   # process 0 writes the checkpoint, the optimiser state and the metrics
            return
        if sharded:
            model, _ = policy("cpu")
            model.load_state_dict(weights)
            optimizer = adamw([q for q in model.parameters() if q.requires_grad])
            optimizer.load_state_dict(state)
        for k, loss in enumerate(trace):
            tracker.log_metrics({"update/step_loss": loss}, step=k)
        out = ctx.path(CHECKPOINT)
        optstate.save(optimizer, ctx.path(ITER_DIR), OPTIMIZER)
        with atomic_dir(out) as tmp:
            save_policy(model, tokenizer, tmp, base=ctx.path(CHECKPOINT, 0))
        optstate.prune(ctx.path(ITER_DIR), OPTIMIZER, p.runtime.keep_optimizer)
        tracker.log_metrics({f"update/{k}": v for k, v in stats.items()}, step=it, parent=True)
        ctx.log(f"wrote {out}: " + ", ".join(f"{k} {v:.4f}" for k, v in stats.items()))


if __name__ == "__main__":
    main()
