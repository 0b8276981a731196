"""Play episodes with a policy: batched generation across every live episode, one row per turn.

All episodes of a call advance together turn by turn. The episodes are cut into fixed blocks of `batch_size` (in the
order given); each turn, the live episodes of a block are generated as one batch. Every response is sampled with its
own seed, from (seed, episode, turn), and a block's batch holds the same episodes whichever other blocks run beside
it, so a shard (`pipeline.rollout.shards`: whole blocks) writes exactly the rows the unsharded call writes for those
episodes, bit for bit on CPU. With `rollout.branching` the episodes of a task form a tree instead
(`pipeline.rollout.branching`); a block is then whole tasks, so a shard is still whole blocks.

An exception in one episode's `env.step` ends that episode there: its last row is truncated, not executed
(`action_valid` false, reward 0) and carries the error text in `env_error`; the other episodes go on.
`check_env_errors` counts them and fails the stage above `faults.max_env_error_share`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import polars as pl

from pipeline.data.seeds import mix_seed
from pipeline.envs.actions import format_of
from pipeline.envs.base import Env, Observation, StepResult, has, spec_of
from pipeline.model.engines import HFSampler, VLLMSampler
from pipeline.model.policy import EntropySpec, encode_prompt
from pipeline.rollout.branching import branch_draw, check_replay, copies_to_branch
from pipeline.rollout.demonstrations import environment
from pipeline.rollout.prompts import build_prompt


@dataclass(frozen=True)
class EpisodeSpec:
    task_id: int       # environment seed
    task_group: int
    episode_id: int


@dataclass(eq=False)
class _Path:
    """One episode being played: its environment, what the policy sees next, and its rows so far."""
    index: int                      # its spec's index: the order of its block's batch
    spec: EpisodeSpec
    env: Env
    obs: Observation
    history: list[tuple[str, str | None]] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    parent: int | None = None       # branching: the parent's episode id and the first turn sampled here
    branch_turn: int | None = None
    uniform_turn: int | None = None  # mode uniform: it branches at the first branch point from this turn on

    @property
    def h_init(self) -> float | None:
        """ARPO's H_init: the entropy of the path's first turn (a branch's is its parent's, which it shares)."""
        return self.rows[0]["entropy"]

    @property
    def turn(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class Branching:
    """`rollout.branching` as the player uses it (pipeline.rollout.branching)."""
    mode: str            # entropy | uniform
    horizon: int         # the environment's max_turns: uniform branch turns are drawn below it
    group_size: int      # M
    initial: int         # N
    beam: int
    threshold: float
    entropy_weight: float
    entropy: EntropySpec | None   # what the sampler computes (None: uniform mode needs none)
    tool_call: Callable[[str], bool] | None = None   # the environment's tool calls: branch points follow them


def play_episodes(model, tokenizer, make_env: Callable[[], Env], specs: list[EpisodeSpec], *, history_turns: int,
                  max_new_tokens: int, temperature: float, batch_size: int, seed: int,
                  progress: Callable[[str], None] | None = None, branching: Branching | None = None
                  ) -> pl.DataFrame:
    """Run every episode of `specs` to its end; returns the step rows (schema `tables.STEPS` less `iteration`).
    `model` is a Hugging Face model or a sampler of `pipeline.model.engines`.

    With `branching`, `specs` are whole tasks of `branching.group_size` consecutive episodes: the first `initial`
    of each start at once and the others are branches or later trajectories (`pipeline.rollout.branching`); a block
    is then `batch_size // group_size` whole tasks (at least one), whose live paths are sampled as one batch."""
    sample = model if isinstance(model, (HFSampler, VLLMSampler)) else HFSampler(model, tokenizer)
    probe = make_env() if specs else None
    fmt = format_of(probe) if specs else None
    if branching is None:
        pending: list[list[int]] = []
        block_of = [i // batch_size for i in range(len(specs))]
        starts = list(range(len(specs)))
    else:
        m = branching.group_size
        if len(specs) % m:
            raise ValueError(f"branching: {len(specs)} episodes are not whole tasks of {m}")
        per_block = max(1, batch_size // m)
        block_of = [(i // m) // per_block for i in range(len(specs))]
        starts = [i for i in range(len(specs)) if i % m < branching.initial]
        pending = [list(range(t + branching.initial, t + m)) for t in range(0, len(specs), m)]
    entropy = branching.entropy if branching is not None else None
    paths: list[_Path] = []
    for k, i in enumerate(starts):
        env = probe if k == 0 else make_env()
        paths.append(_start(branching, _Path(i, specs[i], env, env.reset(specs[i].task_id)), seed))
    live = list(paths)
    rounds, turns = 0, 0
    started = time.perf_counter()
    while live:
        live.sort(key=lambda q: q.index)
        prompts = [build_prompt(q.env.task_description(), q.history, q.obs.text, q.obs.admissible, history_turns,
                                fmt) for q in live]
        prompt_ids = [encode_prompt(tokenizer, p) for p in prompts]
        seeds = [mix_seed(seed, q.spec.episode_id, q.turn) for q in live]
        gens = []
        for block in sorted(set(block_of[q.index] for q in live)):   # live is in spec order: a block is a run
            rows_of = [k for k, q in enumerate(live) if block_of[q.index] == block]
            sl = slice(rows_of[0], rows_of[-1] + 1)
            gens.extend(sample(prompt_ids[sl], max_new_tokens, temperature, seed=seeds[sl], entropy=entropy))
        # branches start in the state each path has just sampled in, before its turn is executed (ARPO's timing)
        born = _branch(branching, specs, pending, live, gens, make_env, seed) if branching is not None else []
        still = []
        for k, q in enumerate(live):
            g = gens[k]
            try:
                res, error = q.env.step(g.text), None
            except Exception as e:  # noqa: BLE001 - one broken episode must not stop the rollout
                res, error = _failed_step(q.obs), f"{type(e).__name__}: {e}"[:500]
            q.rows.append({
                "task_id": q.spec.task_id, "task_group": q.spec.task_group, "episode_id": q.spec.episode_id,
                "step": q.turn, "observation": q.obs.text, "anchor": q.obs.anchor, "prompt": prompts[k],
                "prompt_ids": prompt_ids[k], "response_ids": g.response_ids, "response_logprobs": g.logprobs,
                "response": g.text, "action": res.action, "action_valid": res.action_valid,
                "reward": res.reward, "terminated": res.terminated, "truncated": res.truncated,
                "success": res.success, "env_error": error, "entropy": g.entropy,
                "parent_episode": q.parent, "branch_turn": q.branch_turn, "shared": False,
            })
            q.history.append((q.obs.text, res.action))
            q.obs = Observation(res.observation, res.anchor, res.admissible)
            if not (res.terminated or res.truncated):
                still.append(q)
            turns += 1
        rounds += 1
        if branching is not None:
            born += _restart(branching, specs, pending, still + born, make_env, seed)
            paths.extend(born)
            still.extend(born)
        if progress is not None:
            done = len(paths) - len(still)
            rate = turns / max(time.perf_counter() - started, 1e-9)
            progress(f"turn {rounds}: {done}/{len(specs)} episodes done, {turns} turns, {rate:.1f} turns/s")
        live = still
    rows = [r for q in paths for r in q.rows]
    return finish_episodes(pl.DataFrame(rows, schema_overrides=_OVERRIDES))


_OVERRIDES = {"action": pl.String, "env_error": pl.String, "entropy": pl.Float64, "parent_episode": pl.Int64,
              "branch_turn": pl.Int32, "shared": pl.Boolean}


def branch_point(q: _Path, tool_call: Callable[[str], bool] | None) -> bool:
    """Whether `q`'s current state is a branch point: reached by a valid turn that changed the state and, where the
    environment names its tool calls, called a tool (ARPO branches after tool results only); not the state a
    branch was started in, which its parent's copies already explore."""
    if not q.rows or (q.branch_turn is not None and q.turn <= q.branch_turn):
        return False
    last = q.rows[-1]
    return bool(last["action_valid"]) and last["anchor"] != q.obs.anchor and (
        tool_call is None or (last["action"] is not None and tool_call(last["action"])))


def _branch(b: Branching, specs: list[EpisodeSpec], pending: list[list[int]], live: list[_Path], gens: list,
            make_env, seed: int) -> list[_Path]:
    """The branches a round starts (pipeline.rollout.branching), in spec order, while a task has episodes left: a
    live path in a branch point s(t) hands copies of s(t) whose number ARPO's rule draws from the entropy of the
    response it has just sampled there, `gens[k]` for `live[k]` (mode entropy); or, mode uniform, `beam - 1` at the
    first branch point at or after its drawn turn. Each copy samples turn t afresh next round."""
    born = []
    for t, slots in enumerate(pending):
        if not slots:
            continue
        for k, q in enumerate(live):
            if q.index // b.group_size != t or not branch_point(q, b.tool_call):
                continue
            n = min(b.beam - 1, len(slots))
            if n <= 0:
                break
            if b.mode == "uniform":
                copies = n if q.uniform_turn is not None and q.turn >= q.uniform_turn else 0
                if copies:
                    q.uniform_turn = None
            else:
                h = gens[k].entropy
                if h is None or q.h_init is None:
                    raise ValueError("rollout.branching.mode entropy: the sampler returned no entropy")
                draws = [branch_draw(seed, q.spec.episode_id, q.turn, c) for c in range(n)]
                copies = copies_to_branch(draws, h - q.h_init, b.entropy_weight, b.threshold)
            for _ in range(copies):
                born.append(_start(b, _fork(q, slots.pop(0), specs, make_env), seed))
    return born


def _restart(b: Branching, specs: list[EpisodeSpec], pending: list[list[int]], going: list[_Path], make_env,
             seed: int) -> list[_Path]:
    """One more global trajectory for each task that has episodes left and no path going."""
    born = []
    for t, slots in enumerate(pending):
        if slots and not any(q.index // b.group_size == t for q in going):
            i = slots.pop(0)
            env = make_env()
            born.append(_start(b, _Path(i, specs[i], env, env.reset(specs[i].task_id)), seed))
    return born


def _start(b: Branching | None, q: _Path, seed: int) -> _Path:
    """Mode uniform: the state in which a new path branches, drawn uniformly among the states after its own turns
    up to the environment's last turn (turns first + 1 .. horizon - 1, first its first sampled turn)."""
    if b is not None and b.mode == "uniform":
        first = q.turn
        if first < b.horizon - 1:
            q.uniform_turn = first + 1 + int(branch_draw(seed, q.spec.episode_id, -1, 0) * (b.horizon - 1 - first))
    return q


def _fork(q: _Path, i: int, specs: list[EpisodeSpec], make_env) -> _Path:
    """A new episode (spec `i`) in `q`'s state: `q`'s turns so far copied as shared rows, its environment restored
    by snapshot or by a checked replay."""
    spec = specs[i]
    env = make_env()
    if has(env, "snapshot") and has(q.env, "snapshot"):
        env.restore(q.env.snapshot())
    else:
        obs = env.reset(spec.task_id)
        check_replay(env.name, q.spec.episode_id, 0, "observation", (obs.text, obs.anchor),
                     (q.rows[0]["observation"], q.rows[0]["anchor"]))
        for k, row in enumerate(q.rows):
            res = env.step(row["response"])
            nxt = q.rows[k + 1] if k + 1 < len(q.rows) else {"observation": q.obs.text, "anchor": q.obs.anchor}
            check_replay(env.name, q.spec.episode_id, k, "(observation, anchor, reward, action)",
                         (res.observation, res.anchor, res.reward, res.action),
                         (nxt["observation"], nxt["anchor"], row["reward"], row["action"]))
    rows = [r | {"episode_id": spec.episode_id, "parent_episode": q.spec.episode_id, "branch_turn": q.turn,
                 "shared": True} for r in q.rows]
    return _Path(i, spec, env, q.obs, list(q.history), rows, parent=q.spec.episode_id, branch_turn=q.turn)


def _failed_step(obs: Observation) -> StepResult:
    """The row of a turn whose `env.step` raised: not executed, no reward, the episode truncated here."""
    return StepResult(observation=obs.text, anchor=obs.anchor, reward=0.0, terminated=False, truncated=True,
                      action_valid=False, success=False, action=None, admissible=obs.admissible)


class EnvFailureError(ValueError):
    pass


def check_env_errors(steps: pl.DataFrame, max_share: float, where: str) -> dict[str, float]:
    """Count episodes whose environment raised (`env_error` set); fail above `max_share` of all episodes.

    Returns the metrics to report; raises `EnvFailureError` naming the share, the limit and the first error.
    """
    episodes = steps["episode_id"].n_unique()
    failed = steps.filter(pl.col("env_error").is_not_null())
    n = failed["episode_id"].n_unique()
    share = n / episodes if episodes else 0.0
    if share > max_share:
        first = failed.row(0, named=True)
        raise EnvFailureError(
            f"{where}: the environment raised in {n} of {episodes} episodes ({share:.1%}), above "
            f"faults.max_env_error_share = {max_share}; first in episode {first['episode_id']} (task "
            f"{first['task_id']}, turn {first['step']}): {first['env_error']}")
    return {"env_error_episodes": float(n), "env_error_share": share}


def play_with_params(params, model, tokenizer, specs: list[EpisodeSpec], *, temperature: float, seed: int,
                     progress: Callable[[str], None] | None = None, branch: bool = False) -> pl.DataFrame:
    """`play_episodes` with the environment, prompt and generation settings of a `Params`; `branch`: with its
    `rollout.branching` (the training rollout; held-out episodes never branch)."""
    return play_episodes(model, tokenizer, lambda: environment(params), specs,
                         history_turns=params.prompt.history_turns, max_new_tokens=params.policy.max_new_tokens,
                         temperature=temperature, batch_size=params.rollout.batch_size, seed=seed,
                         progress=progress, branching=branching_of(params, tokenizer) if branch else None)


def branching_of(params, tokenizer) -> Branching | None:
    """The player's `Branching` of `rollout.branching`, or None for mode none."""
    r = params.rollout
    b = r.branching
    if b.mode == "none":
        return None
    entropy = EntropySpec(b.entropy_tokens, b.top_logprobs, len(tokenizer)) if b.mode == "entropy" else None
    return Branching(b.mode, params.env.max_turns, r.group_size, b.initial_for(r.group_size), b.beam, b.threshold,
                     b.entropy_weight, entropy, spec_of(params.env).tool_call)


def finish_episodes(steps: pl.DataFrame) -> pl.DataFrame:
    """Add the episode-level columns: return, length and success broadcast to every turn."""
    return steps.with_columns(
        pl.col("reward").sum().over("episode_id").alias("episode_return"),
        pl.len().over("episode_id").cast(pl.Int32).alias("episode_length"),
        pl.col("success").any().over("episode_id").alias("success"),
    ).sort("episode_id", "step")


def episode_summary(steps: pl.DataFrame) -> dict[str, float]:
    """Success rate, mean return, mean length and invalid-action rate of a step table."""
    eps = steps.group_by("episode_id").agg(
        pl.col("success").first(), pl.col("episode_return").first(), pl.col("episode_length").first()
    )
    return {
        "episodes": float(eps.height),
        "success_rate": float(eps["success"].mean()),
        "mean_return": float(eps["episode_return"].mean()),
        "mean_length": float(eps["episode_length"].mean()),
        "invalid_action_rate": float(1.0 - steps["action_valid"].mean()),
        "turns": float(steps.height),
    }
