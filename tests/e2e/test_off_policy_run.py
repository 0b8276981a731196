"""One step off-policy through the workflow (`loop.off_policy_lag: 1`), on the tiny configuration with 2 iterations:
rollout 2 samples from iteration 0's checkpoint without waiting for update 1; update 2 starts from checkpoint 1 and
weighs the turns checkpoint 0 sampled (the decoupled loss). Snakemake and DVC agree before and after a switch of the
lag, and a run killed in the middle of the overlapped jobs resumes to the same bytes."""

import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from bench.overlap import job_intervals
from tests.conftest import SNAKEMAKE, dvc_repo, planned_jobs, sh, with_fork_server, workflow_files
from tests.e2e.test_resume import kill_then_resume, tree_bytes

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def lagged(tmp_path_factory):
    """The lag-1 run in a DVC repository (Snakemake's log, its folder, the bytes of its tables and weights)."""
    d = dvc_repo(tmp_path_factory.mktemp("lag"), tracking={"enabled": False}, runtime={"resources": {}},
                 loop={"iterations": 2, "off_policy_lag": 1})
    workflow_files(d)
    log = sh([SNAKEMAKE, "--cores", "2"], d)
    return d, log, tree_bytes(d / "results")


def test_rollout_does_not_wait_for_the_update_and_the_update_weighs_the_older_policys_turns(lagged):
    d, log, _ = lagged
    # Snakemake's log (read as bench.overlap reads it): rollout 2 did not wait for update 1 (it started before update
    # 1 finished; whether the two overlap or rollout 2 ran even earlier, beside rollout 1's successors, is
    # Snakemake's scheduling on 2 cores)
    jobs = job_intervals(log)
    rollout, update = jobs["rollout@2"], jobs["update@1"]
    assert rollout[0] < update[1], f"rollout@2 {rollout} waited for update@1 {update}"
    # update 1: rollout and start checkpoints are both iteration 0's; update 2: behaviour 0, proximal 1
    first, second = ((d / f"results/logs/update_{i}.log").read_text() for i in (1, 2))
    assert "behaviour" not in first
    assert "recomputing the behaviour policy's log-probs (results/iter_0/checkpoint)" in second
    weight = float(re.search(r"behaviour_weight_mean ([0-9.]+)", second).group(1))
    assert 0.5 < weight < 2.0
    assert "dvc: dvc.lock records the 13 jobs" in log
    assert "up to date" in sh([BIN / "dvc", "status"], d).lower()
    assert planned_jobs(d) == set()


def test_killed_in_the_overlapped_jobs_the_run_resumes_to_the_same_bytes(lagged, tmp_path):
    # the lag-1 run up to advantages@1 (what comes before the overlap is the same job at either lag); from there
    # Snakemake starts update 1 and rollout 2 together, and is killed once both are working
    d = tmp_path / "killed"
    shutil.copytree(lagged[0], d, ignore=shutil.ignore_patterns(".git", ".dvc", ".snakemake", "dvc.*", "logs",
                                                                "benchmarks", "metrics", "report", "iter_2"))
    for rel in ("iter_1/checkpoint", "iter_1/optimizer"):
        shutil.rmtree(d / "results" / rel, ignore_errors=True)
    for rel in ("iter_1/eval.parquet", "iter_1/eval_metrics.json"):
        (d / "results" / rel).unlink()
    assert planned_jobs(d) == {"update@1", "rollout@2", "evaluate@1", "group@2", "advantages@2", "update@2",
                               "evaluate@2", "report"}
    kill_then_resume(d, 2, [  # (stage logs, a line each prints once it is working; outputs that must not exist)
        ([("rollout_2.log", "[rollout[2]"), ("update_1.log", "recomputing log pi_old")],
         ["iter_1/checkpoint"]),
    ])
    got, want = tree_bytes(d / "results"), lagged[2]
    assert sorted(got) == sorted(want)
    assert not [k for k in want if got[k] != want[k]], "the resumed run differs from the uninterrupted one"


def test_a_switch_to_lag_zero_reruns_the_same_jobs_in_both_tools(lagged):
    d = lagged[0]
    params = yaml.safe_load((d / "params.yaml").read_text())
    params["loop"]["off_policy_lag"] = 0
    (d / "params.yaml").write_text(yaml.safe_dump(params))
    sh([sys.executable, "-m", "pipeline.workflow.dvcgen"], d)
    # iteration 1 read checkpoint 0 either way: only iteration 2's jobs (and the report) change
    again = {"rollout@2", "group@2", "advantages@2", "update@2", "evaluate@2", "report"}
    assert planned_jobs(d) == again
    out = sh(with_fork_server(BIN / "dvc", "repro"), d)
    # DVC also reruns update 1, whose declared inputs lose the behaviour checkpoint (there the start checkpoint
    # itself): it writes the same checkpoint, so nothing after it reruns
    assert {line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage '")} == \
        again | {"update@1"}
    assert planned_jobs(d) == set()
    assert "up to date" in sh([BIN / "dvc", "status"], d).lower()
    now = tree_bytes(d / "results")
    # iteration 2 now sampled by checkpoint 1: its turns and weights change; iteration 1's files stay as they were
    assert all(now[k] == lagged[2][k] for k in lagged[2] if not k.startswith("iter_2/"))
    for k in ("iter_2/steps.parquet", "iter_2/checkpoint/model.safetensors"):
        assert now[k] != lagged[2][k], k
