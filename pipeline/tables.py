"""Declared schemas of the Parquet tables that stages exchange, atomic writes and checked reads.

Column names follow Minari/TorchRL (`episode_id`, `step`, `reward`, `terminated`, `truncated`) and keep token
columns as verl does (prompt and response ids, the response's per-token log-probs).
"""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

STEPS = pa.schema([
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
])

GROUPS = pa.schema([
    ("episode_id", pa.int64()),
    ("step", pa.int32()),
    ("task_group", pa.int64()),
    ("anchor_hash", pa.uint64()),     # xxh3-64 of the anchor string
    ("step_group", pa.int64()),       # dense id of (task_group, anchor)
    ("step_group_size", pa.int32()),
    ("history_groups", pa.list_(pa.int64())),  # HGPO: id of (task_group, last k anchors) for k = 1..depth
])

STEP_REWARDS = pa.schema([            # the fit stage's learned per-turn scores (OPRL, SPA)
    ("episode_id", pa.int64()),
    ("step", pa.int32()),
    ("score", pa.float64()),          # OPRL: implicit reward r_phi(t) (beta included); SPA: contribution c_t
])

ADVANTAGES = pa.schema([
    ("episode_id", pa.int64()),
    ("step", pa.int32()),
    ("episode_advantage", pa.float64()),  # A^E: the method's episode term (the shared one for all but RLOO)
    ("step_score", pa.float64()),         # the value the step level normalises (G_t, r_phi, G^SPA); null if none
    ("step_advantage", pa.float64()),     # weighted step-level term
    ("penalty", pa.float64()),            # credit.invalid_penalty on an invalid turn, else 0
    ("advantage", pa.float64()),          # episode_advantage + step_advantage - penalty
])

EVAL_EPISODES = pa.schema([
    ("iteration", pa.int32()),
    ("task_id", pa.int64()),
    ("episode_return", pa.float64()),
    ("episode_length", pa.int32()),
    ("success", pa.bool_()),
    ("invalid_turns", pa.int32()),
    ("optimal_moves", pa.int32()),    # solver's optimal solution length of the start state
])


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


def write_table(df: pl.DataFrame, path: str | Path, schema: pa.Schema) -> None:
    """Write `df` with exactly `schema`'s columns and types, to a temporary name and then rename."""
    path = Path(path)
    missing = [n for n in schema.names if n not in df.columns]
    if missing:
        raise TableError(f"{path}: cannot write, columns {missing} are missing from the frame")
    table = df.select(schema.names).to_arrow().cast(schema)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def empty_table(schema: pa.Schema) -> pl.DataFrame:
    """A frame with `schema`'s columns and no rows."""
    return pl.from_arrow(schema.empty_table())


def read_table(path: str | Path, schema: pa.Schema) -> pl.DataFrame:
    """Read a table and check it against `schema`: one clear error naming the file and column otherwise."""
    path = Path(path)
    if not path.is_file():
        raise TableError(f"{path}: table not found (expected a Parquet file written by an earlier stage)")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise TableError(f"{path}: not a readable Parquet file (truncated or corrupted?): {e}") from None
    for field in schema:
        if field.name not in table.schema.names:
            raise TableError(f"{path}: column '{field.name}' is missing; expected type {field.type}")
        got = table.schema.field(field.name).type
        if got != field.type:
            raise TableError(f"{path}: column '{field.name}' has type {got}; expected {field.type}")
    return pl.from_arrow(table.select(schema.names))


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


def write_text_atomic(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
