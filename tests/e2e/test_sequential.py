"""`bench.sequential`: the loop's jobs without Snakemake (how the SmolLM2 config ran on a GPU machine that has no
workflow tools). It must run the jobs Snakemake would, with the same command lines, so a job it reruns writes the
same numbers, and its benchmark files must read like Snakemake's."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from bench import breakdown
from bench.sequential import job_name, plan
from pipeline.config.params import load_params
from tests.conftest import ROOT, planned_jobs, workflow_files

pytestmark = pytest.mark.e2e


def sequential(d, *args):
    r = subprocess.run([sys.executable, "-m", "bench.sequential", "--params", "params.yaml", *args], cwd=d,
                       capture_output=True, text=True, timeout=600, env=os.environ | {"PYTHONPATH": str(ROOT)})
    return r


def test_reruns_what_snakemake_would_and_gets_the_same_numbers(grpo_run, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(grpo_run, d, symlinks=True)
    before = json.loads((d / "results/iter_2/eval_metrics.json").read_text())
    for f in ("iter_2/eval_metrics.json", "iter_2/eval.parquet", "report"):
        p = d / "results" / f
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    assert planned_jobs(d) == {"evaluate@2", "report"}

    r = sequential(d)
    assert r.returncode == 0, r.stderr[-3000:]
    done = json.loads((d / "results/benchmarks/sequential.json").read_text())
    assert [j["job"] for j in done["jobs"]] == ["evaluate@2", "report"]
    assert json.loads((d / "results/iter_2/eval_metrics.json").read_text()) == before
    assert (d / "results/report/metrics.json").is_file()
    assert planned_jobs(d) == set()
    # its benchmark file replaced Snakemake's for that job, and the breakdown reads it like the others
    rows = breakdown.collect(d / "results").filter(stage="evaluate", iteration=2)
    assert rows.height == 1 and rows["wall_s"][0] == pytest.approx(done["jobs"][0]["wall_s"], abs=0.01)
    assert rows["max_rss_mb"][0] > 50


def test_stop_after_ends_before_the_next_iteration(tmp_path):
    params = yaml.safe_load((ROOT / "tests" / "tiny_params.yaml").read_text()) | {"tracking": {"enabled": False}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    r = sequential(tmp_path, "--stop-after", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    done = json.loads((tmp_path / "results/benchmarks/sequential.json").read_text())
    assert [j["job"] for j in done["jobs"]] == ["init", "evaluate@0"]
    assert done["stopped_before_iteration"] == 1
    assert "iteration 1 not started" in r.stdout
    assert not (tmp_path / "results/iter_1").exists() and not (tmp_path / "results/report").exists()


def test_a_failing_job_stops_the_run_with_its_log(tmp_path):
    params = yaml.safe_load((ROOT / "tests" / "tiny_params.yaml").read_text()) | {"tracking": {"enabled": False}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    (tmp_path / "results/iter_0/checkpoint").mkdir(parents=True)   # init's output there: init is skipped
    r = sequential(tmp_path)
    assert r.returncode == 1
    assert "evaluate@0 failed (exit 1)" in r.stdout
    done = json.loads((tmp_path / "results/benchmarks/sequential.json").read_text())
    assert [(j["job"], j["rc"]) for j in done["jobs"]] == [("evaluate@0", 1)]


def test_plans_the_jobs_snakemake_plans_with_shards(tmp_path):
    """Sharded rollouts and evaluations: one job per shard, then the merge, as Snakemake's dry run lists them."""
    workflow_files(tmp_path)
    params = yaml.safe_load((ROOT / "tests" / "tiny_params.yaml").read_text()) | {"tracking": {"enabled": False}}
    params["rollout"] |= {"shards": 2, "batch_size": 6, "tasks_per_iteration": 4}
    params["evaluate"] |= {"shards": 2}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    jobs = [job_name(*j) for j in plan(load_params(tmp_path / "params.yaml"))]
    assert jobs[:4] == ["init", "evaluate_shard@0-0", "evaluate_shard@0-1", "evaluate@0"]
    assert jobs[4:7] == ["rollout_shard@1-0", "rollout_shard@1-1", "rollout@1"]
    assert set(jobs) == planned_jobs(tmp_path) and len(jobs) == len(set(jobs))
