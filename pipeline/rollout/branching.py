"""Branching rollouts (`rollout.branching`, docs/credit-assignment.md, Branching rollouts): ARPO's entropy-adaptive
tree of a task's episodes, and what the later stages read of it.

A task's budget is `rollout.group_size` (M) episodes. `initial` (N) start as global trajectories from the task's
first state. A state reached by a valid tool call (a turn that changed the state and, where the environment names
its tool calls, called a tool) is a branch point: there the path samples its next turn, and each of up to
`beam - 1` copies of the state goes to a new episode, while the task has episodes left in its budget, when
clip(U_c - beta * dH, 0, 1) <= tau, U_c uniform in [0, 1) from the stage's seed, the path and the turn, dH the
entropy of the response just sampled in that state minus that of the path's first turn (ARPO reads the tokens
generated right after the tool result; a branch shares its parent's first turn). `uniform`, the control, has each
path hand its copies once, at the first branch point from a turn drawn uniformly, whatever the entropy. A task
whose paths have all ended with episodes still to spend starts one more global trajectory each round. So every
task ends with exactly M episodes.

A branch started in its parent's state s(t) holds the parent's turns 0..t-1 as copies (`shared`) and samples its
own turns from `branch_turn` = t on (turn t afresh, in the state where the parent sampled its turn t). The
environment of a branch is restored by the environment's `snapshot()`/`restore()` where it has them, else by
replaying the parent's responses from `reset(task)`, every replayed observation checked against the recorded one
(`ReplayError` on a difference: the environment is not deterministic for a task seed, and branching cannot restore
its states).
"""

from __future__ import annotations

import numpy as np
import polars as pl

from pipeline.data.seeds import mix_seed

BRANCH_STREAM = 0x4252414E   # "BRAN": the branching draws' own stream of the stage seed


class ReplayError(RuntimeError):
    pass


def branch_draw(seed: int, episode_id: int, turn: int, copy: int) -> float:
    """U for copy `copy` of episode `episode_id`'s state after turn `turn`: uniform in [0, 1), from the stage's seed
    alone (a rerun draws the same)."""
    return float(np.random.Generator(np.random.PCG64(mix_seed(seed, BRANCH_STREAM, episode_id, turn, copy))).random())


def copies_to_branch(draws: list[float], delta_h: float, weight: float, threshold: float) -> int:
    """How many of the copies whose draws are `draws` branch: those with clip(U - weight * delta_h, 0, 1) <=
    threshold (ARPO's rule; a copy that does not branch is simply not made)."""
    return sum(1 for u in draws if min(1.0, max(0.0, u - weight * delta_h)) <= threshold)


def check_replay(env_name: str, episode_id: int, turn: int, what: str, got, recorded) -> None:
    if got != recorded:
        raise ReplayError(
            f"env {env_name}: replaying episode {episode_id} to branch from it, turn {turn} gives {what} {got!r}, "
            f"but the rollout recorded {recorded!r}. The environment is not deterministic for a task seed, so "
            "rollout.branching cannot restore its states: set rollout.branching.mode: none")


def origin_keys(steps: pl.DataFrame) -> pl.DataFrame:
    """(episode_id, step) of every turn with the episode where it was sampled (`origin_episode`): itself for a
    sampled turn, for a shared one the ancestor whose sampled turn it copies."""
    eps = steps.select("episode_id", "parent_episode", "branch_turn").unique("episode_id")
    parent = dict(zip(eps["episode_id"].to_list(), eps["parent_episode"].to_list(), strict=True))
    start = dict(zip(eps["episode_id"].to_list(), eps["branch_turn"].to_list(), strict=True))
    origins = []
    for e, s in zip(steps["episode_id"].to_list(), steps["step"].to_list(), strict=True):
        while start[e] is not None and s < start[e]:
            if parent[e] not in parent:
                raise ValueError(f"episode {e} branches from episode {parent[e]}, which is not in the table")
            e = parent[e]
        origins.append(e)
    return steps.select("episode_id", "step").with_columns(pl.Series("origin_episode", origins, dtype=pl.Int64))


def attribute(table: pl.DataFrame, mode: str) -> pl.DataFrame:
    """The turns the update trains, with their advantages, from the joined steps and advantages `table` (columns
    episode_id, step, parent_episode, branch_turn, shared, advantage, ...).

    soft: every row as it is (each copy of a shared turn with its own episode's advantage, ARPO's code); hard: each
    sampled turn once, with the mean advantage of its copies (itself and the rows that copy it), the copies dropped.
    A table without branches is returned as it is either way."""
    if mode == "soft" or not table["shared"].any():
        return table
    keyed = table.join(origin_keys(table), on=["episode_id", "step"], how="left")
    mean = keyed.group_by("origin_episode", "step").agg(pl.col("advantage").mean().alias("_mean"))
    out = keyed.join(mean, on=["origin_episode", "step"], how="left").filter(~pl.col("shared"))
    return out.with_columns(pl.col("_mean").alias("advantage")).drop("_mean", "origin_episode")


def rollout_counts(steps: pl.DataFrame, tool_call=None) -> dict[str, float]:
    """Sampled and shared turns, and tool calls among each where the environment names its tool calls (`tool_call`,
    a predicate on the action), and the branches: the counts a branching rollout's metrics report."""
    shared = steps["shared"]
    out = {"sampled_turns": float((~shared).sum()), "shared_turns": float(shared.sum()),
           "branches": float(steps.filter(pl.col("parent_episode").is_not_null())["episode_id"].n_unique())}
    if tool_call is not None:
        calls = pl.Series([a is not None and tool_call(a) for a in steps["action"].to_list()], dtype=pl.Boolean)
        out |= {"sampled_tool_calls": float((calls & ~shared).sum()),
                "shared_tool_calls": float((calls & shared).sum())}
    return out


def branch_point_groups(steps: pl.DataFrame, groups: pl.DataFrame) -> dict[str, float]:
    """Step-group coverage of a rollout (docs/credit-assignment.md, Branching rollouts): the branch points (a
    branch's first sampled turn and its parent's turn at the same step, taken in the same state) and the share of
    them in one step group; and `step_signal_share`, the share of sampled turns whose step group holds another
    sampled turn (a copy is not a second action)."""
    keyed = steps.select("episode_id", "step", "parent_episode", "branch_turn", "shared").join(
        groups.select("episode_id", "step", "step_group"), on=["episode_id", "step"], how="inner")
    sampled = keyed.filter(~pl.col("shared"))
    per_group = sampled.group_by("step_group").len()
    signal = sampled.join(per_group, on="step_group").select((pl.col("len") >= 2).mean()).item()
    heads = keyed.filter(pl.col("parent_episode").is_not_null() & (pl.col("step") == pl.col("branch_turn")))
    parents = keyed.select(pl.col("episode_id").alias("parent_episode"), "step",
                           pl.col("step_group").alias("parent_group"))
    points = heads.join(parents, on=["parent_episode", "step"], how="left")
    grouped = points.select((pl.col("step_group") == pl.col("parent_group")).fill_null(False)).to_series()
    return {"step_signal_share": float(signal or 0.0), "branch_points": float(points.height),
            "branch_points_grouped": float(grouped.mean()) if points.height else float("nan")}
