"""`dvc repro` runs the generated pipeline in a fresh repository, and a credit change reuses the first rollout."""

import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import dvc_repo, sh

BIN = Path(sys.executable).parent

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    d = dvc_repo(tmp_path_factory.mktemp("dvcrepo"))
    sh([BIN / "dvc", "repro"], d)
    return d


def test_dvc_repro_produces_every_output(repo):
    for rel in ("results/iter_0/checkpoint/config.json", "results/iter_1/steps.parquet",
                "results/iter_1/advantages.parquet", "results/iter_1/checkpoint/model.safetensors",
                "results/iter_1/eval_metrics.json", "results/report/success_curve.png"):
        assert (repo / rel).is_file(), rel
    assert "up to date" in sh([BIN / "dvc", "status"], repo).lower()


def test_dvc_run_is_tracked_under_one_parent(repo):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("creditrl").experiment_id], max_results=100)
    parents = [r for r in runs if r.data.tags.get("creditrl.role") == "parent"]
    assert [p.data.tags["creditrl.driver"] for p in parents] == ["dvc"]
    children = sorted(r.info.run_name for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id)
    assert children == sorted(["init", "evaluate[0]", "evaluate[1]", "rollout[1]", "group[1]", "advantages[1]",
                               "update[1]", "report"])


def test_changing_the_credit_section_reuses_the_rollout(repo):
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["credit"]["episode"]["mode"] = "mean_norm"
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    status = sh([BIN / "dvc", "status"], repo)
    assert "advantages@1" in status and "rollout@1" not in status and "init" not in status


def test_switching_to_a_fitted_method_plans_its_stages_and_reuses_the_rollout(repo):
    """Issue 3, point 4 through DVC: the fit stages enter dvc.yaml (regenerated from the registry) and only what
    depends on the method is out of date."""
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["credit"]["method"] = "oprl"
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    sh([sys.executable, "-m", "pipeline.workflow.dvcgen"], repo)
    status = sh([BIN / "dvc", "status"], repo)
    stale = {line.strip().rstrip(":") for line in status.splitlines() if line and not line.startswith((" ", "\t"))}
    assert {"reward_init", "fit@1", "advantages@1"} <= stale
    assert not stale & {"init", "rollout@1", "group@1", "evaluate@0"}
