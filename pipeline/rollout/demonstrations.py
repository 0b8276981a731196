"""Retrieved demonstrations (LearNAT's adaptive demonstrations), for any environment with an expert:
`prompt.demonstrations: k` puts the expert episodes of the k training tasks most similar to the current task into
its prompt (docs/environments.md, "Demonstrations in the prompt").

The pool is `prompt.demonstration_pool` expert episodes on warm-start tasks (`pipeline.data.seeds`: the warm
start's stream, never a training rollout's or a held-out task), played once per run and kept in the run's
environment cache (`results/envs/demonstrations-<hash>.json`, the hash of the environment's params, the seed and
the pool size); the later stages read it. Similarity is BM25 (`pipeline.envs.search.index`) between the current
task's text and each pool task's text; a pool task with the same text as the current one is never shown (in
training it would show the answer). A demonstration is the task's short text (`task_brief()` where the environment
has it, else its description) and each expert action with the observation it led to. The demonstrations open the
task text, or follow the part of it that tasks share where the environment says which (`task_context()`: the SQL
environment's database and schema), so that the prompts of one database still share that prefix in a packed tree
and in the engine's prefix cache.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pipeline.data.seeds import task_seed
from pipeline.data.tables import write_text_atomic
from pipeline.envs.base import CACHE_DIR, Env, has, make_env, require
from pipeline.envs.search.index import Retriever

OBSERVATION_CHARS = 300     # a demonstration's observation is cut at this many characters


def brief(env: Env) -> str:
    return env.task_brief() if has(env, "task_brief") else env.task_description()


def expert_episode(env: Env, task: int, max_turns: int) -> tuple[str, str]:
    """(the task's full text, the demonstration) of the expert's episode on `task`."""
    env.reset(task)
    full = env.task_description()
    lines = [f"Task: {brief(env)}"]
    for turn in range(1, max_turns + 1):
        actions = env.expert_actions()
        if not actions:
            break
        res = env.step(actions[0])
        observation = res.observation if len(res.observation) <= OBSERVATION_CHARS else \
            res.observation[:OBSERVATION_CHARS - 3] + "..."
        lines.append(f"Action {turn}: {res.action}\nResult {turn}: {observation}")
        if res.terminated or res.truncated:
            break
    return full, "\n".join(lines)


def _pool_file(params, cache_dir: Path) -> Path:
    key = json.dumps([params.env.model_dump(mode="json"), params.seed, params.prompt.demonstration_pool],
                     sort_keys=True)
    return Path(cache_dir) / f"demonstrations-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def build_pool(params, cache_dir: Path = Path(CACHE_DIR)) -> list[tuple[str, str]]:
    """The run's pool of expert episodes, played once and then read from the cache."""
    path = _pool_file(params, cache_dir)
    if path.is_file():
        return [tuple(x) for x in json.loads(path.read_text())]
    env = make_env(params.env, cache_dir)
    require(env, "expert_actions", "prompt.demonstrations")
    pool = [expert_episode(env, task_seed("warmstart", params.seed, 0, j), params.env.max_turns)
            for j in range(params.prompt.demonstration_pool)]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(pool))
    return pool


class Demonstrations:
    """The pool and its BM25 index over the tasks' full texts."""

    def __init__(self, pool: list[tuple[str, str]], k: int, cache_dir: Path):
        self.pool, self.k = pool, k
        self.index = Retriever.cached([full for full, _ in pool], cache_dir)

    def for_task(self, text: str) -> list[str]:
        rows = self.index.search(text, self.k + 4)
        return [self.pool[r][1] for r in rows if self.pool[r][0] != text][:self.k]


_LOADED: dict[tuple[str, int], Demonstrations] = {}     # per process: every episode's environment shares one


class WithDemonstrations:
    """An environment whose task text shows the demonstrations of the most similar pool tasks first, or right after
    the environment's `task_context()` where it has one (the SQL environment's schema); everything
    else (steps, anchors, the oracle, the expert, snapshots) is the wrapped environment's."""

    def __init__(self, env: Env, demos: Demonstrations):
        self._env, self._demos, self._text = env, demos, None

    def __getattr__(self, name):
        return getattr(self._env, name)

    def reset(self, task: int):
        self._text = None
        return self._env.reset(task)

    def restore(self, state) -> None:
        self._text = None
        self._env.restore(state)

    def task_description(self) -> str:
        if self._text is None:
            own = self._env.task_description()
            shown = self._demos.for_task(own)
            examples = "".join(f"Example {i}:\n{d}\n\n" for i, d in enumerate(shown, 1))
            context = self._env.task_context() if has(self._env, "task_context") else ""
            if not own.startswith(context):
                raise ValueError(f"environment {self._env.name!r}: task_context() is not the start of "
                                 "task_description()")
            self._text = context + (f"Solved examples of similar tasks:\n\n{examples}" if shown else "") + \
                own[len(context):]
        return self._text


def environment(params, cache_dir: Path = Path(CACHE_DIR)) -> Env:
    """The environment of `params`, with `prompt.demonstrations` retrieved ones in its task text."""
    env = make_env(params.env, cache_dir)
    k = params.prompt.demonstrations
    if k == 0:
        return env
    key = (str(_pool_file(params, cache_dir).resolve()), k)
    if key not in _LOADED:
        _LOADED[key] = Demonstrations(build_pool(params, cache_dir), k, cache_dir)
    return WithDemonstrations(env, _LOADED[key])
