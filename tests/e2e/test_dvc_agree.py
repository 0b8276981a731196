"""Snakemake and DVC agree on what is stale, whichever ran last: after a Snakemake run dvc.lock describes its
outputs, after `dvc repro` Snakemake plans nothing, and code is a dependency of the stages that run it in both."""

import os
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import dvc_repo, planned_jobs, sh, with_fork_server, workflow_files

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.e2e


def dvc_plan(d) -> set[str]:
    """The stages `dvc repro --dry` would run."""
    out = sh([BIN / "dvc", "repro", "--dry"], d)
    return {line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage '")}


def stale_in_dvc(d) -> set[str]:
    out = sh([BIN / "dvc", "status"], d)
    return {line.strip().rstrip(":") for line in out.splitlines() if line and not line.startswith((" ", "\t"))}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    # the registry's threads: a rollout gets 1 where DVC alone would take every core
    d = dvc_repo(tmp_path_factory.mktemp("agree"), tracking={"enabled": False}, runtime={"resources": {}})
    workflow_files(d)
    out = sh([BIN / "snakemake", "--cores", "2"], d)
    assert "dvc: dvc.lock records the 8 jobs" in out
    return d


def test_after_snakemake_dvc_is_up_to_date_and_reruns_only_the_method(repo):
    assert "up to date" in sh([BIN / "dvc", "status"], repo).lower()
    assert planned_jobs(repo) == set()
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["credit"]["method"] = "gigpo"
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    # DVC's dry run lists the stages whose own deps changed (what follows waits on their outputs' hashes)
    assert dvc_plan(repo) == {"advantages@1"}
    assert planned_jobs(repo) == {"advantages@1", "update@1", "evaluate@1", "report"}
    # DVC reruns them; Snakemake then has nothing left to do, though it last ran them with GRPO
    out = sh(with_fork_server(BIN / "dvc", "repro"), repo)
    ran = {line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage '")}
    assert ran == {"advantages@1", "update@1", "evaluate@1", "report"}
    assert planned_jobs(repo) == set()
    assert "up to date" in sh([BIN / "dvc", "status"], repo).lower()


def test_editing_a_credit_method_marks_advantages_and_later_in_both(repo):
    module = repo / "pipeline" / "credit" / "methods" / "gigpo.py"
    rollout = repo / "pipeline" / "rollout" / "episodes.py"
    kept = {p: (p.read_text(), p.stat()) for p in (module, rollout)}
    module.write_text(module.read_text() + "\n# an edit\n")
    # Snakemake plans the stage and what follows; DVC marks the stage, and reruns what follows only where the
    # stage's outputs change (content hashes)
    assert planned_jobs(repo) == {"advantages@1", "update@1", "evaluate@1", "report"}
    assert stale_in_dvc(repo) == {"advantages@1"}
    rollout.write_text(rollout.read_text() + "\n# an edit\n")
    # evaluate plays episodes with the rollout's code too; init does not run it
    assert planned_jobs(repo) == {"rollout@1", "group@1", "advantages@1", "update@1", "evaluate@0", "evaluate@1",
                                  "report"}
    assert stale_in_dvc(repo) == {"advantages@1", "rollout@1", "evaluate@0", "evaluate@1"}
    for path, (text, stat) in kept.items():   # undo the edits, dates included, for the tests that follow
        path.write_text(text)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_every_stage_that_loads_a_model_depends_on_the_device_in_both(repo):
    dvc = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    for name in ("init", "rollout", "update", "evaluate"):
        body = dvc[name].get("do", dvc[name])
        assert "runtime.device" in body["params"], name
    assert "runtime.device" not in dvc["advantages"]["do"]["params"]


def test_a_rerun_that_changes_no_output_leaves_both_up_to_date(repo):
    # DVC runs the rollout with the threads Snakemake gave it, so it samples the same tokens
    sh(with_fork_server(BIN / "dvc", "repro", "--force", "--single-item", "rollout@1"), repo)
    assert "up to date" in sh([BIN / "dvc", "status"], repo).lower()
    assert planned_jobs(repo) == set()
    # an edit that leaves the checkpoint as it was: DVC stops after the update, and so does Snakemake, though the
    # checkpoint folder (which Snakemake cannot checksum) was written again
    update = repo / "stages" / "update.py"
    update.write_text(update.read_text() + "\n# an edit\n")
    out = sh(with_fork_server(BIN / "dvc", "repro"), repo)
    assert {line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage '")} == {"update@1"}
    assert planned_jobs(repo) == set()
