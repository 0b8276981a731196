"""NL2SQL agents on SQLite: LearNAT's task and SkyRL-SQL's multi-turn loop (`env.name: sql`; docs/environments.md,
"SQL").

A task is a question about one database. The prompt shows the database's schema (its CREATE TABLE statements and
the first `env.sql.sample_rows` rows of each table, as Spider's and BIRD's prompts do) and the question. Each turn
the policy writes `<sql>query</sql>`, which is executed (the observation is the row count and the first rows, or
SQLite's error message), or `<answer>final query</answer>`, which ends the episode (free text around the tags is
allowed; a response with neither tag, both, or an empty one is invalid, a no-op). Reward 1 when the final query's
result equals the gold query's (execution accuracy, `same_result`), else 0; success is that reward.

No query can harm or hang anything: queries run in `pipeline.envs.sql.executor` (read-only, one statement, stopped
after `env.sql.timeout_s`, at most `env.sql.max_rows` rows; its docstring lists the guards), and the observation is
cut at `env.sql.show_rows` rows and `env.sql.result_chars` characters. A refused or stopped query is an error
observation; the episode goes on.

The state is what the agent has run: the anchor is the database, the question and the set of normalised queries
executed so far (`pipeline.envs.sql.ast_oracle`), so GiGPO's step groups join turns that have seen the same results.

Data (`env.data_path`; null: the generated databases the project ships, `pipeline.envs.sql.world`): a Spider or
BIRD folder: `tables.json` (or BIRD's `train/train_tables.json` and `dev/dev_tables.json`), questions in
`train_spider.json` or `train.json` (or BIRD's `train/train.json`) and `dev.json` or `test.json` (or
`dev/dev.json`), each record with `question`, `query` (Spider) or `SQL` (BIRD), `db_id` and, in BIRD, `evidence`
(shown with the question); databases in `database/<db_id>/<db_id>.sqlite` (or `test_database/`, BIRD's
`train/train_databases/` and `dev/dev_databases/`).

Capabilities: `oracle_distance` (the gold query's AST components not yet covered by an executed query, plus one
for the answer; 0 after a correct answer, inf after a wrong one) and `expert_actions` (the gold query's
decomposition one component a turn, then the gold query as the answer; on the last turn it answers at once).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.data.section import EnvSection, Section
from pipeline.data.seeds import task_item
from pipeline.envs.actions import ActionFormat, one_tag
from pipeline.envs.base import EnvSpec, Observation, StepResult, data_error, data_root, first_file, register, user_cache
from pipeline.envs.sql.executor import Database, Result, connect_read_only
from pipeline.envs.sql.world import OUT

_SQL = re.compile(r"<sql>(.*?)</sql>", re.DOTALL | re.IGNORECASE)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
NOTHING_YET = "(no query run yet)"
TABLES_FILES = ("tables.json", "train/train_tables.json", "dev/dev_tables.json")
TRAIN_FILES = ("train_spider.json", "train.json", "train/train.json")
TEST_FILES = ("dev.json", "test.json", "dev/dev.json")
DB_DIRS = ("database", "test_database", "train/train_databases", "dev/dev_databases")
PERMUTED_COLUMNS = 4             # results of up to this many columns match in any column order


class SqlSettings(Section):
    timeout_s: float = Field(2.0, gt=0, le=600, description="a statement is stopped after this many seconds")
    max_rows: int = Field(10_000, ge=1, le=10_000_000, description="rows fetched of a result at most (counted, and "
                          "compared for the answer); beyond, the observation says 'more than'")
    show_rows: int = Field(5, ge=1, le=1000, description="rows of a result the observation shows")
    result_chars: int = Field(600, ge=40, le=100_000, description="an observation is cut at this many characters")
    sample_rows: int = Field(3, ge=0, le=100, description="rows of each table the prompt shows under its schema")


class SqlConfig(EnvSection):
    """Questions answered with SQL over a SQLite database (generated ones, or a user's Spider or BIRD folder)."""
    name: Literal["sql"] = "sql"
    data_path: str | None = Field(None, description="a Spider or BIRD folder (tables.json, train_spider.json or "
                                  "train.json, dev.json, database/<db_id>/<db_id>.sqlite); null: the generated "
                                  "databases the project ships (data/sql)")
    max_turns: int = Field(5, ge=1, le=100, description="turns before an episode is truncated (queries and the "
                           "answer)")
    sql: SqlSettings = SqlSettings()

    @field_validator("data_path")
    @classmethod
    def _readable(cls, v):
        load_dataset(_root(v))     # missing files, malformed records and absent databases refused when params load
        return v

    @model_validator(mode="after")
    def _gold_runs(self):
        check_gold_queries(_root(self.data_path), self.sql.timeout_s, self.sql.max_rows)
        return self


def _root(data_path: str | None) -> str:
    return str(data_root(data_path, OUT))


def _ast():
    from pipeline.envs.sql import ast_oracle  # start-up cost: sqlglot, imported only where SQL is played

    return ast_oracle


# -- data ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    question: str
    query: str
    db_id: str
    hardness: str | None = None
    evidence: str | None = None


@dataclass(frozen=True)
class Dataset:
    databases: dict[str, Path]         # db_id -> its .sqlite file, in db_id order
    train: tuple[Task, ...]
    test: tuple[Task, ...]
    source: str
    files: tuple[Path, Path] = ()      # the train and test question files


def _json_list(path: Path) -> list:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise data_error(path, f"not readable JSON ({e})") from None
    if not isinstance(data, list):
        raise data_error(path, "expected a JSON list of records at the top level")
    return data


def _db_ids(folder: Path) -> set[str]:
    ids = set()
    for name in TABLES_FILES:
        if (folder / name).is_file():
            for k, rec in enumerate(_json_list(folder / name)):
                if not isinstance(rec, dict) or not isinstance(rec.get("db_id"), str):
                    raise data_error(folder / name, f"record {k} has no string db_id (Spider's tables.json)")
                ids.add(rec["db_id"])
    return ids


def _tasks(path: Path, known: set[str], databases: dict[str, Path]) -> tuple[Task, ...]:
    out = []
    for k, r in enumerate(_json_list(path)):
        where = f"record {k}"
        if not isinstance(r, dict):
            raise data_error(path, f"{where} is not a JSON object")
        query = r.get("query", r.get("SQL"))
        for key, value in (("question", r.get("question")), ("query (or SQL)", query), ("db_id", r.get("db_id"))):
            if not isinstance(value, str) or not value.strip():
                raise data_error(path, f"{where}: {key} must be a non-empty string; expected question, query (Spider) "
                                  "or SQL (BIRD), and db_id")
        db = r["db_id"]
        if db not in known:
            raise data_error(path, f"{where}: db_id {db!r} is not in tables.json")
        if db not in databases:
            raise data_error(path, f"{where}: no database file for db_id {db!r}; expected {db}/{db}.sqlite in "
                                   f"one of {', '.join(DB_DIRS)}")
        evidence = r.get("evidence")
        out.append(Task(" ".join(r["question"].split()), query.strip(), db, r.get("hardness"),
                        evidence.strip() if isinstance(evidence, str) and evidence.strip() else None))
    if not out:
        raise data_error(path, "no questions")
    return tuple(out)


@lru_cache(maxsize=4)
def load_dataset(root: str) -> Dataset:
    """A Spider or BIRD folder, every record and database file checked."""
    folder = Path(root)
    if not folder.is_dir():
        raise ValueError(f"env.data_path: {folder} is not a folder; expected a Spider or BIRD folder (tables.json, "
                         "train_spider.json or train.json, dev.json, database/<db_id>/<db_id>.sqlite)")
    if first_file(folder, TABLES_FILES) is None:
        raise data_error(folder, f"no tables.json (or {', '.join(TABLES_FILES[1:])}): the schemas of Spider's layout")
    known = _db_ids(folder)
    databases = {}
    for d in DB_DIRS:
        if (folder / d).is_dir():
            for sub in sorted((folder / d).iterdir()):
                if (sub / f"{sub.name}.sqlite").is_file():
                    databases.setdefault(sub.name, sub / f"{sub.name}.sqlite")
    splits, files = [], []
    for names in (TRAIN_FILES, TEST_FILES):
        path = first_file(folder, names)
        if path is None:
            raise data_error(folder, f"no {' or '.join(names)}: the questions (question, query or SQL, db_id)")
        splits.append(_tasks(path, known, databases))
        files.append(path)
    return Dataset(dict(sorted(databases.items())), splits[0], splits[1], str(folder), tuple(files))


GOLD_CHECK_VERSION = 1


def _gold_key(data: Dataset, timeout_s: float, max_rows: int) -> str:
    """The SHA-256 of what decides whether the gold queries run: the question files' bytes, each database file's
    path, size and modification time (a database is not read whole: BIRD's are gigabytes), the limits."""
    h = hashlib.sha256(f"v{GOLD_CHECK_VERSION} {timeout_s!r} {max_rows}".encode())
    for f in data.files:
        h.update(str(f.resolve()).encode() + b"\0" + f.read_bytes())
    for db, path in data.databases.items():
        st = path.stat()
        h.update(f"{db}\0{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


@lru_cache(maxsize=8)
def check_gold_queries(root: str, timeout_s: float, max_rows: int) -> None:
    """Every gold query of the dataset runs on its database under the environment's guards and limits, or a
    `ValueError` names the file, the record and SQLite's message: a question whose gold query fails scores 0 for
    every answer. Executed once per version of the files (`_gold_key`), the outcome kept in the user's cache."""
    data = load_dataset(root)
    key = _gold_key(data, timeout_s, max_rows)
    mark = user_cache("sql-gold", f"{key}.json")
    if mark.is_file():
        broken = json.loads(mark.read_text(encoding="utf-8"))
    else:
        broken = []
        dbs: dict[str, Database] = {}
        try:
            for path, tasks in zip(data.files, (data.train, data.test), strict=True):
                for k, t in enumerate(tasks):
                    if t.db_id not in dbs:
                        dbs[t.db_id] = Database(data.databases[t.db_id], timeout_s, max_rows)
                    error = dbs[t.db_id].run(t.query).error
                    if error is not None:
                        broken.append([str(path), k, t.db_id, error])
        finally:
            for db in dbs.values():
                db.close()
        mark.parent.mkdir(parents=True, exist_ok=True)
        tmp = mark.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(broken), encoding="utf-8")
        os.replace(tmp, mark)
    if broken:
        path, k, db, error = broken[0]
        more = f" ({len(broken) - 1} more records fail too)" if len(broken) > 1 else ""
        raise data_error(Path(path), f"record {k}: the gold query does not run on database {db!r}: {error}; every "
                         f"answer to it would score 0: fix or remove the record{more}")


# -- executing queries safely -------------------------------------------------------------------------------------


def _value(v):
    """A cell as execution accuracy compares it: 3.0 is 3, floats to 6 decimals, booleans as integers."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        r = round(v, 6)
        return int(r) if r.is_integer() and abs(r) < 2 ** 53 else r
    return v


def same_result(predicted: Result, gold: Result, ordered: bool) -> bool:
    """Execution accuracy: the rows as multisets (as lists where `ordered`: the gold query orders), NULLs equal,
    numbers compared as `_value` makes them; results of up to four columns match in any column order (as Spider's
    test-suite evaluation allows)."""
    if predicted.error is not None or gold.error is not None or predicted.more or gold.more:
        return False
    if len(predicted.columns) != len(gold.columns) or len(predicted.rows) != len(gold.rows):
        return False
    g = [tuple(_value(v) for v in r) for r in gold.rows]
    p = [tuple(_value(v) for v in r) for r in predicted.rows]
    width = len(gold.columns)
    orders = itertools.permutations(range(width)) if width <= PERMUTED_COLUMNS else [tuple(range(width))]
    target = g if ordered else Counter(g)
    for perm in orders:
        rows = [tuple(r[i] for i in perm) for r in p]
        if (rows if ordered else Counter(rows)) == target:
            return True
    return False


def orders(query: str) -> bool:
    """Whether a query's outermost result is ordered (an ORDER BY on the outermost query)."""
    tree = _ast().parse(query)
    if tree is None:
        return re.search(r"\border\s+by\b", query, re.IGNORECASE) is not None
    return tree.args.get("order") is not None


def render(result: Result, settings: SqlSettings) -> str:
    if result.error is not None:
        return f"Error: {result.error}"
    n = f"more than {settings.max_rows}" if result.more else str(len(result.rows))
    lines = [f"{n} row{'' if n == '1' else 's'}", " | ".join(result.columns)]
    lines += [" | ".join("NULL" if v is None else str(v) for v in r) for r in result.rows[:settings.show_rows]]
    if len(result.rows) > settings.show_rows:
        lines.append(f"... ({n} rows in all)")
    text = "\n".join(lines)
    return text if len(text) <= settings.result_chars else text[:settings.result_chars - 3] + "..."


# -- prompts ------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=256)
def schema_of(path: str) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """(table, CREATE statement, columns lowercased) of every table of a database, in the file's order."""
    con = connect_read_only(path)
    try:
        tables = con.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
                             "ORDER BY rowid").fetchall()
        return tuple((name, create, tuple(r[1].lower() for r in con.execute(
            "SELECT * FROM pragma_table_info(?)", (name,)))) for name, create in tables)
    finally:
        con.close()


@lru_cache(maxsize=256)
def table_columns(path: str) -> dict[str, tuple[str, ...]]:
    """Each table's columns, names lowercased (what the AST normalisation qualifies bare columns by)."""
    return {t.lower(): cols for t, _, cols in schema_of(path)}


@lru_cache(maxsize=256)
def schema_text(path: str, sample_rows: int) -> str:
    con = connect_read_only(path)
    parts = []
    try:
        for name, create, _ in schema_of(path):
            parts.append(create.strip())
            if sample_rows:
                cur = con.execute(f'SELECT * FROM "{name}" LIMIT {int(sample_rows)}')
                rows = [" | ".join("NULL" if v is None else str(v)[:40] for v in r) for r in cur.fetchall()]
                if rows:
                    parts.append(f"/* {len(rows)} rows of {name}: {' | '.join(d[0] for d in cur.description)}\n"
                                 + "\n".join(rows) + " */")
    finally:
        con.close()
    return "\n".join(parts)


def parse_response(response: str) -> tuple[str, str] | None:
    """("sql" | "answer", query) of a response, or None where it has neither tag, both, or an empty one."""
    found = one_tag(response, {"sql": _SQL, "answer": _ANSWER})
    if found is None:
        return None
    kind, content = found[0], found[1].strip()
    return (kind, content) if content else None


def _render_action(action: str | None) -> str:
    return action if action is not None else "(invalid)"


SQL_FORMAT = ActionFormat(
    "Run SQLite queries on the database with <sql>query</sql> to explore it; each shows its result. When your "
    "query answers the question, give it with <answer>query</answer>.", _render_action, list_admissible=False)


# -- the environment ----------------------------------------------------------------------------------------------


class SqlEnv:
    name = "sql"
    action_format = SQL_FORMAT

    def __init__(self, cfg: SqlConfig, cache_dir: Path):
        self.cfg = cfg
        self.data = load_dataset(_root(cfg.data_path))
        self.dbs: dict[str, Database] = {}
        self.task: Task | None = None
        self.ran: list[str] = []             # the normalised queries executed, in order
        self.covered: frozenset[str] = frozenset()
        self.text, self.turn, self.answer, self.correct = NOTHING_YET, 0, None, False

    def task_of(self, task: int) -> Task:
        return task_item(task, self.data.train, self.data.test)

    def task_labels(self, task: int) -> dict:
        t = self.task_of(task)
        return {"hardness": t.hardness or "unknown", "database": t.db_id}

    @property
    def path(self) -> str:
        """The current task's database file."""
        return str(self.data.databases[self.task.db_id])

    def db(self) -> Database:
        if self.task.db_id not in self.dbs:
            self.dbs[self.task.db_id] = Database(Path(self.path), self.cfg.sql.timeout_s, self.cfg.sql.max_rows)
        return self.dbs[self.task.db_id]

    def schema(self) -> dict[str, tuple[str, ...]]:
        return table_columns(self.path)

    def gold(self) -> tuple[Result, bool]:
        s = self.cfg.sql
        return _gold(self.path, self.task.query, s.timeout_s, s.max_rows)

    def task_context(self) -> str:
        """The part of the task text the database's questions share (its name and schema), which retrieved
        demonstrations follow (`prompt.demonstrations`), so that the prompts of one database keep a common prefix."""
        return f"Database {self.task.db_id}:\n{schema_text(self.path, self.cfg.sql.sample_rows)}\n"

    def task_description(self) -> str:
        evidence = f"\nEvidence: {self.task.evidence}" if self.task.evidence else ""
        return f"{self.task_context()}Question: {self.task.question}{evidence}"

    def task_brief(self) -> str:
        """The question alone, for a demonstration of this task in another's prompt (`prompt.demonstrations`)."""
        evidence = f" Evidence: {self.task.evidence}" if self.task.evidence else ""
        return f"{self.task.question}{evidence} (database {self.task.db_id})"

    def anchor(self) -> str:
        return f"{self.task.db_id}: {self.task.question} | ran: {' ; '.join(sorted(set(self.ran)))}"

    def admissible(self) -> tuple[str, ...]:
        """Commands for the warm start's random turns (the prompt does not list them): a look at each table."""
        return tuple(f"<sql>SELECT * FROM {t}</sql>" for t, _, _ in schema_of(self.path))

    def _observe(self) -> Observation:
        return Observation(self.text, self.anchor(), self.admissible())

    def reset(self, task: int) -> Observation:
        self.task = self.task_of(task)
        self.ran, self.covered = [], frozenset()
        self.text, self.turn, self.answer, self.correct = NOTHING_YET, 0, None, False
        return self._observe()

    def _normalised(self, query: str):
        return _ast().parse(query, self.schema())

    def step(self, response_text: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("SqlEnv.step called before reset")
        if self.answer is not None:
            raise RuntimeError("SqlEnv.step called after the episode's answer")
        self.turn += 1
        parsed = parse_response(response_text)
        action, reward, done = None, 0.0, False
        if parsed is not None:
            kind, query = parsed
            action = f"<{kind}>{query}</{kind}>"
            result = self.db().run(query)
            tree = self._normalised(query) if result.error is None else None
            self.ran.append(_ast().sql(tree) if tree is not None else " ".join(query.split()))
            if tree is not None:
                self.covered |= _ast().covered(tree)
            if kind == "sql":
                self.text = render(result, self.cfg.sql)
            else:
                gold, ordered = self.gold()
                self.answer, done = query, True
                self.correct = same_result(result, gold, ordered)
                reward = float(self.correct)
                self.text = f"Answered: {render(result, self.cfg.sql)}"
        obs = self._observe()
        return StepResult(observation=obs.text, anchor=obs.anchor, reward=reward, terminated=done,
                          truncated=not done and self.turn >= self.cfg.max_turns, action_valid=action is not None,
                          success=done and reward == 1.0, action=action, admissible=obs.admissible)

    # -- the oracle and the expert (pipeline.envs.sql.ast_oracle) --

    def oracle_distance(self) -> float:
        if self.answer is not None:
            return 0.0 if self.correct else math.inf
        return float(len(_gold_plan(self.path, self.task.query).components - self.covered) + 1)

    def gold_answer(self) -> tuple[str, str, str]:
        """The gold query as the answer: the text the policy would write to answer correctly."""
        return "<answer>", self.task.query, "</answer>"

    def expert_actions(self) -> list[str]:
        if self.answer is not None:
            return []
        plan = _gold_plan(self.path, self.task.query)
        if self.turn < self.cfg.max_turns - 1:
            missing = plan.components - self.covered
            for query, covers in plan.steps:
                if covers & missing:
                    return [f"<sql>{query}</sql>"]
        return [f"<answer>{self.task.query}</answer>"]

    def snapshot(self) -> tuple:
        return self.task, tuple(self.ran), self.covered, self.text, self.turn, self.answer, self.correct

    def restore(self, snap: tuple) -> None:
        self.task, ran, self.covered, self.text, self.turn, self.answer, self.correct = snap
        self.ran = list(ran)


@lru_cache(maxsize=4096)
def _gold(path: str, query: str, timeout_s: float, max_rows: int) -> tuple[Result, bool]:
    db = Database(Path(path), timeout_s, max_rows)
    try:
        return db.run(query), orders(query)
    finally:
        db.close()


@dataclass(frozen=True)
class GoldPlan:
    """What the oracle and the expert read of a gold query, computed once per query: its AST components, and the
    expert's decomposition as (query text, the components it covers); no steps where sqlglot cannot parse it (the
    whole query is then one component, which no executed query covers: the distance stays 2 until the answer)."""
    components: frozenset[str]
    steps: tuple[tuple[str, frozenset[str]], ...]


@lru_cache(maxsize=4096)
def _gold_plan(path: str, query: str) -> GoldPlan:
    ast = _ast()
    tree = ast.parse(query, table_columns(path))
    if tree is None:
        return GoldPlan(frozenset({"query:" + query}), ())
    return GoldPlan(frozenset(ast.components(tree)),
                    tuple((ast.sql(q), frozenset(ast.covered(q))) for q in ast.decomposition(tree)))


def make(cfg: SqlConfig, cache_dir: Path) -> SqlEnv:
    return SqlEnv(cfg, cache_dir)


def schema_words(cfg: SqlConfig) -> list[str]:
    """Table and column names, one token each for the tiny policy, which copies them from the schema it reads."""
    data = load_dataset(_root(cfg.data_path))
    words = [w for p in data.databases.values() for t, _, cols in schema_of(str(p)) for w in (t, *cols)]
    return list(dict.fromkeys(words))[:20_000]


SPEC = register(EnvSpec("sql", SqlConfig, make, words=schema_words, requires=("sqlglot",),
                        tool_call=lambda action: action.startswith("<sql>"), packages="the sqlglot package",
                        held_out=lambda cfg: len(load_dataset(_root(cfg.data_path)).test)))
