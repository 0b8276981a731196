"""The SQL executor's guards (pipeline/envs/sql/executor.py), attacked one by one: each hostile statement must come
back as an error naming what stopped it, leave the database file byte for byte as it was and make no file, and the
connection must answer the next query."""

import hashlib

import pytest

from pipeline.envs.sql import world as sql_world
from pipeline.envs.sql.executor import MAX_RESULT_BYTES, Database

HOSTILE = {
    "recursive CTE": ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c",
                      "stopped after 0.3 s"),
    "nine-way cross join": (("SELECT count(*) FROM student a, student b, student c, student d, student e, "
                             "student f, student g, student h, student i"), "stopped after 0.3 s"),
    "attach": ("ATTACH DATABASE '{other}' AS other", "only queries are run"),
    "attach in a query": ("SELECT * FROM pragma_database_list", "not authorized"),
    "drop": ("DROP TABLE student", "only queries are run"),
    "delete": ("DELETE FROM student", "only queries are run"),
    "a write behind a comment": ("/* SELECT */ DELETE FROM student", "only queries are run"),
    "a temporary table": ("CREATE TEMP TABLE t(x)", "only queries are run"),
    "pragma": ("PRAGMA writable_schema = ON", "only queries are run"),
    "a pragma table function": ("SELECT * FROM pragma_table_info('student')", "not authorized"),
    "two statements": ("SELECT 1; DROP TABLE student", "only one statement at a time"),
    "a second statement after a comment": ("SELECT 1; -- done\nDELETE FROM student", "only one statement at a time"),
    "load_extension": ("SELECT load_extension('/tmp/evil.so')", "not authorized"),
    "writefile": ("SELECT writefile('{tmp}/out.txt', 'x')", "no such function"),
    "vacuum into": ("VACUUM INTO '{tmp}/copy.sqlite'", "only queries are run"),
    "huge blob": ("SELECT randomblob(200000000)", "too big"),
    "a string grown past the cap": ("SELECT replace(hex(zeroblob(300000)), '0', 'xx')", "too big"),
    "many large blobs": (("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT zeroblob(999999) "
                          "FROM c LIMIT 20"), f"larger than {MAX_RESULT_BYTES // 1_000_000} MB"),
    "a write in a CTE": ("WITH x AS (SELECT 1) DELETE FROM student", "not authorized"),
    "an insert in a CTE": ("WITH x AS (SELECT 1) INSERT INTO student(name) SELECT 'x'", "not authorized"),
}


@pytest.fixture()
def school(tmp_path):
    """A copy of the shipped school database (the shipped file itself is never opened writable either)."""
    path = tmp_path / "school.sqlite"
    path.write_bytes((sql_world.OUT / "database" / "school" / "school.sqlite").read_bytes())
    return path


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_query_is_an_error_and_the_file_is_unchanged(school, tmp_path, name):
    query, fragment = HOSTILE[name]
    before = hashlib.sha256(school.read_bytes()).hexdigest()
    # the endless cases are stopped at 0.3 s; the others get 10 s, so that a loaded machine cannot turn a refusal
    # into a timeout
    db = Database(school, timeout_s=0.3 if "stopped" in fragment else 10.0, max_rows=10_000)
    r = db.run(query.format(other=tmp_path / "other.sqlite", tmp=tmp_path))
    assert r.error is not None and fragment in r.error, r
    assert db.run("SELECT count(*) FROM student").rows == ((18,),)       # the connection still answers
    db.close()
    assert hashlib.sha256(school.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["school.sqlite"]   # nothing attached, copied or made


def test_rows_are_fetched_up_to_max_rows_and_the_rest_is_counted_as_more(school):
    db = Database(school, timeout_s=10.0, max_rows=7)
    r = db.run("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c")
    assert r.error is None and r.more and r.rows == tuple((i,) for i in range(1, 8)) and r.columns == ("x",)
    exact = db.run("VALUES (1), (2), (3)")
    assert exact.rows == ((1,), (2,), (3,)) and not exact.more
    db.close()


def test_a_stopped_query_does_not_shorten_the_next_ones_time(school):
    db = Database(school, timeout_s=0.3, max_rows=10)
    assert "stopped" in db.run("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
                               "SELECT count(*) FROM c").error
    assert db.run("SELECT count(*) FROM student").rows == ((18,),)
    db.close()
