"""Declared schemas, atomic writes and checked reads."""

import polars as pl
import pytest

from pipeline.data.tables import GROUPS, STEPS, TableError, atomic_dir, read_table, write_table


def groups_frame():
    return pl.DataFrame({"episode_id": [1, 1], "step": [0, 1], "task_group": [7, 7], "anchor_hash": [5, 6],
                         "step_group": [0, 1], "step_group_size": [1, 1], "history_groups": [[0], [1]]})


def test_round_trip_casts_to_schema(tmp_path):
    path = tmp_path / "g.parquet"
    write_table(groups_frame(), path, GROUPS)
    df = read_table(path, GROUPS)
    assert df["anchor_hash"].dtype == pl.UInt64 and df["step"].dtype == pl.Int32
    assert [p.name for p in tmp_path.iterdir()] == ["g.parquet"]


def test_read_errors_name_file_and_column(tmp_path):
    with pytest.raises(TableError, match="g.parquet: table not found"):
        read_table(tmp_path / "g.parquet", GROUPS)
    path = tmp_path / "g.parquet"
    write_table(groups_frame(), path, GROUPS)
    good = pl.read_parquet(path)
    good.drop("step_group").write_parquet(path)
    with pytest.raises(TableError, match="column 'step_group' is missing"):
        read_table(path, GROUPS)
    good.with_columns(pl.col("step").cast(pl.Utf8)).write_parquet(path)
    with pytest.raises(TableError, match="column 'step' has type (string|large_string); expected int32"):
        read_table(path, GROUPS)
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(TableError, match="not a readable Parquet file"):
        read_table(path, GROUPS)


def test_atomic_dir_leaves_nothing_on_error(tmp_path):
    target = tmp_path / "ckpt"
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as tmp:
            (tmp / "weights").write_text("half")
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []
    with atomic_dir(target) as tmp:
        (tmp / "weights").write_text("whole")
    assert (target / "weights").read_text() == "whole" and len(list(tmp_path.iterdir())) == 1


def test_temporaries_a_killed_writer_left_are_cleared(tmp_path):
    (tmp_path / ".g.parquet.tmp-deadbeef").write_bytes(b"half a table")
    (tmp_path / ".ckpt.tmp-0badf00d").mkdir()
    (tmp_path / ".ckpt.tmp-0badf00d" / "weights").write_text("half")
    write_table(groups_frame(), tmp_path / "g.parquet", GROUPS)
    with atomic_dir(tmp_path / "ckpt") as tmp:
        (tmp / "weights").write_text("whole")
    with atomic_dir(tmp_path / "ckpt") as tmp:       # replacing an existing folder
        (tmp / "weights").write_text("newer")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "g.parquet"]
    assert (tmp_path / "ckpt" / "weights").read_text() == "newer"


# ---------------------------------------------------------------------------------------------------------------
# Tables other tools write, and broken content (issue: tables a user edits)

def steps_frame(n_eps: int = 2, turns: int = 3) -> pl.DataFrame:
    rows = []
    for e in range(n_eps):
        for t in range(turns):
            rows.append({"iteration": 1, "task_id": 5, "task_group": 7, "episode_id": e, "step": t,
                         "observation": f"obs {t}", "anchor": f"a{t}", "prompt": "p", "prompt_ids": [1, 2],
                         "response_ids": [3], "response_logprobs": [-0.5], "response": "<action>up</action>",
                         "action": "up", "action_valid": True, "reward": -0.1, "terminated": t == turns - 1,
                         "truncated": False, "episode_return": -0.1 * turns, "episode_length": turns,
                         "success": False, "env_error": None})
    return pl.DataFrame(rows, schema_overrides={"env_error": pl.String})


@pytest.fixture
def steps_file(tmp_path):
    path = tmp_path / "steps.parquet"
    write_table(steps_frame(), path, STEPS)
    return path


def test_a_table_round_tripped_through_polars_pandas_or_duckdb_is_accepted(steps_file, tmp_path):
    import duckdb
    import pyarrow.parquet as pq

    expected = read_table(steps_file, STEPS)
    via_polars = tmp_path / "polars.parquet"
    pl.read_parquet(steps_file).write_parquet(via_polars)                  # large_string, large_list
    via_pandas = tmp_path / "pandas.parquet"
    pl.read_parquet(steps_file).to_pandas().to_parquet(via_pandas, engine="pyarrow")
    via_duckdb = tmp_path / "duckdb.parquet"
    duckdb.sql(f"COPY (SELECT * FROM read_parquet('{steps_file}')) TO '{via_duckdb}' (FORMAT parquet)")
    dictionary = tmp_path / "dictionary.parquet"                             # dictionary-encoded strings
    arrow = pq.read_table(steps_file)
    arrow = arrow.set_column(arrow.schema.get_field_index("anchor"), "anchor",
                             arrow.column("anchor").dictionary_encode())
    pq.write_table(arrow, dictionary)
    assert pq.read_table(via_polars).schema.field("observation").type != STEPS.schema.field("observation").type
    for path in (via_polars, via_pandas, via_duckdb, dictionary):
        got = read_table(path, STEPS)
        assert got.schema == expected.schema and got.equals(expected), path.name


def test_wider_integers_are_accepted_when_they_fit(steps_file):
    pl.read_parquet(steps_file).with_columns(pl.col("step").cast(pl.Int64)).write_parquet(steps_file)
    assert read_table(steps_file, STEPS)["step"].dtype == pl.Int32
    pl.read_parquet(steps_file).with_columns(pl.col("step") + 2**40).write_parquet(steps_file)
    with pytest.raises(TableError, match=r"steps.parquet: column 'step' of type int64 does not fit the declared int32"):
        read_table(steps_file, STEPS)


@pytest.mark.parametrize("edit, message", [
    (lambda df: df.head(0), r"the table has no rows; expected at least one turn"),
    (lambda df: pl.concat([df, df.slice(4, 1)]),
     r"turn \(episode_id 1, step 1\) appears more than once \(1 duplicated rows\); expected one row per"),
    (lambda df: df.filter(~((pl.col("episode_id") == 1) & (pl.col("step") == 1))),
     r"episode_id 1 has steps \[0, 2\]; expected 0, 1, 2, ... without gaps \(first gap before step 2\)"),
    (lambda df: df.with_columns(pl.when(pl.col("step") == 2).then(float("nan")).otherwise(pl.col("reward"))
                                .alias("reward")),
     r"column 'reward' holds nan at episode_id 0, step 2 \(first of 2 such rows\); expected finite numbers"),
    (lambda df: df.with_columns(pl.when(pl.col("episode_id") == 1).then(None).otherwise(pl.col("reward"))
                                .alias("reward")),
     r"column 'reward' holds None at episode_id 1, step 0 \(first of 3 such rows\)"),
    (lambda df: df.with_columns(pl.when(pl.col("step") == 1).then(None).otherwise(pl.col("anchor")).alias("anchor")),
     r"column 'anchor' is null at episode_id 0, step 1 \(first of 2 such rows\); expected a value in every row"),
    (lambda df: df.with_columns(pl.when((pl.col("episode_id") == 1) & (pl.col("step") == 0))
                                .then(pl.lit([-0.5, float("-inf")])).otherwise(pl.col("response_logprobs"))
                                .alias("response_logprobs")),
     r"column 'response_logprobs' holds \[-0.5, -inf\] at episode_id 1, step 0 \(first of 1 such rows\)"),
])
def test_broken_content_is_named_in_one_line(steps_file, edit, message):
    edit(pl.read_parquet(steps_file)).write_parquet(steps_file)
    with pytest.raises(TableError, match=f"steps.parquet: {message}") as e:
        read_table(steps_file, STEPS)
    assert "\n" not in str(e.value)


def test_a_joined_table_must_cover_the_same_turns(tmp_path):
    from pipeline.data.tables import check_same_turns

    steps = steps_frame()
    groups = steps.select("episode_id", "step").filter(pl.col("step") != 1)
    extra = pl.DataFrame({"episode_id": [9], "step": [0]})
    with pytest.raises(TableError, match=r"g.parquet does not cover the turns of s.parquet: 2 of its turns "
                                         r"missing \(first: episode_id 0, step 1\), 1 turns that s.parquet lacks "
                                         r"\(first: episode_id 9, step 0\); rerun the group stage"):
        check_same_turns(steps, "s.parquet", pl.concat([groups, extra]), "g.parquet", "group")
    check_same_turns(steps, "s.parquet", steps.sample(fraction=1.0, shuffle=True, seed=1), "g.parquet", "group")


def test_iterations_are_read_from_folder_names_in_numeric_order(tmp_path):
    from pipeline.data.paths import iterations_with

    for name in ("iter_10", "iter_2", "iter_0", "iter_x", "iter_3b"):
        (tmp_path / name).mkdir()
    (tmp_path / "iter_7").write_text("a file, not an iteration's folder")
    for it in (10, 2):
        (tmp_path / f"iter_{it}" / "eval.parquet").write_text("")
    assert iterations_with(tmp_path) == [0, 2, 10]                    # 10 after 2, not as text
    assert iterations_with(tmp_path, "eval.parquet") == [2, 10]
    assert iterations_with(tmp_path / "missing", "eval.parquet") == []
