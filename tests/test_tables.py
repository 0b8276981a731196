"""Declared schemas, atomic writes and checked reads."""

import polars as pl
import pytest

from pipeline.tables import GROUPS, TableError, atomic_dir, read_table, write_table


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
