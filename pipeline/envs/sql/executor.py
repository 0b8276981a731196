"""Model-written SQL run read-only, one statement at a time, under limits: the guards every query of the SQL
environment passes (the policy's turns, the gold queries' check at load).

- The file is opened read-only (`mode=ro`) and the connection refuses writes (`PRAGMA query_only`).
- One statement per call (sqlite3 refuses a second), and it must begin with SELECT, WITH or VALUES (comments and
  parentheses before it allowed): ATTACH, PRAGMA, VACUUM and every write are refused before SQLite sees them.
- An authorizer lets a statement read tables, recurse and call functions, and nothing else (a write inside a CTE,
  `pragma_*` table functions, schema changes), and refuses `load_extension`.
- A statement is stopped after `timeout_s` seconds (SQLite's progress handler, checked every 1,000 VM steps), the
  connection answering again after it.
- A string or blob a query makes is capped at 1 MB (SQLITE_LIMIT_LENGTH), a result's strings and blobs at 16 MB in
  all, and at most `max_rows` rows are fetched (`Result.more` says there were more).

A refused, failed or stopped statement is a `Result` with `error` set (SQLite's message, or what was refused); no
exception reaches the caller. The tests try to break out of each guard (tests/unit/test_sql_executor.py).
"""

from __future__ import annotations

import math
import re
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

MAX_VALUE_BYTES = 1_000_000      # SQLITE_LIMIT_LENGTH: the largest string or blob a query may make
MAX_RESULT_BYTES = 16_000_000    # the text and blobs of one result, at most

_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
            getattr(sqlite3, "SQLITE_RECURSIVE", 33)}      # what a read-only query needs; everything else is denied
_REFUSED_FUNCTIONS = {"load_extension"}
_FIRST_WORD = re.compile(r"(?:\s|--[^\n]*\n|/\*.*?\*/|\()*(select|with|values)\b", re.IGNORECASE | re.DOTALL)


def _authorize(action, arg1, arg2, db_name, trigger):
    if action not in _ALLOWED:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _REFUSED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def connect_read_only(path: str | Path, **kwargs) -> sqlite3.Connection:
    """A connection to the file that cannot write it (`mode=ro`); for the project's own reads (schemas)."""
    return sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True, **kwargs)


@dataclass(frozen=True)
class Result:
    columns: tuple[str, ...] = ()
    rows: tuple[tuple, ...] = ()       # up to max_rows
    more: bool = False                 # the result had more than max_rows rows
    error: str | None = None


class Database:
    """One SQLite file that runs model-written statements under the guards above."""

    def __init__(self, path: str | Path, timeout_s: float, max_rows: int):
        self.path, self.timeout_s, self.max_rows = Path(path), timeout_s, max_rows
        self.con = connect_read_only(path, check_same_thread=False)
        self.con.execute("PRAGMA query_only = ON")
        self.con.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        self.con.set_authorizer(_authorize)
        self._deadline = math.inf
        self.con.set_progress_handler(lambda: int(time.monotonic() > self._deadline), 1000)

    def run(self, query: str) -> Result:
        q = query.strip()
        if not q:
            return Result(error="empty query")
        if _FIRST_WORD.match(q) is None:
            return Result(error="only queries are run: one statement beginning with SELECT, WITH or VALUES")
        self._deadline = time.monotonic() + self.timeout_s
        try:
            cur = self.con.execute(q)
            columns = tuple(d[0] for d in cur.description or ())
            rows, size = [], 0
            while len(rows) <= self.max_rows:
                chunk = cur.fetchmany(min(256, self.max_rows + 1 - len(rows)))
                if not chunk:
                    break
                rows += chunk
                size += sum(len(v) for r in chunk for v in r if isinstance(v, (str, bytes)))
                if size > MAX_RESULT_BYTES:
                    cur.close()
                    return Result(error=f"the result is larger than {MAX_RESULT_BYTES // 1_000_000} MB")
            cur.close()
        except sqlite3.OperationalError as e:
            msg = str(e)
            if msg == "interrupted":
                msg = f"the query was stopped after {self.timeout_s:g} s"
            return Result(error=msg)
        except (sqlite3.DatabaseError, sqlite3.ProgrammingError, sqlite3.Warning, OverflowError, ValueError) as e:
            msg = str(e)
            if "one statement at a time" in msg:
                msg = "only one statement at a time is allowed"
            return Result(error=msg)
        finally:
            self._deadline = math.inf
        if not columns:
            return Result(error="not a query: only SELECT statements are run")
        more = len(rows) > self.max_rows
        return Result(columns, tuple(rows[:self.max_rows]), more)

    def close(self) -> None:
        self.con.close()
