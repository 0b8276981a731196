"""The credit methods, one module each, registered by name (`pipeline.credit.base.Method`).

Every module of this package is a method and is imported here, so that adding a method means adding one module
(and its tests): the params schema, the stage registry, the fit stage and the benchmarks read the registry
(docs/architecture.md). A method's shared terms are in `pipeline.credit.base`.
"""

from __future__ import annotations

import importlib
import pkgutil

import polars as pl

from pipeline.credit.base import EpisodeConfig, Method, compute, registered
from pipeline.data import tables

for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")

METHODS: dict[str, Method] = registered()


def get(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"credit.method: unknown method {name!r}; expected one of {list(METHODS)}")
    return METHODS[name]


def compute_advantages(steps, credit):
    """Advantages of `credit.method` (a validated `credit` section) on `steps`, sorted by (episode_id, step)."""
    method = get(credit.method)
    return compute(method, steps, getattr(credit, method.name), credit.episode, credit.invalid_penalty)


def method_depth(method: Method, cfg, history_turns: int) -> int | None:
    """How deep `method` reads history groups under its section `cfg` (`Method.history_depth`); None: not at all."""
    d = method.history_depth
    if isinstance(d, str):
        return getattr(cfg, d) or history_turns + 1
    return d


def history_depth(credit, history_turns: int) -> int:
    """How many anchors deep the group stage keys `history_groups`: the deepest any registered method reads under
    these params, at least K + 1 for K = `prompt.history_turns`. Every method counts, not only the chosen one, so
    that the group stage's output does not depend on the method (docs/architecture.md)."""
    asked = [method_depth(m, getattr(credit, m.name), history_turns) for m in METHODS.values()
             if m.history_depth is not None]
    return max([history_turns + 1, *asked])


def history_params() -> list[str]:
    """The params keys that decide `history_depth` (the group stage's params)."""
    return [f"credit.{m.name}.{m.history_depth}" for m in METHODS.values() if isinstance(m.history_depth, str)]


def own_history(table, credit, history_turns: int, where: str):
    """`table` (turns joined with their groups) with `history_groups` cut to the depth the chosen method asks for;
    a clear error when the group table was written under other params (its depth is not the group stage's)."""
    method = get(credit.method)
    if method.history_depth is None or table.height == 0:
        return table
    have, want = table["history_groups"].list.len().min(), history_depth(credit, history_turns)
    if have != want:
        raise ValueError(f"{where}: history_groups hold {have} depths, these params ask for {want} "
                         f"(credit.{method.name}); rerun the group stage")
    own = method_depth(method, getattr(credit, method.name), history_turns)
    return table if own == want else table.with_columns(pl.col("history_groups").list.head(own))


def credit_table(params, steps_path, groups_path, rewards_path) -> pl.DataFrame:
    """An iteration's turns joined with their step groups (history cut to the chosen method's depth) and, for a
    method with a learned per-turn score, the fit stage's scores: what the advantages and the preference pairs
    are computed from. Each table is checked to hold the step table's turns."""
    steps = tables.read_table(steps_path, tables.STEPS).drop("task_group")
    groups = tables.read_table(groups_path, tables.GROUPS)
    tables.check_same_turns(steps, steps_path, groups, groups_path, "group")
    table = steps.join(groups, on=["episode_id", "step"], how="inner", validate="1:1")
    table = own_history(table, params.credit, params.prompt.history_turns, str(groups_path))
    if params.credit.needs_fit:
        rewards = tables.read_table(rewards_path, tables.STEP_REWARDS)
        tables.check_same_turns(steps, steps_path, rewards, rewards_path, "fit")
        table = table.join(rewards, on=["episode_id", "step"], how="inner", validate="1:1")
    return table


__all__ = [
    "METHODS",
    "EpisodeConfig",
    "Method",
    "compute_advantages",
    "credit_table",
    "get",
    "history_depth",
    "history_params",
    "own_history",
]
