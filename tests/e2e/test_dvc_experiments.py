"""DVC on the tiny configuration, in one fresh repository: `dvc repro` runs the generated pipeline (every output,
one MLflow parent run); `dvc exp run -S credit.method=gigpo` reruns only what the method changes, and `dvc exp show`
lists each experiment's final success and oracle credit AUC from the report's metrics file (declared as DVC metrics
in the generated dvc.yaml, with the success curve as a DVC plot); a credit change, or a switch to a fitted method,
leaves the rollout up to date."""

import csv
import io
import json
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import dvc_repo, sh, with_fork_server

BIN = Path(sys.executable).parent
GIT = ["git", "-c", "user.name=test", "-c", "user.email=test@example.invalid"]

pytestmark = pytest.mark.e2e


def mlflow_runs(d: Path) -> tuple[list[str], list[str]]:
    """The drivers of the parent runs in d's MLflow store, and the names of the first parent's children."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{d / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("creditrl").experiment_id], max_results=100)
    parents = [r for r in runs if r.data.tags.get("creditrl.role") == "parent"]
    children = [r.info.run_name for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    return [p.data.tags["creditrl.driver"] for p in parents], sorted(children)


@pytest.fixture(scope="module")
def experiments(tmp_path_factory):
    # a warm start long enough that the policy plays valid moves, some of them good: the oracle has turns to rank
    d = dvc_repo(tmp_path_factory.mktemp("dvcexp"),
                 warmstart={"episodes": 100, "steps": 240, "clean_steps": 240, "batch_size": 16})
    sh(with_fork_server(BIN / "dvc", "repro"), d)
    repro = {"status": sh([BIN / "dvc", "status"], d), "mlflow": mlflow_runs(d)}
    sh([*GIT, "add", "-A"], d)
    sh([*GIT, "commit", "-qm", "baseline"], d)
    log = sh(with_fork_server(BIN / "dvc", "exp", "run", "-S", "credit.method=gigpo", "-n", "gigpo"), d)
    table = sh([BIN / "dvc", "exp", "show", "--csv", "--no-pager"], d)
    return d, log, list(csv.DictReader(io.StringIO(table))), repro


def test_dvc_repro_produces_every_output_under_one_mlflow_parent(experiments):
    d, _, _, repro = experiments
    for rel in ("results/iter_0/checkpoint/config.json", "results/iter_1/steps.parquet",
                "results/iter_1/advantages.parquet", "results/iter_1/checkpoint/model.safetensors",
                "results/iter_1/eval_metrics.json", "results/report/success_curve.png"):
        assert (d / rel).is_file(), rel
    assert "up to date" in repro["status"].lower()
    drivers, children = repro["mlflow"]
    assert drivers == ["dvc"]
    assert children == sorted(["init", "evaluate[0]", "evaluate[1]", "rollout[1]", "group[1]", "advantages[1]",
                               "update[1]", "report"])


def test_an_experiment_reruns_only_what_the_method_changes(experiments):
    _, log, _, _ = experiments
    for kept in ("init", "rollout@1", "group@1", "evaluate@0"):
        assert f"Stage '{kept}' didn't change, skipping" in log, kept
    for rerun in ("advantages@1", "update@1", "evaluate@1", "report"):
        assert f"Running stage '{rerun}'" in log, rerun


def test_exp_show_lists_final_success_and_credit_auc_per_experiment(experiments):
    d, _, rows, _ = experiments
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


def test_changing_the_credit_section_reuses_the_rollout(experiments):
    d = experiments[0]
    params = yaml.safe_load((d / "params.yaml").read_text())
    params["credit"]["episode"]["mode"] = "mean_norm"
    (d / "params.yaml").write_text(yaml.safe_dump(params))
    status = sh([BIN / "dvc", "status"], d)
    assert "advantages@1" in status and "rollout@1" not in status and "init" not in status


def test_switching_to_a_fitted_method_plans_its_stages_and_reuses_the_rollout(experiments):
    """The fit stages enter dvc.yaml (regenerated from the registry) and only what depends on the method is out of
    date."""
    d = experiments[0]
    params = yaml.safe_load((d / "params.yaml").read_text())
    params["credit"]["method"] = "oprl"
    (d / "params.yaml").write_text(yaml.safe_dump(params))
    sh([sys.executable, "-m", "pipeline.workflow.dvcgen"], d)
    status = sh([BIN / "dvc", "status"], d)
    stale = {line.strip().rstrip(":") for line in status.splitlines() if line and not line.startswith((" ", "\t"))}
    assert {"reward_init", "fit@1", "advantages@1"} <= stale
    assert not stale & {"init", "rollout@1", "group@1", "evaluate@0"}
