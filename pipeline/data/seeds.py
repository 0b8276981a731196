"""Every seed a run uses, derived from the params' `seed`: the environment seed of every task it plays (disjoint
by construction), and each stage's sampling and training seed (`stage_seed`).

Task seeds.

A task seed packs four fields into one non-negative 63-bit integer:

    stream (2 bits) | run seed (31 bits) | iteration (10 bits) | index (20 bits)

`stream` says what the task is for: training rollouts, warm-start demonstrations, the tokenizer's corpus, or
held-out evaluation. Two tasks of different streams, seeds, iterations or indices therefore never share a seed,
whatever the params: the held-out rooms can never be trained on, and no warm-start demonstration is played on
them. Held-out tasks use run seed 0 in every run, so that runs with different seeds are evaluated on the same
rooms. Each field's range is enforced by the params schema (`seed` < 2^31, `loop.iterations` ≤ 1000, task and
episode counts < 2^20); `task_seed` checks them again.
"""

from __future__ import annotations

STREAMS = {"train": 0, "warmstart": 1, "tokenizer": 2, "eval": 3}
SEED_BITS, ITERATION_BITS, INDEX_BITS = 31, 10, 20
MAX_INDEX = (1 << INDEX_BITS) - 1          # tasks per iteration, warm-start episodes, held-out tasks
MAX_ITERATION = (1 << ITERATION_BITS) - 1


def task_seed(stream: str, seed: int, iteration: int, index: int) -> int:
    """The environment seed of task `index` of `iteration` in `stream` for run seed `seed`."""
    if stream not in STREAMS:
        raise ValueError(f"unknown task stream {stream!r}; expected one of {list(STREAMS)}")
    for name, value, bits in (("seed", seed, SEED_BITS), ("iteration", iteration, ITERATION_BITS),
                              ("index", index, INDEX_BITS)):
        if not 0 <= value < (1 << bits):
            raise ValueError(f"task {name} {value} is outside 0..{(1 << bits) - 1}")
    return (((STREAMS[stream] << SEED_BITS | seed) << ITERATION_BITS | iteration) << INDEX_BITS) | index


def fields(task: int) -> tuple[str, int, int, int]:
    """(stream, seed, iteration, index) of a task seed: the inverse of `task_seed`."""
    index = task & MAX_INDEX
    iteration = (task >> INDEX_BITS) & MAX_ITERATION
    seed = (task >> (INDEX_BITS + ITERATION_BITS)) & ((1 << SEED_BITS) - 1)
    stream = task >> (INDEX_BITS + ITERATION_BITS + SEED_BITS)
    return {v: k for k, v in STREAMS.items()}[stream], seed, iteration, index


# Each stage's seed for its random draws (sampling, minibatch order, LoRA's initial adapters, SPA's fit) from the
# run's seed and the iteration. The formulas are fixed, so a rerun draws the same numbers. They are not disjoint
# across stages (update at iteration 17 and fit at iteration 1 share one; init and reward_init use the run's
# seed): each seeds its own generator for its own draws, so a shared number couples nothing.
_STAGE_SEEDS = {
    "rollout": lambda seed, it: seed * 1_000_003 + it,             # the rollout engine's draws
    "evaluate": lambda seed, it: seed * 1_000_003 + 500_000 + it,  # held-out sampling, apart from rollouts
    "update": lambda seed, it: seed * 7919 + it,                   # PPO's minibatch order, the policy's LoRA init
    "fit": lambda seed, it: seed * 7919 + 17 * it,                 # a step-reward model's fit (SPA's batches)
    "init": lambda seed, it: seed,                                 # the tiny model, the warm start
    "reward_init": lambda seed, it: seed,                          # a step-reward model's LoRA init
}


def task_hash(task: int) -> int:
    """A 64-bit mix of a task seed (splitmix64's finaliser): how an environment with a fixed list of tasks (games,
    instructions) picks one for a training task, spread evenly whatever the seed's bit fields."""
    x = (task ^ (task >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def task_item(task: int, train, held_out):
    """The item of an environment's fixed lists of tasks that a task seed plays: held-out tasks (stream eval) play
    `held_out` in order, the others one of `train` picked by `task_hash`."""
    stream, _, _, index = fields(task)
    if stream == "eval":
        return held_out[index % len(held_out)]
    return train[task_hash(task) % len(train)]


def stage_seed(stage: str, seed: int, iteration: int = 0) -> int:
    """The seed of `stage`'s random draws at `iteration` for run seed `seed`."""
    if stage not in _STAGE_SEEDS:
        raise ValueError(f"no seed for stage {stage!r}; expected one of {list(_STAGE_SEEDS)}")
    return _STAGE_SEEDS[stage](seed, iteration)


def mix_seed(*parts: int) -> int:
    """One 63-bit seed from integers (FNV-1a over 64-bit words): e.g. (run seed, episode, turn)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (p & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF
