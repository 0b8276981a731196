"""Runs side by side (`run.dir`, `run.base`): a second run in its own folder reuses the base run's initial policy
and first rollout by linking them, computes only what its params change, leaves the base untouched, and is told
apart in MLflow by its folder, method and seed."""

import hashlib
import subprocess

import pytest
import yaml

from tests.conftest import SIDE_BY_SIDE, SNAKEMAKE, planned_jobs, workflow_files

pytestmark = pytest.mark.e2e


def digest(folder):
    """Hash of every file under `folder` (contents and names), following no links."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not p.is_symlink() and "logs" not in p.parts:
            h.update(str(p.relative_to(folder)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def side_by_side(grpo_run, method_runs):
    """GiGPO's run of the shared method runs: `gigpo.yaml` beside the GRPO run's params in a copy of its folder."""
    run = method_runs[SIDE_BY_SIDE]
    return run.folder, run.plan, digest(grpo_run / "results")


def test_the_second_run_plans_only_what_its_method_changes(side_by_side):
    _, plan, _ = side_by_side
    assert plan == {"advantages@1", "update@1", "rollout@2", "group@2", "advantages@2", "update@2", "evaluate@1",
                    "evaluate@2", "report"}


def test_reused_outputs_are_links_into_the_base_and_the_base_is_untouched(side_by_side):
    d, _, base_digest = side_by_side
    steps = d / "runs/gigpo/iter_1/steps.parquet"
    assert steps.is_symlink() and steps.resolve() == (d / "results/iter_1/steps.parquet").resolve()
    ck = d / "runs/gigpo/iter_0/checkpoint"
    assert ck.is_dir() and not ck.is_symlink()
    assert all(f.is_symlink() for f in ck.iterdir() if f.name != ".snakemake_timestamp")
    assert (ck / ".snakemake_timestamp").is_file() and not (ck / ".snakemake_timestamp").is_symlink()
    own = d / "runs/gigpo/iter_1/advantages.parquet"
    assert own.is_file() and not own.is_symlink()
    assert (d / "runs/gigpo/report/success_curve.csv").is_file()
    assert digest(d / "results") == base_digest        # the same bytes as the GRPO run it was copied from
    # the base is still complete and up to date for its own params
    r = subprocess.run([SNAKEMAKE, "--cores", "1", "-n"], cwd=d, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Nothing to be done" in r.stdout + r.stderr


def test_mlflow_names_and_tags_carry_the_run_folder_method_and_seed(side_by_side):
    from mlflow import MlflowClient

    d, _, _ = side_by_side
    client = MlflowClient(tracking_uri=f"sqlite:///{d / 'mlflow.db'}")
    exp = client.get_experiment_by_name("creditrl")
    folder = str((d / "runs/gigpo").resolve())
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`creditrl.run_dir` = '{folder}'")
    parents = [x for x in runs if x.data.tags["creditrl.role"] == "parent"]
    stages = [x for x in runs if x.data.tags["creditrl.role"] == "stage"]
    assert len(parents) == 1 and parents[0].info.run_name.startswith("runs/gigpo gigpo s3 snakemake")
    assert {x.info.run_name for x in stages} >= {"advantages[1]", "update[2]", "evaluate[2]", "report"}
    assert all(x.data.tags["creditrl.method"] == "gigpo" and x.data.tags["creditrl.seed"] == "3" for x in runs)


def test_the_two_runs_compare_in_one_report(side_by_side, tmp_path):
    """Both runs by their params files: the shared initial policy scores the same for both, since the second run's
    evaluation of iteration 0 is the base's."""
    import polars as pl

    from bench import compare

    d, _, _ = side_by_side
    report, summary, _ = compare.build([d / "params.yaml", d / "gigpo.yaml"], tmp_path)
    assert sorted(summary["method"].to_list()) == ["gigpo", "grpo"] and report.is_file()
    curves = pl.read_csv(tmp_path / "compare_curves.csv")
    assert set(curves["run"].to_list()) == {"results", "runs/gigpo"}
    at0 = curves.filter(pl.col("iteration") == 0).sort("run")["success_rate"].to_list()
    assert at0[0] == at0[1]


def test_a_run_continued_from_a_finished_one_plans_only_its_new_iteration(grpo_run, tmp_path):
    """The GRPO run's params with a third iteration, in another folder, its base the finished two-iteration run
    through its last iteration: every job of the base is reused, the updates and their checkpoints too (a linked
    checkpoint dated by the base's timestamp looked older than the links to its own inputs, and Snakemake planned
    every job from update 1 on again)."""
    workflow_files(tmp_path)
    params = yaml.safe_load((grpo_run / "params.yaml").read_text())
    params["loop"]["iterations"] = 3
    params["run"] = {"dir": "results", "base": {"params": str(grpo_run / "params.yaml"), "through": 2}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    new = {"rollout@3", "group@3", "advantages@3", "update@3", "evaluate@3", "report"}
    assert planned_jobs(tmp_path) == new
    assert planned_jobs(tmp_path) == new        # linking again on the next call leaves the dates as they were
    assert (tmp_path / "results/iter_2/checkpoint").is_dir()


def test_a_reused_update_whose_optimiser_state_the_base_deleted_runs_here(grpo_run, tmp_path):
    """The finished two-iteration run keeps only iteration 2's optimiser state (`runtime.keep_optimizer: last`), so a
    run of the same params that reuses it through iteration 1 cannot resume update 2 from a reused update 1: update
    1 runs here (it started from no state) and what follows it; its rollout, groups and advantages are reused."""
    from pipeline.workflow.runs import RESUMED_STATE
    from stages import update

    assert RESUMED_STATE["update"] == update.OPTIMIZER
    assert not (grpo_run / "results/iter_1/optimizer/policy.pt").exists()
    assert (grpo_run / "results/iter_2/optimizer/policy.pt").is_file()
    workflow_files(tmp_path)
    params = yaml.safe_load((grpo_run / "params.yaml").read_text())
    params["run"] = {"dir": "results", "base": {"params": str(grpo_run / "params.yaml"), "through": 1}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    assert planned_jobs(tmp_path) == {"update@1", "evaluate@1", "rollout@2", "group@2", "advantages@2", "update@2",
                                      "evaluate@2", "report"}
    assert (tmp_path / "results/iter_1/advantages.parquet").is_symlink()
    assert not (tmp_path / "results/iter_1/checkpoint").exists()
