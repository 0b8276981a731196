"""Declared tables that stages exchange: their schemas and content rules, atomic writes and checked reads.

Column names follow Minari/TorchRL (`episode_id`, `step`, `reward`, `terminated`, `truncated`) and keep token
columns as verl does (prompt and response ids, the response's per-token log-probs).

A read accepts what other tools write for the declared columns: string, large_string, string_view and
dictionary-encoded strings; list, large_list and list views; integers and floats of another width, and integers
stored as floats (pandas' nullable integers), when every value fits. It casts them to the declared schema; a step
table without the branching columns (`BRANCH_DEFAULTS`) reads as plain rollouts. It then checks the content and
stops at the first problem, with one line naming the file, the column, the first offending turn and what was
expected:
- the table is not empty (where the table requires rows);
- no column holds nulls, except those declared nullable (a step table's `action`, `env_error`, `entropy` and its
  branching columns);
- (episode_id, step) is unique, and the steps of each episode run 0, 1, 2, ... (step tables);
- the reward, log-prob, score and advantage columns hold finite numbers.
`check_same_turns` checks that a table joined to the step table covers exactly its turns.
"""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

KEYS = ("episode_id", "step")


@dataclass(frozen=True)
class Table:
    """A declared table: its schema and the content a read checks."""
    schema: pa.Schema
    keyed: bool = True               # one row per (episode_id, step)
    contiguous: bool = False         # each episode's steps run 0, 1, 2, ... (tables of whole episodes)
    finite: tuple[str, ...] = ()     # numeric or list-of-numeric columns that must be finite and not null
    nullable: tuple[str, ...] = ()   # the columns that may hold nulls; every other must not
    empty_ok: bool = False
    what: str = "turn"               # what one row is, for messages
    defaults: dict | None = None     # columns a read fills with this value where the file has none

    @property
    def names(self) -> list[str]:
        return self.schema.names


STEPS_SCHEMA = pa.schema([
    ("iteration", pa.int32()),
    ("task_id", pa.int64()),          # the environment seed of the task
    ("task_group", pa.int64()),       # episodes of the same task in this iteration (GRPO's uid)
    ("episode_id", pa.int64()),       # unique across the run
    ("step", pa.int32()),             # turn index within the episode, from 0
    ("observation", pa.string()),     # what the policy saw this turn
    ("anchor", pa.string()),          # environment's key of the state the turn was taken in
    ("prompt", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("response_ids", pa.list_(pa.int32())),
    ("response_logprobs", pa.list_(pa.float32())),  # the rollout engine's, kept to report the mismatch
    ("response", pa.string()),
    ("action", pa.string()),          # parsed action; null when invalid
    ("action_valid", pa.bool_()),
    ("reward", pa.float64()),
    ("terminated", pa.bool_()),
    ("truncated", pa.bool_()),
    ("episode_return", pa.float64()),
    ("episode_length", pa.int32()),
    ("success", pa.bool_()),
    ("env_error", pa.string()),       # null unless the environment raised during this episode
    ("entropy", pa.float64()),        # ARPO's entropy of the response's first tokens; null where not computed
    ("parent_episode", pa.int64()),   # a branch's parent episode (rollout.branching); null for a global trajectory
    ("branch_turn", pa.int32()),      # a branch's first sampled turn (the turns before it are its parent's)
    ("shared", pa.bool_()),           # the turn is copied from the parent episode, not sampled in this one
])

# the branching columns, as a table written before them (or by another tool) reads: plain rollouts
BRANCH_DEFAULTS = {"entropy": None, "parent_episode": None, "branch_turn": None, "shared": False}

STEPS = Table(STEPS_SCHEMA, contiguous=True, finite=("reward", "episode_return", "response_logprobs"),
              nullable=("action", "env_error", "entropy", "parent_episode", "branch_turn"),
              defaults=BRANCH_DEFAULTS)

GROUPS_SCHEMA = pa.schema([
    ("episode_id", pa.int64()),
    ("step", pa.int32()),
    ("task_group", pa.int64()),
    ("anchor_hash", pa.uint64()),     # xxh3-64 of the anchor string
    ("step_group", pa.int64()),       # dense id of (task_group, anchor)
    ("step_group_size", pa.int32()),
    ("history_groups", pa.list_(pa.int64())),  # HGPO: id of (task_group, last k anchors) for k = 1..depth
])

GROUPS = Table(GROUPS_SCHEMA)

STEP_REWARDS_SCHEMA = pa.schema([     # the fit stage's learned per-turn scores (OPRL's r_φ, SPA's c_t, GAE's V(s_t))
    ("episode_id", pa.int64()),
    ("step", pa.int32()),
    ("score", pa.float64()),          # OPRL: r_phi(t) (beta included); SPA: contribution c_t; GAE: V(s_t)
])

STEP_REWARDS = Table(STEP_REWARDS_SCHEMA, finite=("score",))

ADVANTAGES_SCHEMA = pa.schema([
    ("episode_id", pa.int64()),
    ("step", pa.int32()),
    ("episode_advantage", pa.float64()),  # A^E: the method's episode term (the shared one for all but RLOO)
    ("step_score", pa.float64()),         # the value the step level normalises (G_t, r_phi, G^SPA); null if none
    ("step_advantage", pa.float64()),     # weighted step-level term
    ("penalty", pa.float64()),            # credit.invalid_penalty on an invalid turn, else 0
    ("advantage", pa.float64()),          # episode_advantage + step_advantage - penalty
])

ADVANTAGES = Table(ADVANTAGES_SCHEMA, finite=("episode_advantage", "step_advantage", "penalty", "advantage"),
                   nullable=("step_score",))

PAIRS_SCHEMA = pa.schema([           # update.objective step_dpo: two turns of one state, the better one chosen
    ("task_group", pa.int64()),
    ("step_group", pa.int64()),       # the state (the group stage's id of task group and anchor)
    ("chosen_episode", pa.int64()),
    ("chosen_step", pa.int32()),
    ("rejected_episode", pa.int64()),
    ("rejected_step", pa.int32()),
    ("chosen_value", pa.float64()),   # the credit method's step value v of each turn
    ("rejected_value", pa.float64()),
    ("gap", pa.float64()),            # chosen_value - rejected_value (> update.step_dpo.min_gap)
    ("chosen_reward", pa.float64()),  # the rewards r the margin reads: the values, or the oracle's similarities
    ("rejected_reward", pa.float64()),
    ("margin", pa.float64()),         # the DPO margin m
])

PAIRS = Table(PAIRS_SCHEMA, keyed=False, empty_ok=True, what="pair",
              finite=("chosen_value", "rejected_value", "gap", "chosen_reward", "rejected_reward", "margin"))

EVAL_EPISODES_SCHEMA = pa.schema([
    ("iteration", pa.int32()),
    ("task_id", pa.int64()),
    ("episode_return", pa.float64()),
    ("episode_length", pa.int32()),
    ("success", pa.bool_()),
    ("invalid_turns", pa.int32()),
    ("optimal_moves", pa.int32()),    # the oracle's optimal number of steps from the start; null without one
])
EVAL_EPISODES = Table(EVAL_EPISODES_SCHEMA, keyed=False, finite=("episode_return",), nullable=("optimal_moves",),
                      what="episode")


class TableError(ValueError):
    """A table on disk is missing, unreadable or does not match its declared schema."""


def _tmp_name(path: Path, clean: bool = True) -> Path:
    """A fresh temporary name beside `path`; first removes the ones a killed writer of `path` left behind."""
    for stale in path.parent.glob(f".{path.name}.tmp-*") if clean and path.parent.is_dir() else ():
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
    return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")


def _schema(table: Table | pa.Schema) -> pa.Schema:
    return table.schema if isinstance(table, Table) else table


def with_defaults(arrow: pa.Table, table: Table | pa.Schema) -> pa.Table:
    """`arrow` with each column of `table.defaults` it lacks, filled with the default (what a read and a write both
    do for a table written before those columns)."""
    if not isinstance(table, Table) or not table.defaults:
        return arrow
    for name, value in table.defaults.items():
        if name not in arrow.schema.names:
            arrow = arrow.append_column(name, pa.array([value] * arrow.num_rows, table.schema.field(name).type))
    return arrow


def write_table(df: pl.DataFrame, path: str | Path, table: Table | pa.Schema) -> None:
    """Write `df` with exactly the declared columns and types, to a temporary name and then rename. A column with a
    declared default (`Table.defaults`) that the frame lacks is written with that value."""
    path = Path(path)
    schema = _schema(table)
    arrow = with_defaults(df.to_arrow(), table)
    missing = [n for n in schema.names if n not in arrow.schema.names]
    if missing:
        raise TableError(f"{path}: cannot write, columns {missing} are missing from the frame")
    arrow = arrow.select(schema.names).cast(schema)
    with atomic_file(path) as tmp:
        pq.write_table(arrow, tmp)


def empty_table(table: Table | pa.Schema) -> pl.DataFrame:
    """A frame with the declared columns and no rows."""
    return pl.from_arrow(_schema(table).empty_table())


_STRINGS = (pa.types.is_string, pa.types.is_large_string, getattr(pa.types, "is_string_view", lambda t: False))
_LISTS = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list,
          getattr(pa.types, "is_list_view", lambda t: False), getattr(pa.types, "is_large_list_view", lambda t: False))


def equivalent(got: pa.DataType, want: pa.DataType) -> bool:
    """Whether a column of type `got` holds what the declared `want` holds (string and list variants,
    dictionary-encoded values, integers or floats of another width, integers stored as floats); the cast then checks
    each value fits."""
    if got == want:
        return True
    if pa.types.is_dictionary(got):
        return equivalent(got.value_type, want)
    if pa.types.is_null(got):   # a column of nulls only (pandas writes one as type null): any type holds it
        return True
    if any(f(got) for f in _STRINGS) and any(f(want) for f in _STRINGS):
        return True
    if any(f(got) for f in _LISTS) and any(f(want) for f in _LISTS):
        return equivalent(got.value_type, want.value_type)
    if pa.types.is_integer(got) and pa.types.is_integer(want):
        return True
    if pa.types.is_floating(got) and pa.types.is_integer(want):   # pandas stores a nullable integer as float; the
        return True                                               # safe cast refuses a fraction
    return pa.types.is_floating(got) and pa.types.is_floating(want)


def conform(arrow: pa.Table, schema: pa.Schema, path: Path) -> pa.Table:
    """The declared columns of `arrow`, cast to `schema`; one clear error for a missing or unreadable column."""
    columns = []
    for field in schema:
        if field.name not in arrow.schema.names:
            raise TableError(f"{path}: column '{field.name}' is missing; expected type {field.type}")
        col = arrow.column(field.name)
        if col.type != field.type:
            if not equivalent(col.type, field.type):
                raise TableError(f"{path}: column '{field.name}' has type {col.type}; expected {field.type}")
            try:
                col = col.cast(field.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise TableError(f"{path}: column '{field.name}' of type {col.type} does not fit the declared "
                                 f"{field.type}: {str(e).splitlines()[0]}") from None
        columns.append(col)
    return pa.table(columns, schema=schema)


def _key(df: pl.DataFrame, row: int) -> str:
    return f"episode_id {df['episode_id'][row]}, step {df['step'][row]}"


def check_rows(df: pl.DataFrame, table: Table, path: Path) -> None:
    """The content rules of `table` (module docstring) on a frame already cast to its schema."""
    if df.height == 0:
        if table.empty_ok:
            return
        raise TableError(f"{path}: the table has no rows; expected at least one {table.what}")
    nulls = df.null_count().row(0, named=True)
    for name, count in nulls.items():
        if count and name not in table.nullable and name not in table.finite:
            first = int(df[name].is_null().arg_max())
            where = _key(df, first) if table.keyed and name not in KEYS else f"row {first}"
            raise TableError(f"{path}: column '{name}' is null at {where} (first of {count} such rows); expected a "
                             f"value in every row")
    for name in table.finite:
        col = pl.col(name)
        if isinstance(df.schema[name], pl.List):
            bad = col.list.eval(pl.element().is_null() | ~pl.element().is_finite()).list.any() | col.is_null()
        else:
            bad = col.is_null() | ~col.is_finite()
        rows = df.select(bad.alias("_bad"))["_bad"]
        if rows.any():
            first = int(rows.arg_max())
            value = df[name][first]
            value = value.to_list() if isinstance(value, pl.Series) else value
            where = _key(df, first) if table.keyed else f"row {first}"
            raise TableError(f"{path}: column '{name}' holds {value!r} at {where} (first of {int(rows.sum())} "
                             f"such rows); expected finite numbers")
    if not table.keyed:
        return
    order = df.select(*KEYS).with_row_index("_row").sort(*KEYS)
    ep, step = order["episode_id"].to_numpy(), order["step"].to_numpy()
    dup = np.flatnonzero((ep[1:] == ep[:-1]) & (step[1:] == step[:-1]))
    if len(dup):
        row = int(order["_row"][int(dup[0]) + 1])
        raise TableError(f"{path}: turn ({_key(df, row)}) appears more than once ({len(dup)} duplicated rows); "
                         f"expected one row per (episode_id, step)")
    if table.contiguous:
        first = np.r_[True, ep[1:] != ep[:-1]]
        start = np.maximum.accumulate(np.where(first, np.arange(len(ep)), 0))
        gap = np.flatnonzero(step != np.arange(len(ep)) - start)
        if len(gap):
            i = int(gap[0])
            steps = step[start[i]: start[i] + 6].tolist()
            raise TableError(f"{path}: episode_id {ep[i]} has steps {steps}{' ...' if i - start[i] > 5 else ''}; "
                             f"expected 0, 1, 2, ... without gaps (first gap before step {step[i]})")


def read_table(path: str | Path, table: Table | pa.Schema) -> pl.DataFrame:
    """Read a table, cast it to its declared schema and check its content (module docstring): one clear error
    naming the file and column otherwise. A bare schema is cast and not checked."""
    path = Path(path)
    schema = _schema(table)
    if not path.is_file():
        raise TableError(f"{path}: table not found (expected a Parquet file written by an earlier stage)")
    try:
        arrow = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise TableError(f"{path}: not a readable Parquet file (truncated or corrupted?): {e}") from None
    df = pl.from_arrow(conform(with_defaults(arrow, table), schema, path))
    if isinstance(table, Table):
        check_rows(df, table, path)
    return df


def check_same_turns(steps: pl.DataFrame, steps_path: Path, other: pl.DataFrame, other_path: Path,
                     rerun: str) -> None:
    """`other` (a table joined to the step table) covers exactly the turns of `steps`; else one error with the
    counts of missing and extra turns and the first of each."""
    keys = list(KEYS)
    a, b = steps.select(keys), other.select(keys)
    missing = a.join(b, on=keys, how="anti").sort(keys)
    extra = b.join(a, on=keys, how="anti").sort(keys)
    if missing.height or extra.height:
        parts = []
        if missing.height:
            parts.append(f"{missing.height} of its turns missing (first: {_key(missing, 0)})")
        if extra.height:
            parts.append(f"{extra.height} turns that {steps_path} lacks (first: {_key(extra, 0)})")
        raise TableError(f"{other_path} does not cover the turns of {steps_path}: " + ", ".join(parts)
                         + f"; rerun the {rerun} stage")


@contextmanager
def atomic_dir(path: str | Path):
    """Yield a temporary folder beside `path`; on success it replaces `path` whole, on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    tmp.mkdir()
    try:
        yield tmp
        if path.exists():
            old = _tmp_name(path, clean=False)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def atomic_file(path: str | Path, suffix: str = ""):
    """Yield a temporary file name beside `path` (ending in `suffix`, for writers that read the format from it);
    on success it replaces `path`, on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path).with_suffix(suffix) if suffix else _tmp_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text)
