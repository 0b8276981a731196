"""runtime.torch_threads sets the threads of every stage, however it is started (pipeline.workflow.threads)."""

import json
import os
import subprocess
import sys

import polars as pl
import pytest
import yaml

from pipeline.data.tables import STEPS, write_table
from pipeline.workflow.threads import ENV, configure
from tests.unit.test_tables import steps_frame


def test_configure_reads_the_params_file_before_validation(tmp_path, monkeypatch):
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"runtime": {"torch_threads": 3}}))
    monkeypatch.delenv("CREDITRL_THREADS", raising=False)
    assert configure(["--params", str(tmp_path / "p.yaml"), "--iteration", "1"]) == 3
    assert all(os.environ[v] == "3" for v in ENV)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"runtime": {"torch_threads": 0}}))
    monkeypatch.setenv("CREDITRL_THREADS", "2")                # what Snakemake exports for a 2-core job
    assert configure([f"--params={tmp_path / 'p.yaml'}"]) == 2
    (tmp_path / "p.yaml").write_text("runtime: [broken")
    assert configure(["--params", str(tmp_path / "p.yaml")]) == 2   # the stage reports the bad file itself


def run_stage(d, stage, *args, env_threads=None):
    env = {k: v for k, v in os.environ.items() if k not in ENV and k != "CREDITRL_THREADS"}
    if env_threads:
        env["CREDITRL_THREADS"] = str(env_threads)
    r = subprocess.run([sys.executable, "-m", f"stages.{stage}", "--params", "p.yaml", *args], cwd=d, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    records = [json.loads(x) for x in (d / "results/metrics" / f"{stage}{'_1' if args else ''}.jsonl")
               .read_text().splitlines()]
    return r.stdout, {k: v for rec in records for k, v in rec["metrics"].items()}


def write_group_input(d):
    """What the group stage of iteration 1 reads, in run folder `d`."""
    write_table(steps_frame().with_columns(pl.lit(1).alias("iteration")), d / "results/iter_1/steps.parquet", STEPS)


@pytest.mark.hardware
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores to tell 1 thread from all")
def test_a_stage_started_by_hand_runs_with_the_requested_threads(tmp_path):
    write_group_input(tmp_path)
    for requested, env_threads, expected in ((1, None, 1), (0, None, os.cpu_count()), (0, 2, 2)):
        (tmp_path / "p.yaml").write_text(yaml.safe_dump({"runtime": {"torch_threads": requested},
                                                         "tracking": {"enabled": False}}))
        out, metrics = run_stage(tmp_path, "group", "--iteration", "1", env_threads=env_threads)
        assert f"{expected} threads (runtime.torch_threads {requested})" in out
        assert metrics["runtime/threads"] == metrics["runtime/polars_threads"] == expected
