"""A benchmark's run folders: params written once, kept when the same, refused when a finished run had others."""
import os

import pytest
import yaml

from bench.learning import write_run_params


def test_a_run_folder_with_results_refuses_other_params_and_keeps_the_same_ones(tmp_path):
    first = {"seed": 0, "policy": {"path": "/a/model.gguf"}, "loop": {"iterations": 3}}
    write_run_params(tmp_path, first)
    f = tmp_path / "params.yaml"
    assert yaml.safe_load(f.read_text()) == first

    os.utime(f, (1_000_000, 1_000_000))
    write_run_params(tmp_path, {"seed": 0, "policy": {"path": "/a/model.gguf"}, "loop": {"iterations": 3}})
    assert f.stat().st_mtime == 1_000_000            # the same params: the file (and Snakemake's view of it) untouched

    other = {"seed": 0, "policy": {"path": "/b/model.gguf"}, "loop": {"iterations": 3}}
    write_run_params(tmp_path, other)                 # no results yet: nothing to protect, the new params written
    assert yaml.safe_load(f.read_text()) == other

    (tmp_path / "results").mkdir()
    with pytest.raises(SystemExit, match=r"params.yaml: a run made with other params is there \(loop.iterations: 3 "
                                         r"-> absent, policy.path: '/b/model.gguf' -> '/c/model.gguf'\)"):
        write_run_params(tmp_path, {"seed": 0, "policy": {"path": "/c/model.gguf"}, "loop": {}})
    assert yaml.safe_load(f.read_text()) == other   # nothing written


def test_relative_model_and_data_paths_are_anchored_where_the_command_runs(tmp_path):
    """A benchmark run works in a folder of its own: `models/x.gguf` and `data/sql` of the config, relative to the
    checkout, become absolute there; an absolute path, a path that names nothing and other keys stay as they are."""
    from bench.learning import anchored

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "x.gguf").write_bytes(b"GGUF")
    (tmp_path / "data" / "sql").mkdir(parents=True)
    raw = {"policy": {"path": "models/x.gguf", "dtype": "auto"}, "env": {"name": "sql", "data_path": "data/sql"},
           "run": {"dir": "results/x"}}
    out = anchored(raw, tmp_path)
    assert out == {"policy": {"path": str(tmp_path / "models" / "x.gguf"), "dtype": "auto"},
                   "env": {"name": "sql", "data_path": str(tmp_path / "data" / "sql")}, "run": {"dir": "results/x"}}
    assert raw["policy"]["path"] == "models/x.gguf"             # a copy
    same = {"policy": {"path": "/abs/m.gguf"}, "env": {"name": "sokoban", "data_path": "data/absent"}}
    assert anchored(same, tmp_path) == same
    assert anchored({"policy": {"path": None}}, tmp_path) == {"policy": {"path": None}}


def test_runs_grouped_by_dtype_name_what_auto_resolved_to(tmp_path):
    """bench.compare --group-by policy.dtype: a run of `auto` is grouped by the dtype it computed in (its
    precision record), so bf16 and fp32 runs of one config compare as bfloat16 against float32."""
    import json

    from bench.compare import Run

    for name, dtype, resolved in (("a", "auto", "bfloat16"), ("b", "float32", "float32"), ("c", "auto", None)):
        d = tmp_path / name
        (d / "results" / "iter_0" / "checkpoint").mkdir(parents=True)
        (d / "params.yaml").write_text(yaml.safe_dump({"policy": {"dtype": dtype}, "run": {"dir": "results"}}))
        (d / "results" / "iter_0" / "eval_metrics.json").write_text(json.dumps({"success_rate": 0.5}))
        if resolved:
            (d / "results" / "iter_0" / "checkpoint" / "precision.json").write_text(json.dumps(
                {"requested": dtype, "dtype": resolved}))
    assert [Run(tmp_path / n, "policy.dtype").method for n in "abc"] == ["bfloat16", "float32", "auto"]
    assert Run(tmp_path / "a").method == "grpo"
