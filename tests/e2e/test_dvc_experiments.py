"""DVC experiments on the tiny configuration: `dvc exp run -S credit.method=gigpo` reruns only what the method
changes, and `dvc exp show` lists each experiment's final success and oracle credit AUC from the report's metrics
file (declared as DVC metrics in the generated dvc.yaml, with the success curve as a DVC plot)."""

import csv
import io
import json
import sys
from pathlib import Path

import pytest

from tests.conftest import dvc_repo, sh

BIN = Path(sys.executable).parent
GIT = ["git", "-c", "user.name=test", "-c", "user.email=test@example.invalid"]

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def experiments(tmp_path_factory):
    # a warm start long enough that the policy plays valid moves, some of them good: the oracle has turns to rank
    d = dvc_repo(tmp_path_factory.mktemp("dvcexp"), tracking={"enabled": False},
                 warmstart={"episodes": 100, "steps": 240, "clean_steps": 240, "batch_size": 16})
    sh([BIN / "dvc", "repro"], d)
    sh([*GIT, "add", "-A"], d)
    sh([*GIT, "commit", "-qm", "baseline"], d)
    log = sh([BIN / "dvc", "exp", "run", "-S", "credit.method=gigpo", "-n", "gigpo"], d)
    table = sh([BIN / "dvc", "exp", "show", "--csv", "--no-pager"], d)
    return d, log, list(csv.DictReader(io.StringIO(table)))


def test_an_experiment_reruns_only_what_the_method_changes(experiments):
    _, log, _ = experiments
    for kept in ("init", "rollout@1", "group@1", "evaluate@0"):
        assert f"Stage '{kept}' didn't change, skipping" in log, kept
    for rerun in ("advantages@1", "update@1", "evaluate@1", "report"):
        assert f"Running stage '{rerun}'" in log, rerun


def test_exp_show_lists_final_success_and_credit_auc_per_experiment(experiments):
    d, _, rows = experiments
    by_name = {r["Experiment"]: r for r in rows}
    gigpo = by_name["gigpo"]
    assert gigpo["credit.method"] == "gigpo"
    baseline = next(r for r in rows if r["credit.method"] == "grpo")
    metrics = json.loads((d / "results/report/metrics.json").read_text())   # the workspace holds gigpo's run
    assert float(gigpo["success_final"]) == pytest.approx(metrics["success_final"])
    assert float(gigpo["credit_step_signal"]) == pytest.approx(metrics["credit_step_signal"]) and \
        metrics["credit_step_signal"] > 0                          # GiGPO's anchor groups give turns a step term
    assert float(baseline["credit_step_signal"]) == 0.0             # GRPO has none
    for r in (gigpo, baseline):
        assert r["success_final"] != "" and r["credit_auc"] != ""
