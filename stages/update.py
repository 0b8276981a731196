"""Stage `update`: PPO-clip on the response tokens of iteration i's turns, from the checkpoint of i-1 to that of i
(with `update.objective: step_dpo`, the margin-aware DPO loss on the iteration's preference pairs instead,
`preference_update`, a path of its own).

Its phases, as a torchtune recipe's, one function each:

1. `setup`: the turns and their advantages (read and checked before the model loads), the trainable policy of i-1,
   AdamW resumed from its state of i-1.
2. `logprob_passes`: `log π_old`, recomputed from the rollout checkpoint at the sampling temperature
   (docs/credit-assignment.md, Policy update), its mismatch with the rollout engine's reported; or, with
   `update.old_logprobs: engine` (or `auto` in fp32), the engine's own. The KL reference's where `update.kl_coef`
   > 0 (under LoRA the same model with its adapters off). One step off-policy (`loop.off_policy_lag: 1`) the
   turns of i were sampled by the checkpoint of i-2: `log π_old` is then the proximal policy's (the checkpoint of
   i-1, which the update starts from), and the behaviour policy's log-probs, recomputed from the rollout
   checkpoint, give each token its weight in the decoupled loss. With `update.engine_correction: tis` the
   behaviour policy is the engine as it sampled (its own log-probs): each token weighs `min(π_old / π_engine,
   cap)` at lag 0 too (truncated importance sampling).
3. `train`: `pipeline.model.ppo.ppo_update` on the turns (`Turns`, the batch type stage and library share).
4. `save`: the checkpoint, the optimiser state, the metrics.

The policy trains with fp32 master weights whose forward passes run in `policy.dtype`, or `update.dtype` where it
names another (`pipeline.model.precision`).
A non-finite loss or advantage stops the stage before anything is written.

With `runtime.update_processes: N` the workflow starts the stage under torchrun (`pipeline.model.distributed`):
each process takes its share of every minibatch and process 0 writes. Each holds the whole model
(`runtime.update_sharding: replicate`) or a shard of its weights, gradients and moments (`fsdp`,
`pipeline.model.fsdp`). Every optimiser step's loss goes to the stage's MLflow run as `update/step_loss`.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import polars as pl
import torch

from pipeline.data import paths, tables
from pipeline.data.seeds import stage_seed
from pipeline.model import adamw, fsdp
from pipeline.model.distributed import Processes, start_processes
from pipeline.model.dpo import step_dpo_update
from pipeline.model.policy import adapter_base, is_adapter, load_policy, load_trainable, save_policy, trainer_policy
from pipeline.model.ppo import Placement, Turns, UpdateResult, ppo_update, sequence_logprobs, shared_logprobs
from pipeline.rollout.branching import attribute
from pipeline.workflow.cli import parse_args, stage_job
from pipeline.workflow.tracking import Tracker

OPTIMIZER = "policy"   # results/iter_i/optimizer/policy.pt


def main(argv=None) -> None:
    ctx = parse_args("update", per_iteration=True, argv=argv)
    procs = start_processes(ctx.params.runtime.device)
    ctx.quiet = procs.rank != 0            # process 0 speaks and writes for all
    with stage_job(ctx), (Tracker(ctx.params, "update", ctx.iteration) if procs.rank == 0
                          else nullcontext(_Silent())) as tracker:
        if ctx.params.update.objective == "step_dpo":
            preference_update(ctx, procs, tracker)
            return
        run = setup(ctx, procs)                                                # 1. setup
        turns, reports = logprob_passes(ctx, run.model, run.pad_id, run.turns, procs)   # 2. old log-probs
        result = train(ctx, run, turns, procs)                                 # 3. train
        if procs.rank == 0:                                                    # 4. save
            save(ctx, run.model, run.tokenizer, run.optimizer, result.stats | reports, result.step_losses, tracker)


@dataclass
class Setup:
    """What the update trains: the turns (`Turns`, log-probs not yet filled), the policy of i-1 with its tokenizer,
    AdamW resumed from the state of i-1, the stage's seed and whether the weights are FSDP-sharded."""
    turns: Turns
    model: object
    tokenizer: object
    optimizer: object
    seed: int
    sharded: bool

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id


def setup(ctx, procs: Processes) -> Setup:
    """The turns and their advantages (read and checked before the model loads), the trainable policy of i-1 and
    its optimiser."""
    p, it = ctx.params, ctx.iteration
    turns = read_turns(ctx)
    seed = stage_seed("update", p.seed, it)
    sharded = procs.world > 1 and p.runtime.update_sharding == "fsdp"
    policy = trainer_policy(p)
    model, tokenizer = load_trainable(ctx.path(paths.PREV_CHECKPOINT), policy, procs.device, seed,
                                      p.update.gradient_checkpointing, frozen_low_precision=not sharded)
    if policy.dtype != p.policy.dtype:
        ctx.log(f"training in {policy.dtype} (update.dtype) a policy sampled in {p.policy.dtype}")
    optimizer = _optimizer_of(p)(model.parameters())
    adamw.restore(optimizer, ctx.path(paths.ITER_DIR, it - 1), OPTIMIZER, required=it > 1)
    return Setup(turns, model, tokenizer, optimizer, seed, sharded)


def train(ctx, run: Setup, turns: Turns, procs: Processes) -> UpdateResult:
    """PPO on the turns (`pipeline.model.ppo`; none, where `update.skip_zero_advantage` left every turn out: no
    step, the weights stay); under FSDP the model and optimiser are sharded for it (after the
    log-prob passes, for which every process held the whole model) and gathered back on process 0 after it."""
    p, it = ctx.params, ctx.iteration
    if run.sharded:
        run.optimizer = fsdp.shard_model(run.model, run.optimizer, _optimizer_of(p),
                                         next(run.model.parameters()).device)
        ctx.log(f"FSDP: each of {procs.world} processes holds 1/{procs.world} of the weights, gradients and moments")
    result = ppo_update(run.model, run.optimizer, turns, p.update, run.pad_id, run.seed, p.rollout.temperature,
                        Placement(procs.rank, procs.world, run.sharded), progress=ctx.log)
    if not all(math.isfinite(v) for v in result.stats.values()):
        raise ValueError(f"iteration {it}: non-finite update statistics {result.stats}")
    if run.sharded:   # the whole weights and moments, on process 0, in an unsharded model and optimiser
        run.model, run.optimizer = fsdp.unsharded(run.model, run.optimizer, lambda: _load(ctx, "cpu", run.seed),
                                                  _optimizer_of(p))
    return result


@dataclass
class Pairs:
    """The turns the pairs name, and the pairs as (chosen, rejected, margin) indices into them."""
    prompts: list[list[int]]
    responses: list[list[int]]
    triples: list[tuple[int, int, float]]


def read_pairs(ctx) -> Pairs:
    """Iteration i's preference pairs (`update.objective: step_dpo`) and the turns they name."""
    pairs = tables.read_table(ctx.path(paths.PAIRS), tables.PAIRS)
    steps = tables.read_table(ctx.path(paths.STEPS), tables.STEPS).select("episode_id", "step", "prompt_ids",
                                                                          "response_ids")
    keys = sorted(set(zip(pairs["chosen_episode"], pairs["chosen_step"]))
                  | set(zip(pairs["rejected_episode"], pairs["rejected_step"])))
    index = {k: i for i, k in enumerate(keys)}
    wanted = pl.DataFrame({"episode_id": [e for e, _ in keys], "step": [s for _, s in keys]},
                          schema={"episode_id": pl.Int64, "step": pl.Int32})
    found = wanted.join(steps, on=["episode_id", "step"], how="left", maintain_order="left")
    if found["prompt_ids"].null_count():
        raise ValueError(f"{ctx.path(paths.PAIRS)}: pairs name turns that {ctx.path(paths.STEPS)} does not hold; "
                         "rerun the pairs stage")
    triples = [(index[(w, ws)], index[(lo, ls)], m) for w, ws, lo, ls, m in pairs.select(
        "chosen_episode", "chosen_step", "rejected_episode", "rejected_step", "margin").iter_rows()]
    return Pairs(found["prompt_ids"].to_list(), found["response_ids"].to_list(), triples)


def preference_update(ctx, procs: Processes, tracker) -> None:
    """`update.objective: step_dpo`: the margin-aware DPO loss on iteration i's pairs (`pipeline.model.dpo`), from
    the checkpoint of i-1, with pi_ref that checkpoint (`previous`) or the initial policy (`init`). Its own phases:
    the pairs (read and checked before the model loads), pi_ref's log-probs, train, save."""
    p, it = ctx.params, ctx.iteration
    pairs = read_pairs(ctx)
    seed = stage_seed("update", p.seed, it)
    model, tokenizer = load_trainable(ctx.path(paths.PREV_CHECKPOINT), trainer_policy(p), procs.device, seed,
                                      p.update.gradient_checkpointing)
    prompts, responses, triples = pairs.prompts, pairs.responses, pairs.triples
    cfg, u = p.update.step_dpo, p.update
    if cfg.reference == "init" and ctx.path(paths.PREV_CHECKPOINT) != ctx.path(paths.CHECKPOINT, 0):
        ref = checkpoint_logprobs(ctx, ctx.path(paths.CHECKPOINT, 0), tokenizer.pad_token_id,
                                  Turns(prompts, responses, []), procs, temperature=1.0)
    else:
        ctx.log(f"pi_ref is the checkpoint the update starts from: log-probs of {len(prompts)} turns")
        ref = sequence_logprobs(model, prompts, responses, tokenizer.pad_token_id, u.minibatch_size, 1.0, ctx.log,
                                u.packing, u.micro_batch_tokens)
    optimizer = _optimizer_of(p)(model.parameters())
    adamw.restore(optimizer, ctx.path(paths.ITER_DIR, it - 1), OPTIMIZER, required=it > 1)
    ctx.log(f"step-DPO on {len(triples)} pairs of {len(prompts)} turns (beta {cfg.beta}, margin {cfg.margin}, "
            f"form {cfg.margin_form}, reference {cfg.reference})")
    result = step_dpo_update(model, optimizer, prompts, responses, triples, [float(r.sum()) for r in ref], cfg, u,
                             tokenizer.pad_token_id, seed, progress=ctx.log)
    if not all(math.isfinite(v) for v in result.stats.values()):
        raise ValueError(f"iteration {it}: non-finite update statistics {result.stats}")
    save(ctx, model, tokenizer, optimizer, result.stats, result.step_losses, tracker)


def read_turns(ctx) -> Turns:
    """Iteration i's turns with a response, joined with their advantages (finite: checked on read); a branching
    rollout's shared turns as `credit.attribution` says (`pipeline.rollout.branching.attribute`)."""
    steps = tables.read_table(ctx.path(paths.STEPS), tables.STEPS).select(
        "episode_id", "step", "task_group", "prompt_ids", "response_ids", "response_logprobs", "parent_episode",
        "branch_turn", "shared")
    adv = tables.read_table(ctx.path(paths.ADVANTAGES), tables.ADVANTAGES)
    tables.check_same_turns(steps, ctx.path(paths.STEPS), adv, ctx.path(paths.ADVANTAGES), "advantages")
    table = steps.join(adv, on=["episode_id", "step"], how="inner").sort("episode_id", "step")
    mode = ctx.params.credit.attribution
    attributed = attribute(table, mode)
    if attributed.height != table.height:
        ctx.log(f"credit.attribution hard: {table.height - attributed.height} copies of shared turns merged into "
                f"the {attributed.height} sampled turns")
    table = attributed.filter(pl.col("response_ids").list.len() > 0)
    if ctx.params.update.skip_zero_advantage:
        kept = table.filter(pl.col("advantage") != 0.0)
        ctx.log(f"update.skip_zero_advantage: {table.height - kept.height} of {table.height} turns have advantage 0 "
                f"and are left out; {kept.height} train")
        table = kept
    return Turns(table["prompt_ids"].to_list(), table["response_ids"].to_list(), table["advantage"].to_list(),
                 engine_logprobs=table["response_logprobs"].to_list())


def logprob_passes(ctx, model, pad_id: int, turns: Turns, procs: Processes) -> tuple[Turns, dict[str, float]]:
    """The turns with the log-probs the loss needs besides the new ones: log pi_old, the importance weights
    (one step off-policy, or `update.engine_correction: tis`), the KL reference's; and what they report (the
    engine's mismatch, the weights' statistics). No turn (all left out by `update.skip_zero_advantage`): nothing to
    compute."""
    if not turns.prompts:
        return replace(turns, old_logps=[]), {}
    u = ctx.params.update
    sampled = engine_logprobs(ctx, turns)
    tis = u.engine_correction == "tis" and sampled is None
    if u.engine_correction == "tis" and not tis:
        ctx.log("update.engine_correction tis: the engine's log-probs are log pi_old here, so every weight is 1")
    on_policy = ctx.path(paths.ROLLOUT_CHECKPOINT) == ctx.path(paths.PREV_CHECKPOINT)
    engine = engine_tensors(turns) if tis else None
    mismatch = {}
    if on_policy:      # the engine's log-probs, where they stand in, are log pi_old's
        old = sampled if sampled is not None else old_logprobs(ctx, model, pad_id, turns, procs)
        behaviour, cap, name = engine, u.engine_weight_cap, "engine"
        if sampled is None:
            mismatch = engine_mismatch(turns, old)
    else:              # one step off-policy: they are the behaviour policy's
        old = old_logprobs(ctx, model, pad_id, turns, procs)
        behaviour, cap, name = sampled, u.behaviour_weight_cap, "behaviour"
        if engine is not None:
            behaviour = engine
            ctx.log("update.engine_correction tis: the engine's log-probs are the behaviour policy's")
        elif behaviour is None:
            behaviour = behaviour_logprobs(ctx, pad_id, turns, procs)
            mismatch = engine_mismatch(turns, behaviour)
    weights, stats = (None, {}) if behaviour is None else behaviour_weights(old, behaviour, cap, name)
    ref = reference_logprobs(ctx, model, pad_id, turns, procs, old)
    return replace(turns, old_logps=old, ref_logps=ref, weights=weights), mismatch | stats


def engine_logprobs(ctx, turns: Turns) -> list | None:
    """With `update.old_logprobs: engine`, the rollout engine's log-probs of the sampled tokens (at the sampling
    temperature), which then stand in for the sampling checkpoint's; else None."""
    p = ctx.params
    choice = p.update.old_logprobs
    if choice == "auto":
        trains_in = trainer_policy(p).dtype
        choice = "engine" if p.policy.dtype == trains_in == "float32" else "recompute"
        ctx.log(f"update.old_logprobs auto: {choice} (the run samples in {p.policy.dtype}, trains in {trains_in})")
    if choice != "engine":
        return None
    ctx.log(f"the rollout engine's log-probs stand in for the sampling checkpoint's ({len(turns.prompts)} turns, "
            "update.old_logprobs: engine)")
    return engine_tensors(turns)


def engine_tensors(turns: Turns) -> list:
    """The rollout engine's log-probs of each turn's response tokens, as the rollout wrote them."""
    return [torch.tensor(x, dtype=torch.float32) for x in turns.engine_logprobs]


def old_logprobs(ctx, model, pad_id: int, turns: Turns, procs: Processes) -> list:
    """`log π_old` of every response token under the checkpoint the update starts from (the rollout's, or one step
    off-policy the proximal policy's)."""
    ctx.log(f"recomputing log pi_old for {len(turns.prompts)} turns")
    return turn_logprobs(ctx, model, pad_id, turns, procs)


def engine_mismatch(turns: Turns, sampler: list) -> dict[str, float]:
    """How far the rollout engine's log-probs are from those recomputed under the checkpoint that sampled the turns
    (as verl reports it)."""
    engine = torch.cat(engine_tensors(turns))
    gap = (engine - torch.cat(sampler)).abs()
    return {"logprob_mismatch_abs_mean": float(gap.mean()), "logprob_mismatch_abs_max": float(gap.max()),
            "logprob_mismatch_share_over_0.1": float((gap > 0.1).float().mean())}


def behaviour_logprobs(ctx, pad_id: int, turns: Turns, procs: Processes) -> list:
    """One step off-policy, the log-probs of the checkpoint that sampled the turns, where it is not the one the
    update starts from (from iteration 2 on)."""
    rollout = ctx.path(paths.ROLLOUT_CHECKPOINT)
    ctx.log(f"recomputing the behaviour policy's log-probs ({rollout})")
    return checkpoint_logprobs(ctx, rollout, pad_id, turns, procs)


def behaviour_weights(proximal: list, behaviour: list, cap: float,
                      name: str = "behaviour") -> tuple[list, dict[str, float]]:
    """Each token's weight in the decoupled loss, `min(π_prox / π_behav, cap)`, and their statistics, reported as
    `name`: the mean weight, the share truncated, and the behaviour policy's KL to the proximal one (its tokens'
    mean log ratio). Under `update.engine_correction: tis` at lag 0 the behaviour policy is the engine and the
    proximal one π_old."""
    weights = [torch.exp(pr - be).clamp(max=cap) for pr, be in zip(proximal, behaviour, strict=True)]
    w = torch.cat(weights)
    log_ratio = torch.cat(behaviour) - torch.cat(proximal)
    return weights, {f"{name}_weight_mean": float(w.mean()), f"{name}_weight_capped_share":
                     float((w >= cap).float().mean()), f"{name}_kl": float(log_ratio.mean())}


def reference_logprobs(ctx, model, pad_id: int, turns: Turns, procs: Processes, old: list) -> list | None:
    """The KL reference's (the initial policy's) log-probs, where `update.kl_coef` > 0. Where the update starts
    from the initial policy (iteration 1; with LoRA its fresh adapters add zero), they are `old`: no second pass.
    Where `model` is LoRA adapters over checkpoint 0 (a LoRA run's checkpoints from iteration 1 on), the reference
    is that model with its adapters switched off: one pass on the model already loaded, instead of loading
    checkpoint 0 again."""
    if ctx.params.update.kl_coef <= 0:
        return None
    initial = ctx.path(paths.CHECKPOINT, 0)
    if ctx.path(paths.PREV_CHECKPOINT) == initial:
        ctx.log("the KL reference is the checkpoint the update starts from: its log-probs are log pi_old")
        return old
    if adapts(ctx.path(paths.PREV_CHECKPOINT), initial) and hasattr(model, "disable_adapter"):
        ctx.log(f"the KL reference's log-probs: {len(turns.prompts)} turns under {initial}, the model's LoRA "
                "adapters switched off")
        with model.disable_adapter():
            return turn_logprobs(ctx, model, pad_id, turns, procs)
    return checkpoint_logprobs(ctx, initial, pad_id, turns, procs)


def adapts(checkpoint: Path, initial: Path) -> bool:
    """Whether `checkpoint` is LoRA adapters whose base model is `initial` (the folder, links resolved)."""
    return is_adapter(checkpoint) and adapter_base(checkpoint) == Path(initial).resolve()


def checkpoint_logprobs(ctx, checkpoint, pad_id: int, turns: Turns, procs: Processes,
                        temperature: float | None = None) -> list:
    """The turns' response log-probs under another checkpoint than the one training, at the sampling temperature
    (or `temperature`)."""
    model, _ = load_policy(checkpoint, trainer_policy(ctx.params).dtype, procs.device, train=True)
    ctx.log(f"log-probs of {len(turns.prompts)} turns under {checkpoint}")
    return turn_logprobs(ctx, model, pad_id, turns, procs, temperature)


def turn_logprobs(ctx, model, pad_id: int, turns: Turns, procs: Processes, temperature: float | None = None) -> list:
    """The turns' response log-probs under `model`, at the sampling temperature (or `temperature`), batched and
    packed as the update's passes are."""
    p = ctx.params
    t = p.rollout.temperature if temperature is None else temperature
    return shared_logprobs(model, turns.prompts, turns.responses, pad_id, p.update.minibatch_size, t, procs,
                           ctx.log, p.update.packing, p.update.micro_batch_tokens)


def save(ctx, model, tokenizer, optimizer, stats: dict[str, float], step_losses: list[float], tracker) -> None:
    """The checkpoint of i, AdamW's state beside it (older states pruned), and the metrics (every optimiser step's
    loss as `update/step_loss`)."""
    p, it = ctx.params, ctx.iteration
    for k, loss in enumerate(step_losses):
        tracker.log_metrics({"update/step_loss": loss}, step=k)
    out = ctx.path(paths.CHECKPOINT)
    adamw.save(optimizer, ctx.path(paths.ITER_DIR), OPTIMIZER)
    with tables.atomic_dir(out) as tmp:
        save_policy(model, tokenizer, tmp, base=ctx.path(paths.CHECKPOINT, 0))
    adamw.prune(ctx.path(paths.ITER_DIR), OPTIMIZER, p.runtime.keep_optimizer)
    tracker.log_metrics({f"update/{k}": v for k, v in stats.items()}, step=it, parent=True)
    ctx.log(f"wrote {out}: " + ", ".join(f"{k} {v:.4f}" for k, v in stats.items()))


def _load(ctx, device, seed: int):
    return load_trainable(ctx.path(paths.PREV_CHECKPOINT), trainer_policy(ctx.params), device, seed,
                          frozen_low_precision=False)[0]


def _optimizer_of(p):
    """AdamW with the update's settings, for any parameters (the whole model's, or FSDP's shards)."""
    return lambda parameters: adamw.build(parameters, p.update.lr, p.update.weight_decay)


class _Silent:
    """The tracker of a process other than 0: logs nothing."""
    def log_metrics(self, *args, **kwargs) -> None:
        pass


if __name__ == "__main__":
    main()
