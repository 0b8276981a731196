"""The SQL environment (`env.name: sql`): execution accuracy on hand-made results, hostile queries that become
error observations and leave the database byte-identical, Spider's and BIRD's layouts and broken folders refused
when the params load, a hand-made Spider folder played with rewards computed by hand, the AST components of a
nested query and the oracle's distance through a hand-written episode, and the expert on every generated template."""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path

import pytest
import yaml

from pipeline.config.params import ParamsError, load_params
from pipeline.data.seeds import task_seed
from pipeline.envs.base import make_env
from pipeline.envs.sql import ast_oracle as sql_ast
from pipeline.envs.sql import world as sql_world
from pipeline.envs.sql.env import (
    SQL_FORMAT,
    SqlConfig,
    SqlSettings,
    check_gold_queries,
    load_dataset,
    parse_response,
    render,
    same_result,
)
from pipeline.envs.sql.executor import Database, Result
from pipeline.rollout.prompts import build_prompt

# -- execution accuracy --------------------------------------------------------------------------------------------


def res(*rows, columns=("a",)):
    return Result(tuple(columns), tuple(rows))


def test_rows_compare_as_multisets_unless_the_gold_orders():
    assert same_result(res((1,), (2,)), res((2,), (1,)), ordered=False)
    assert not same_result(res((1,), (2,)), res((2,), (1,)), ordered=True)
    assert same_result(res((2,), (1,)), res((2,), (1,)), ordered=True)
    # duplicates count: {a, a, b} is not {a, b, b}, and {a, b} is not {a, a, b}
    assert not same_result(res(("a",), ("a",), ("b",)), res(("a",), ("b",), ("b",)), ordered=False)
    assert not same_result(res(("a",), ("b",)), res(("a",), ("a",), ("b",)), ordered=False)


def test_nulls_floats_and_column_order():
    assert same_result(res((None,), (1,)), res((1,), (None,)), ordered=False)
    assert not same_result(res((None,),), res((0,),), ordered=False)
    assert same_result(res((45.333333333333336,),), res((45.33333333333,),), ordered=False)   # 6 decimals
    assert same_result(res((3.0,),), res((3,),), ordered=False)
    assert not same_result(res((0.1,),), res((0.2,),), ordered=False)
    assert not same_result(res(("3",),), res((3,),), ordered=False)                  # text is not a number
    two = ("city", "n")
    assert same_result(res((2, "Arden"), (1, "Elstow"), columns=two), res(("Arden", 2), ("Elstow", 1), columns=two),
                       ordered=False)                                                # any column order
    assert not same_result(res((2, "Arden"), columns=two), res(("Arden", 3), columns=two), ordered=False)
    assert not same_result(res((1,), columns=("a",)), res((1, 1), columns=two), ordered=False)
    assert not same_result(Result(error="no such column: x"), res((1,)), ordered=False)


def test_a_response_needs_exactly_one_non_empty_tag():
    assert parse_response("I look first. <sql>SELECT 1</sql>") == ("sql", "SELECT 1")
    assert parse_response("<answer>\nSELECT name FROM t\n</answer>") == ("answer", "SELECT name FROM t")
    assert parse_response("<sql>SELECT 1</sql><answer>SELECT 1</answer>") is None
    assert parse_response("SELECT 1") is None
    assert parse_response("<sql>  </sql>") is None


# -- safety (the executor's own guards: tests/unit/test_sql_executor.py) ----------------------------------------


def test_an_endless_result_is_cut_at_max_rows_and_the_observation_at_its_limits(tmp_path):
    school = tmp_path / "school.sqlite"
    school.write_bytes((sql_world.OUT / "database" / "school" / "school.sqlite").read_bytes())
    db = Database(school, timeout_s=10.0, max_rows=50)
    r = db.run("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c")
    assert r.more and len(r.rows) == 50
    assert render(r, SqlSettings(max_rows=50, show_rows=2)) == "more than 50 rows\nx\n1\n2\n... (more than 50 rows in all)"
    long = render(db.run("SELECT name FROM student"), SqlSettings(result_chars=40, show_rows=100))
    assert len(long) == 40 and long.endswith("...")
    db.close()


def test_a_hostile_turn_is_an_error_observation_and_the_episode_goes_on(tmp_path):
    env = make_env(SqlConfig(max_turns=12, sql={"timeout_s": 1.0}), tmp_path)
    env.reset(task_seed("train", 0, 1, 0))
    r = env.step("<sql>WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c</sql>")
    assert r.action_valid and not r.terminated and not r.truncated
    assert r.observation == "Error: the query was stopped after 1 s"
    r = env.step("<sql>DROP TABLE student</sql>")
    assert r.observation.startswith("Error: only queries are run") and not r.terminated
    while not (r.terminated or r.truncated):
        r = env.step(env.expert_actions()[0])
    assert r.success and r.reward == 1.0


# -- data layouts ---------------------------------------------------------------------------------------------------

CONCERT = """
CREATE TABLE singer (Singer_ID int PRIMARY KEY, Name text, Country text, Age int, Is_male bool);
CREATE TABLE concert (concert_ID int PRIMARY KEY, concert_Name text, Stadium_ID int, Year text);
CREATE TABLE singer_in_concert (concert_ID int, Singer_ID text,
  FOREIGN KEY (concert_ID) REFERENCES concert(concert_ID), FOREIGN KEY (Singer_ID) REFERENCES singer(Singer_ID));
INSERT INTO singer VALUES (1, 'Joe Sharp', 'Netherlands', 52, 'F'), (2, 'Timbaland', 'United States', 32, 'T'),
  (3, 'Justin Brown', 'France', 29, 'T'), (4, 'Rose White', 'France', 41, 'F'), (5, 'John Nizinik', 'France', 43, 'T');
INSERT INTO concert VALUES (1, 'Auditions', 1, '2014'), (2, 'Super bootcamp', 2, '2014'), (3, 'Home Visits', 2, '2015');
INSERT INTO singer_in_concert VALUES (1, '2'), (1, '3'), (1, '5'), (2, '3'), (2, '6'), (3, '5');
"""


def spider_folder(root: Path, bird: bool = False) -> Path:
    """A Spider folder written by hand (Spider's concert_singer, cut down), or BIRD's layout of the same."""
    root.mkdir(parents=True, exist_ok=True)
    tables = [{"db_id": "concert_singer", "table_names_original": ["singer", "concert", "singer_in_concert"]}]
    train = [{"db_id": "concert_singer", "question": "How many singers do we have?",
              "query": "SELECT count(*) FROM singer"},
             {"db_id": "concert_singer", "question": "What are the names of singers from France, oldest first?",
              "query": "SELECT Name FROM singer WHERE Country = 'France' ORDER BY Age DESC"}]
    dev = [{"db_id": "concert_singer", "question": "Show the name of every singer in a concert in 2014.",
            "query": "SELECT DISTINCT T2.Name FROM singer_in_concert AS T1 JOIN singer AS T2 ON T1.Singer_ID = "
                     "T2.Singer_ID JOIN concert AS T3 ON T1.concert_ID = T3.concert_ID WHERE T3.Year = '2014'"}]
    if bird:
        for split, records in (("train", train), ("dev", dev)):
            (root / split).mkdir(exist_ok=True)
            (root / split / f"{split}_tables.json").write_text(json.dumps(tables))
            rows = [{"db_id": r["db_id"], "question": r["question"], "SQL": r["query"],
                     "evidence": "France refers to Country = 'France'"} for r in records]
            (root / split / f"{split}.json").write_text(json.dumps(rows))
            db = root / split / f"{split}_databases" / "concert_singer" / "concert_singer.sqlite"
            db.parent.mkdir(parents=True)
            sqlite3.connect(db).executescript(CONCERT).close()
        return root
    (root / "tables.json").write_text(json.dumps(tables))
    (root / "train_spider.json").write_text(json.dumps(train))
    (root / "dev.json").write_text(json.dumps(dev))
    db = root / "database" / "concert_singer" / "concert_singer.sqlite"
    db.parent.mkdir(parents=True)
    sqlite3.connect(db).executescript(CONCERT).close()
    return root


def play(env, task: int, *responses: str):
    env.reset(task)
    return [env.step(r) for r in responses]


@pytest.mark.parametrize("bird", [False, True], ids=["spider", "bird"])
def test_a_spider_folder_the_project_did_not_write_plays_with_rewards_by_hand(tmp_path, bird):
    d = spider_folder(tmp_path / "data", bird=bird)
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump({"env": {"name": "sql", "data_path": str(d)}}))
    env = make_env(load_params(p).env, tmp_path)
    held_out = task_seed("eval", 0, 0, 0)
    env.reset(held_out)
    assert "CREATE TABLE singer (Singer_ID int PRIMARY KEY" in env.task_description()
    # the gold: Timbaland, Justin Brown and John Nizinik sang in 2014's concerts (singer 6 does not exist)
    steps = play(env, held_out, "<sql>SELECT Year FROM concert</sql>",
                 "<answer>SELECT Name FROM singer WHERE Singer_ID IN (2, 3, 5)</answer>")
    assert steps[0].observation == "3 rows\nYear\n2014\n2014\n2015" and steps[0].reward == 0.0
    assert steps[1].terminated and steps[1].reward == 1.0 and steps[1].success
    r = play(env, held_out, "<answer>SELECT Name FROM singer WHERE Singer_ID IN (2, 3)</answer>")[0]
    assert r.terminated and r.reward == 0.0                        # two of the three singers
    r = play(env, held_out, "<answer>SELECT T2.Name FROM singer_in_concert AS T1 JOIN singer AS T2 ON T1.Singer_ID "
                            "= T2.Singer_ID JOIN concert AS T3 ON T1.concert_ID = T3.concert_ID WHERE T3.Year = "
                            "'2014'</answer>")[0]
    assert r.reward == 0.0                           # without DISTINCT Justin Brown comes twice: another multiset
    # the training question orders: France's singers by age, John Nizinik (43) before Rose White (41)
    train = next(t for t in range(200) if env.reset(task_seed("train", 0, 1, t)) and "ORDER" in env.task.query)
    wrong_order = "<answer>SELECT Name FROM singer WHERE Country = 'France' ORDER BY Age</answer>"
    assert play(env, task_seed("train", 0, 1, train), wrong_order)[0].reward == 0.0
    right = "<answer>SELECT name FROM singer WHERE country = 'France' ORDER BY age DESC</answer>"
    assert play(env, task_seed("train", 0, 1, train), right)[0].reward == 1.0
    if bird:
        assert "Evidence: France refers to Country = 'France'" in env.task_description()


def broken(d: Path, breakage: str) -> None:
    if breakage == "no tables":
        (d / "tables.json").unlink()
    elif breakage == "no dev":
        (d / "dev.json").unlink()
    elif breakage == "no query":
        (d / "train_spider.json").write_text(json.dumps([{"db_id": "concert_singer", "question": "q"}]))
    elif breakage == "unknown db":
        (d / "dev.json").write_text(json.dumps([{"db_id": "flights", "question": "q", "query": "SELECT 1"}]))
    elif breakage == "no database file":
        (d / "database" / "concert_singer" / "concert_singer.sqlite").unlink()
    else:
        (d / "dev.json").write_text("{'db_id': 'single quotes'}")


@pytest.mark.parametrize("breakage, fragment", [
    ("no tables", "no tables.json"),
    ("no dev", "no dev.json or test.json or dev/dev.json"),
    ("no query", "train_spider.json: record 0: query (or SQL) must be a non-empty string"),
    ("unknown db", "dev.json: record 0: db_id 'flights' is not in tables.json"),
    ("no database file", "record 0: no database file for db_id 'concert_singer'"),
    ("not json", "dev.json: not readable JSON"),
])
def test_broken_folders_are_refused_when_the_params_load(tmp_path, breakage, fragment):
    d = spider_folder(tmp_path / "data")
    broken(d, breakage)
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump({"env": {"name": "sql", "data_path": str(d)}}))
    load_dataset.cache_clear()
    with pytest.raises(ParamsError) as e:
        load_params(p)
    assert fragment in str(e.value) and "env.data_path" in str(e.value) and "Traceback" not in str(e.value)


@pytest.mark.parametrize("gold, message", [
    ("SELECT Name FROM singr", "no such table: singr"),
    ("SELECT Name FROM singer WHERE", 'incomplete input'),
    ("SELECT Nme FROM singer", "no such column: Nme"),
])
def test_a_gold_query_that_does_not_run_is_refused_when_the_params_load(tmp_path, monkeypatch, gold, message):
    """Every answer to such a question would score 0: the params check names the file, the record, the database
    and SQLite's message, in one line; the outcome is kept in the user's cache by the files' hashes."""
    monkeypatch.setenv("CREDITRL_CACHE", str(tmp_path / "cache"))
    d = spider_folder(tmp_path / "data")
    dev = json.loads((d / "dev.json").read_text())
    (d / "dev.json").write_text(json.dumps(dev + [{**dev[0], "query": gold}]))
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump({"env": {"name": "sql", "data_path": str(d)}}))
    load_dataset.cache_clear()
    check_gold_queries.cache_clear()
    with pytest.raises(ParamsError) as e:
        load_params(p)
    text = str(e.value)
    assert f"dev.json: record 1: the gold query does not run on database 'concert_singer': {message}" in text
    line = next(k for k in text.splitlines() if "gold query" in k)      # one line of the params error
    assert "env.data_path: " in line and "Traceback" not in text
    assert len(list((tmp_path / "cache/sql-gold").glob("*.json"))) == 1
    # fixed: the files' hash changes, the queries run again, and the folder loads
    (d / "dev.json").write_text(json.dumps(dev))
    load_dataset.cache_clear()
    check_gold_queries.cache_clear()
    assert load_params(p).env.data_path == str(d)
    assert len(list((tmp_path / "cache/sql-gold").glob("*.json"))) == 2


# -- the AST oracle -----------------------------------------------------------------------------------------------

SCHOOL = {"school": ("school_id", "name", "city", "founded"),
          "student": ("student_id", "name", "age", "grade", "school_id")}


def test_the_components_of_a_nested_query_by_hand():
    gold = sql_ast.parse("SELECT T2.Name FROM student AS T1 JOIN school AS T2 ON T1.school_id = T2.school_id "
                         "WHERE T1.age > (SELECT avg(age) FROM student) AND T2.city = 'Arden' "
                         "GROUP BY T2.school_id HAVING count(*) >= 2", SCHOOL)
    assert sql_ast.components(gold) == {
        "from:student", "from:school", "join:school.school_id = student.school_id",
        "query:SELECT AVG(student.age) FROM student",
        "where:student.age > (SELECT AVG(student.age) FROM student)", "where:school.city = 'Arden'",
        "group:school.school_id", "having:COUNT(*) >= 2", "select:school.name"}
    setop = sql_ast.parse("SELECT name FROM school WHERE city = 'Arden' EXCEPT SELECT name FROM school WHERE "
                          "founded > 1900", SCHOOL)
    assert sql_ast.components(setop) == {
        "setop:except", "from:school", "where:school.city = 'Arden'", "where:school.founded > 1900",
        "query:SELECT school.name FROM school WHERE school.city = 'Arden'",
        "query:SELECT school.name FROM school WHERE school.founded > 1900"}


def test_the_oracle_distance_after_each_turn_of_a_hand_written_episode(tmp_path):
    env = make_env(SqlConfig(max_turns=8), tmp_path)
    gold = "SELECT name FROM club WHERE club_id NOT IN (SELECT club_id FROM player)"
    held_out = next(t for t in (task_seed("eval", 0, 0, i) for i in range(200))
                    if env.reset(t) and env.task.query == gold)
    env.reset(held_out)
    # gold: SELECT name FROM club WHERE club_id NOT IN (SELECT club_id FROM player); its components: from:club,
    # from:player, the subquery, the NOT IN predicate and the projection: 5, plus one for the answer
    assert env.oracle_distance() == 6
    distances = []
    for response in ("<sql>SELECT * FROM club</sql>",                 # from:club
                     "<sql>SELECT count(*) FROM club</sql>",          # nothing new
                     "<sql>SELECT Club_ID FROM Player</sql>",         # from:player and the subquery
                     "<sql>SELECT nme FROM club</sql>",               # an error covers nothing
                     "<answer>SELECT name FROM club WHERE club_id NOT IN (SELECT club_id FROM player)</answer>"):
        env.step(response)
        distances.append(env.oracle_distance())
    assert distances == [5, 5, 3, 3, 0]
    env.reset(held_out)
    env.step("<answer>SELECT name FROM club</answer>")
    assert env.oracle_distance() == math.inf


def test_the_expert_answers_every_template_in_exactly_its_oracle_distance(tmp_path):
    env = make_env(SqlConfig(max_turns=12), tmp_path)
    seen = {}
    for i in range(400):
        for stream in ("train", "eval"):
            task = task_seed(stream, 0, 1, i)
            env.reset(task)
            seen.setdefault(_template(env), task)
    assert set(seen) == set(sql_world.TEMPLATES)
    for template, task in seen.items():
        env.reset(task)
        distance, turns, r = env.oracle_distance(), 0, None
        while r is None or not (r.terminated or r.truncated):
            before = env.oracle_distance()
            r = env.step(env.expert_actions()[0])
            turns += 1
            assert env.oracle_distance() == before - 1, (template, env.ran)
        assert r.success and turns == distance, template


def _template(env) -> str:
    return next(q["template"] for split in ("train_spider", "dev")
                for q in _questions(split) if q["query"] == env.task.query and q["db_id"] == env.task.db_id)


_CACHE: dict[str, list] = {}


def _questions(split: str) -> list:
    if split not in _CACHE:
        _CACHE[split] = json.loads((sql_world.OUT / f"{split}.json").read_text())
    return _CACHE[split]


def test_with_five_turns_the_expert_answers_on_the_last_turn(tmp_path):
    env = make_env(SqlConfig(), tmp_path)
    assert env.cfg.max_turns == 5
    for i in range(60):
        env.reset(task_seed("train", 0, 1, i))
        r = None
        while r is None or not (r.terminated or r.truncated):
            r = env.step(env.expert_actions()[0])
        assert r.success and env.turn <= 5


# -- the shipped databases, the prompt, the anchor ---------------------------------------------------------------


def test_the_shipped_world_regenerates_with_the_same_rows_and_questions(tmp_path):
    counts = sql_world.generate(tmp_path)
    for name in ("tables.json", "train_spider.json", "dev.json"):
        assert (tmp_path / name).read_bytes() == (sql_world.OUT / name).read_bytes(), name
    for db in sql_world.TRAIN_DBS + sql_world.HELD_OUT_DBS:
        dumps = [list(sqlite3.connect(root / "database" / db / f"{db}.sqlite").iterdump())
                 for root in (tmp_path, sql_world.OUT)]
        assert dumps[0] == dumps[1], db
    assert counts["dev"] >= 100 and counts["train"] >= 500
    train_dbs = {q["db_id"] for q in _questions("train_spider")}
    assert train_dbs == set(sql_world.TRAIN_DBS) and {q["db_id"] for q in _questions("dev")} == set(
        sql_world.HELD_OUT_DBS)                                      # Spider's cross-database split
    assert {q["hardness"] for q in _questions("dev")} == {"easy", "medium", "hard", "extra"}


def test_the_prompt_shows_the_schema_rows_and_question_and_asks_for_the_tags(tmp_path):
    env = make_env(SqlConfig(sql={"sample_rows": 1}), tmp_path)
    obs = env.reset(task_seed("eval", 0, 0, 0))
    task = env.task_description()
    assert task.startswith(f"Database {env.task.db_id}:\nCREATE TABLE") and task.endswith(
        f"Question: {env.task.question}")
    assert task.count("/* 1 rows of") == 3
    r = env.step("<sql>SELECT count(*) FROM coach</sql>" if env.task.db_id == "football" else
                 "<sql>SELECT count(*) FROM museum</sql>")
    prompt = build_prompt(task, [(obs.text, r.action)], r.observation, r.admissible, 4, SQL_FORMAT)
    assert "<sql>query</sql>" in prompt and "<answer>query</answer>" in prompt and "Admissible" not in prompt
    assert "Turn 1 action: <sql>SELECT count(*) FROM" in prompt and "Turn 2 state:\n1 row\ncount(*)\n" in prompt


def test_the_anchor_is_the_set_of_normalised_queries_run(tmp_path):
    a, b = make_env(SqlConfig(), tmp_path), make_env(SqlConfig(), tmp_path)
    task = task_seed("train", 0, 1, 3)
    a.reset(task)
    b.reset(task)
    t = a.schema()
    table = next(iter(t))
    a.step(f"<sql>SELECT * FROM {table}</sql>")
    a.step("<sql>SELECT 1</sql>")
    b.step("<sql>select 1</sql>")
    assert a.anchor() != b.anchor()
    b.step(f"<sql>SELECT  *  FROM {table.upper()}</sql>")
    assert a.anchor() == b.anchor()                       # order and spelling free


def test_snapshot_and_restore_continue_the_same_episode(tmp_path):
    a = make_env(SqlConfig(max_turns=12), tmp_path)
    a.reset(task_seed("train", 0, 1, 7))
    a.step(a.expert_actions()[0])
    b = make_env(SqlConfig(max_turns=12), tmp_path)
    b.restore(a.snapshot())
    assert (b.anchor(), b.oracle_distance(), b.expert_actions()) == (a.anchor(), a.oracle_distance(),
                                                                    a.expert_actions())
    ra, rb = a.step(a.expert_actions()[0]), b.step(b.expert_actions()[0])
    assert ra == rb



# -- retrieved demonstrations (prompt.demonstrations) --------------------------------------------------------------


def test_demonstrations_come_from_training_tasks_only_and_the_pool_is_played_once(tmp_path, monkeypatch):
    from pipeline.config.params import Params
    from pipeline.rollout import demonstrations as demos

    monkeypatch.chdir(tmp_path)
    p = Params(env={"name": "sql", "max_turns": 12}, prompt={"demonstrations": 2, "demonstration_pool": 40})
    env = demos.environment(p)
    train_questions = {q["question"] for q in _questions("train_spider")}
    held_out = {q["question"] for q in _questions("dev")}
    for i in range(5):
        env.reset(task_seed("eval", 0, 0, i))
        text = env.task_description()
        # the database and its schema first (the prefix its questions share), then the examples, then the question
        schema = f"Database {env.task.db_id}:\nCREATE TABLE "
        assert text.startswith(schema) and text.index("CREATE TABLE") < text.index("Solved examples")
        assert text.startswith(env.task_context() + "Solved examples of similar tasks:\n\nExample 1:\nTask: ")
        assert "Example 3:" not in text
        assert text.count("Database ") == 1 and "CREATE TABLE" not in text.split("Solved examples")[1]
        shown = [line[len("Task: "):line.rindex(" (database")] for line in text.splitlines()
                 if line.startswith("Task: ")]
        assert len(shown) == 2 and set(shown) <= train_questions and not set(shown) & held_out
        assert text.endswith(f"Question: {env.task.question}")
        # each demonstration is the expert's episode: its last action answers with the gold query
        example = text.split("Example 1:\n")[1].split("\n\nExample 2:")[0]
        actions = [line for line in example.splitlines() if line.startswith("Action ")]
        assert actions[-1].split(": ", 1)[1].startswith("<answer>") and "Result" in example
    # a training task is never shown its own question
    pool = demos.build_pool(p)
    plain, fulls = make_env(p.env), {full for full, _ in pool}
    own = next(t for t in (task_seed("train", 0, 1, i) for i in range(400))
               if plain.reset(t) and plain.task_description() in fulls)
    env.reset(own)
    assert f"Task: {env.task_brief()}" not in env.task_description()
    # the pool is played once and read back from the run's cache
    assert len(list((tmp_path / "results" / "envs").glob("demonstrations-*.json"))) == 1
    monkeypatch.setattr(demos, "expert_episode", lambda *a: (_ for _ in ()).throw(AssertionError("replayed")))
    demos._LOADED.clear()
    assert demos.build_pool(p) == pool and demos.environment(p) is not None


def test_demonstrations_follow_the_shared_context_and_a_context_that_is_not_a_prefix_is_refused():
    from types import SimpleNamespace

    from pipeline.rollout.demonstrations import WithDemonstrations

    shown = SimpleNamespace(for_task=lambda text: ["Task: q1\nAction 1: a"])
    env = SimpleNamespace(name="stub", task_description=lambda: "Schema S\nQuestion: q",
                          task_context=lambda: "Schema S\n")
    assert WithDemonstrations(env, shown).task_description() == (
        "Schema S\nSolved examples of similar tasks:\n\nExample 1:\nTask: q1\nAction 1: a\n\nQuestion: q")
    plain = SimpleNamespace(name="stub", task_description=lambda: "Question: q")
    assert WithDemonstrations(plain, shown).task_description() == (
        "Solved examples of similar tasks:\n\nExample 1:\nTask: q1\nAction 1: a\n\nQuestion: q")
    env.task_context = lambda: "Schema T\n"
    with pytest.raises(ValueError, match=r"environment 'stub': task_context\(\) is not the start of task_description"):
        WithDemonstrations(env, shown).task_description()


def test_warmstart_demonstrations_set_the_warm_starts_own_count_and_free_the_initial_policy_of_the_prompts(
        tmp_path, monkeypatch):
    """`warmstart.demonstrations: 0` trains the warm start on plain prompts whatever `prompt.demonstrations` says,
    so a run with retrieved demonstrations in RL reuses the initial policy of a run without them (`run.base`), also
    of one that leaves the count null; null keeps the warm start on the prompts RL sees, and the initial policy
    then is not shared."""
    from pipeline.config.params import Params
    from pipeline.rollout.warmstart import demonstrations
    from pipeline.workflow.runs import share_base

    monkeypatch.chdir(tmp_path)
    env = {"name": "sql", "max_turns": 5}
    plain = demonstrations(Params(env=env), 3, 0.0, seed=4)
    shown = Params(env=env, prompt={"demonstrations": 2, "demonstration_pool": 30})
    with_them = demonstrations(shown, 3, 0.0, seed=4)
    assert len(plain) == len(with_them) == 14
    assert not any("Solved examples" in q for q, _, _ in plain)
    assert all(q.count("\nExample ") == 2 for q, _, _ in with_them)
    # the warm start's own count: 0 gives the plain prompts, 2 on a run without them gives the retrieved ones
    assert demonstrations(shown.model_copy(update={"warmstart": shown.warmstart.model_copy(
        update={"demonstrations": 0})}), 3, 0.0, seed=4) == plain
    assert demonstrations(Params(env=env, prompt={"demonstration_pool": 30}, warmstart={"demonstrations": 2}),
                          3, 0.0, seed=4) == with_them
    # run.base through 0: the initial policy is linked only where the warm start does not follow the prompt
    (tmp_path / "Snakefile").write_text("")
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({"env": env, "warmstart": {"demonstrations": 0},
                                                        "run": {"dir": "base"}}))
    (tmp_path / "base/iter_0/checkpoint").mkdir(parents=True)
    (tmp_path / "base/iter_0/checkpoint/model.safetensors").write_bytes(b"weights")
    base = {"params": str(tmp_path / "base.yaml"), "through": 0}
    arm = {"env": env, "prompt": {"demonstrations": 2}, "run": {"dir": "arm", "base": base}}
    assert share_base(Params(**arm, warmstart={"demonstrations": 0}), log=lambda _: None) == ["init"]
    # nor on the pool the retrieved demonstrations come from, which a warm start without them never reads
    pooled = {**arm, "prompt": {"demonstrations": 2, "demonstration_pool": 30}, "run": {"dir": "arm_pool", "base": base}}
    assert share_base(Params(**pooled, warmstart={"demonstrations": 0}), log=lambda _: None) == ["init"]
    assert (tmp_path / "arm/iter_0/checkpoint/model.safetensors").is_symlink()
    assert share_base(Params(**{**arm, "run": {"dir": "arm2", "base": base}}), log=lambda _: None) == []
    assert share_base(Params(**{**arm, "run": {"dir": "arm3", "base": base}}, warmstart={"demonstrations": 2}),
                      log=lambda _: None) == []
    # a base that leaves the count null with no demonstrations in its prompts trained the same warm start as one
    # that sets 0: the arm shares its initial policy; with 1 in the base's prompts it does not
    for name, prompt, shared in (("plain", {}, ["init"]), ("one", {"demonstrations": 1}, [])):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({"env": env, "prompt": prompt, "run": {"dir": "base"}}))
        other = {"params": str(tmp_path / f"{name}.yaml"), "through": 0}
        assert share_base(Params(**{**arm, "run": {"dir": f"arm_{name}", "base": other}},
                                 warmstart={"demonstrations": 0}), log=lambda _: None) == shared


def test_task_labels_are_the_questions_hardness_and_database(tmp_path):
    env = make_env(SqlConfig(), tmp_path)
    held_out = _questions("dev")
    for i in range(5):
        task = task_seed("eval", 0, 0, i)
        q = held_out[i]                                   # held-out tasks play dev.json in order
        assert env.task_labels(task) == {"hardness": q["hardness"], "database": q["db_id"]}
