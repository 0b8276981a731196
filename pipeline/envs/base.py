"""The environment interface every stage talks to, and the environment registry.

An environment is one module in `pipeline/envs/`, or a package there whose `env` module does it, that calls
`register(EnvSpec(...))` with its name, its params section (`env.<field>`, chosen by `env.name`) and a factory.
The environment itself:

- `reset(task)` starts the task with that seed and returns an `Observation`: the text the policy sees, the anchor
  (the environment's own key of the state, docs/credit-assignment.md, Terms), and the commands admissible now;
- `task_description()` is the current task's text (the goal);
- `step(response_text)` parses the policy's response, executes it and returns a `StepResult`. A response whose
  action is not one of the admissible commands (matched exactly, case preserved) is a no-op with
  `action_valid = False`. The result carries the next observation and its admissible commands.

Optional capabilities, present as methods where the environment has them (`has`, `require`):
- `oracle_distance()`: the exact optimal number of steps to success from the current state (inf when the task
  can no longer be solved), for the credit-quality oracle;
- `expert_actions()`: the admissible commands that start an optimal continuation, for the warm start's
  demonstrations;
- `task_score()`: a score of the episode so far in [0, 1] (partial credit), SPA's R_final where it exists;
- `task_labels(task)`: a few labels of a task (the search environment's question type and hops, the SQL
  environment's hardness and database) that reports split held-out results by (`bench.task_stats`);
- `task_brief()` / `task_context()`: the task in a line, for a demonstration of it in another task's prompt, and
  the leading part of `task_description()` that tasks share (a database's schema), which retrieved demonstrations
  follow (`pipeline.rollout.demonstrations`);
- `gold_answer()`: the response that answers the current task correctly, as `(prefix, answer, suffix)` with the
  answer's text in the middle (`("<answer>", "Paris", "</answer>")`), whose probability under the policy IGPO
  scores after each turn (`pipeline.credit.methods.igpo`);
- `snapshot()` / `restore(state)`: an opaque copy of the current state, and putting a freshly made environment in
  that state (task included), for branching rollouts; without them a branch replays its parent's responses from
  `reset(task)` (`pipeline.rollout.branching`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

CAPABILITIES = {
    "oracle_distance": "an exact distance to the goal (the credit-quality oracle)",
    "expert_actions": "an expert that names optimal actions (the warm start's demonstrations)",
    "task_score": "a task score in [0, 1]",
    "snapshot": "a copy of its state that restore() puts a new environment in (branching without replay)",
    "task_labels": "labels of a task (a question's type, its hardness) that reports split results by",
    "gold_answer": "the current task's gold answer as a response (IGPO's information gain)",
}


@dataclass(frozen=True)
class Observation:
    text: str                     # what the policy sees of the state
    anchor: str                   # the environment's key of the state (no history, no task, no command list)
    admissible: tuple[str, ...]   # the commands valid now


@dataclass(frozen=True)
class StepResult:
    observation: str
    anchor: str
    reward: float
    terminated: bool
    truncated: bool
    action_valid: bool
    success: bool
    action: str | None            # the admissible command executed, None when the response named none
    admissible: tuple[str, ...] = ()   # the commands valid in the new state


class Env(Protocol):
    name: str

    def reset(self, task: int) -> Observation: ...

    def task_description(self) -> str: ...

    def step(self, response_text: str) -> StepResult: ...


@dataclass(frozen=True)
class EnvSpec:
    name: str
    config: type                       # pydantic section with `name: Literal[<name>]` and `max_turns`
    make: Callable[..., Env]           # make(config, cache_dir) -> Env
    # characters the tiny model's tokenizer keeps as single tokens (a grid's cells), or None
    isolate: str | None = None
    # words(config) -> strings the tiny model's tokenizer adds whole (ids a small model must copy from its prompt:
    # one token is copied by one attention lookup, a string of BPE pieces needs a learned copy circuit), or None
    words: Callable[[Any], list[str]] | None = None
    # tool_call(action) -> whether an executed action calls a tool (a search engine, a database): the rollout counts
    # them, sampled and shared apart (rollout.branching); None where the environment has no tools
    tool_call: Callable[[str], bool] | None = None
    # modules the environment's engine needs, and the packages that install them (for the error when one is missing)
    requires: tuple[str, ...] = ()
    packages: str = ""
    # lacks(config, capability) -> why an environment made from this config will lack an optional capability that
    # its class may have (a user's data without what the capability needs), or None; read when the params load
    lacks: Callable[[Any, str], str | None] | None = None
    # held_out(config) -> how many distinct held-out tasks the environment's data has, where it is a fixed list
    # (questions, problems): evaluate.tasks beyond it would play some twice under two task ids; None: unbounded
    held_out: Callable[[Any], int] | None = None

    def env_class(self) -> type:
        """The class `make` returns: `make` itself where it is one, else its return annotation."""
        if isinstance(self.make, type):
            return self.make
        return typing.get_type_hints(self.make)["return"]

    def offers(self, capability: str) -> bool:
        """Whether the environment's class has the optional capability (`CAPABILITIES`), known without making
        one: for the checks when params load."""
        return callable(getattr(self.env_class(), capability, None))

    def lacking(self, capabilities) -> list[str]:
        """Those of `capabilities` the environment's class does not have (`offers`)."""
        return [c for c in capabilities if not self.offers(c)]

    def missing(self, by_import: bool = False) -> list[str]:
        """The modules of `requires` this Python cannot find (`importlib.util.find_spec`: nothing imported, for the
        params check), or, `by_import`, cannot import (a broken install too, when an environment is made)."""
        if not by_import:
            return [m for m in self.requires if importlib.util.find_spec(m) is None]
        absent = []
        for m in self.requires:
            try:
                importlib.import_module(m)
            except ImportError:
                absent.append(m)
        return absent

    def needs(self, absent: list[str]) -> str:
        return f"{self.name} needs {self.packages or ', '.join(absent)}, and {', '.join(absent)} cannot be imported"


CACHE_DIR = "results/envs"   # files environments generate (games), shared by the stages of a run


def user_cache(*parts: str) -> Path:
    """A folder of the user's cache for what is derived from data files alone and keyed by their hashes (the BM25
    index of a corpus, the check of a dataset's gold queries): `$CREDITRL_CACHE`, else `$XDG_CACHE_HOME/creditrl`,
    else `~/.cache/creditrl` (docs/environments.md). Safe to delete; whatever is missing is built again."""
    root = os.environ.get("CREDITRL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "creditrl")
    return Path(root).expanduser().joinpath(*parts)


_REGISTRY: dict[str, EnvSpec] = {}


def register(spec: EnvSpec) -> EnvSpec:
    """Add an environment; a name registered by another module is an error (the same module imported again is
    not)."""
    known = _REGISTRY.get(spec.name)
    if known is not None and known.make.__module__ != spec.make.__module__:
        raise ValueError(f"environment {spec.name!r} is registered twice: by {known.make.__module__} and by "
                         f"{spec.make.__module__}")
    _REGISTRY[spec.name] = spec
    return spec


_DISCOVERED = False


def registered() -> dict[str, EnvSpec]:
    """Every environment's spec. An environment is a module `pipeline/envs/<name>.py` or a package
    `pipeline/envs/<name>/` whose `env` module registers it; discovery imports those and nothing else of a package
    (its data generator, index or oracle load when the environment uses them). Imported once (a module imported
    directly before does not stop the others from being found)."""
    global _DISCOVERED
    if not _DISCOVERED:
        for m in pkgutil.iter_modules([str(Path(__file__).parent)]):
            if m.ispkg and importlib.util.find_spec(f"pipeline.envs.{m.name}.env") is None:
                raise ValueError(f"pipeline/envs/{m.name}/: an environment package needs an env module that "
                                 f"registers it (pipeline/envs/{m.name}/env.py)")
            importlib.import_module(f"pipeline.envs.{m.name}" + (".env" if m.ispkg else ""))
        _DISCOVERED = True
    return dict(_REGISTRY)


def spec_of(cfg) -> EnvSpec:
    specs = registered()
    if cfg.name not in specs:
        raise ValueError(f"env.name: unknown environment {cfg.name!r}; expected one of {sorted(specs)}")
    return specs[cfg.name]


def data_root(data_path: str | None, shipped: Path) -> Path:
    """An environment's `data_path` with `$VARS` and `~` expanded, or the data the project ships when it is null."""
    return Path(os.path.expandvars(data_path)).expanduser() if data_path else shipped


def data_error(path: Path, what: str) -> ValueError:
    """An error in an environment's data files: names `env.data_path`, the file and what is wrong."""
    return ValueError(f"env.data_path: {path}: {what}")


def first_file(folder: Path, names) -> Path | None:
    """The first of `names` that is a file in `folder`, or None."""
    return next((folder / n for n in names if (folder / n).is_file()), None)


def make_env(cfg, cache_dir: str | Path = CACHE_DIR) -> Env:
    """The environment named by `cfg.name` (an `env` section); `cache_dir` holds files it generates (games)."""
    spec = spec_of(cfg)
    absent = spec.missing(by_import=True)
    if absent:
        raise ValueError(f"env.name {spec.needs(absent)}: install the project as the README says (README, The two "
                         "commands)")
    return spec.make(cfg, Path(cache_dir))


def has(env: Env, capability: str) -> bool:
    return callable(getattr(env, capability, None))


def require(env: Env, capability: str, who: str) -> None:
    """A clear error when `who` needs a capability the environment lacks."""
    if capability not in CAPABILITIES:
        raise ValueError(f"unknown capability {capability!r}")
    if not has(env, capability):
        raise ValueError(f"{who} needs {CAPABILITIES[capability]}, which environment {env.name!r} does not "
                         f"provide ({capability})")
