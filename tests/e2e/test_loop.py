"""End to end: the real Snakefile on a tiny configuration, 2 iterations."""

import json
import subprocess

import polars as pl
import pytest

from pipeline.data import tables
from tests.conftest import SNAKEMAKE


@pytest.fixture(scope="module")
def run_dir(grpo_run):
    return grpo_run


pytestmark = pytest.mark.e2e


def test_tables_match_their_schemas(run_dir):
    for it in (1, 2):
        steps = tables.read_table(run_dir / f"results/iter_{it}/steps.parquet", tables.STEPS)
        assert steps["iteration"].unique().to_list() == [it]
        assert steps["episode_id"].n_unique() == 2 * 3  # 2 tasks x group size 3
        assert steps["task_group"].n_unique() == 2
        assert (steps["response_ids"].list.len() == steps["response_logprobs"].list.len()).all()
        per_ep = steps.group_by("episode_id").agg(pl.col("reward").sum(), pl.col("episode_return").first(),
                                                 pl.len(), pl.col("episode_length").first())
        assert (per_ep["reward"] - per_ep["episode_return"]).abs().max() < 1e-9
        assert (per_ep["len"] == per_ep["episode_length"]).all() and per_ep["len"].max() <= 4
        groups = tables.read_table(run_dir / f"results/iter_{it}/groups.parquet", tables.GROUPS)
        assert groups.height == steps.height
        adv = tables.read_table(run_dir / f"results/iter_{it}/advantages.parquet", tables.ADVANTAGES)
        assert adv.height == steps.height and adv["advantage"].is_finite().all()
    for it in (0, 1, 2):
        ev = tables.read_table(run_dir / f"results/iter_{it}/eval.parquet", tables.EVAL_EPISODES)
        assert ev.height == 8 and ev["iteration"].unique().to_list() == [it]   # 4 tasks x 2 episodes
        assert ev["task_id"].value_counts()["count"].to_list() == [2] * 4
        assert ev["task_id"].min() >= 900_000_000  # held-out seeds
        m = json.loads((run_dir / f"results/iter_{it}/eval_metrics.json").read_text())
        assert m["episodes"] == 8 and m["success_rate"] == pytest.approx(ev["success"].mean())
        assert (run_dir / f"results/benchmarks/evaluate_{it}.tsv").is_file()
    curve = pl.read_csv(run_dir / "results/report/success_curve.csv")
    assert curve["iteration"].to_list() == [0, 1, 2]
    assert (run_dir / "results/report/success_curve.png").read_bytes()[:4] == b"\x89PNG"
    # by solution length: the held-out rooms' buckets hold each evaluation's 8 episodes, and iteration 0 is the start
    dif = pl.read_csv(run_dir / "results/report/success_by_difficulty.csv")
    for it in (0, 1, 2):
        ev = tables.read_table(run_dir / f"results/iter_{it}/eval.parquet", tables.EVAL_EPISODES)
        rows = dif.filter(pl.col("iteration") == it)
        assert rows["episodes"].sum() == 8 and rows["successes"].sum() == ev["success"].sum()
        assert {str(d) for d in rows["difficulty"]} == {str(m) for m in ev["optimal_moves"].unique().to_list()}
    assert dif.filter(pl.col("iteration") == 0)[["tasks_up", "tasks_down"]].sum().row(0) == (0, 0)
    assert (run_dir / "results/report/success_by_difficulty.png").read_bytes()[:4] == b"\x89PNG"


def test_checkpoints_load_through_auto_classes(run_dir):
    from pipeline.model.policy import encode_prompt, load_policy

    steps = tables.read_table(run_dir / "results/iter_2/steps.parquet", tables.STEPS).head(5)
    for it in (0, 1, 2):
        model, tok = load_policy(run_dir / f"results/iter_{it}/checkpoint")
        assert tok.eos_token == "<eos>" and model.config.model_type == "llama"
        # the reloaded tokenizer gives the ids the rollout recorded (no class swap on reload)
        for prompt, ids in zip(steps["prompt"], steps["prompt_ids"]):
            assert encode_prompt(tok, prompt) == ids.to_list()
    # one optimiser state, the last update's, beside (not in) its checkpoint (runtime.keep_optimizer: last)
    assert [p.relative_to(run_dir).as_posix() for p in run_dir.glob("results/**/*.pt")] == \
        ["results/iter_2/optimizer/policy.pt"]
    assert not list(run_dir.glob("results/**/.*.tmp-*"))


def test_mlflow_has_one_parent_and_a_child_per_stage_and_iteration(run_dir):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("creditrl")
    runs = client.search_runs([exp.experiment_id], max_results=200)
    parents = [r for r in runs if r.data.tags.get("creditrl.role") == "parent"]
    assert len(parents) == 1
    parent = parents[0]
    assert parent.data.tags["creditrl.driver"] == "snakemake" and parent.info.status == "FINISHED"
    children = sorted(r.info.run_name for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id)
    expected = ["init", "evaluate[0]", "evaluate[1]", "evaluate[2]", "report"]
    expected += [f"{s}[{i}]" for s in ("rollout", "group", "advantages", "update") for i in (1, 2)]
    assert children == sorted(expected)
    history = client.get_metric_history(parent.info.run_id, "eval/success_rate")
    assert sorted(m.step for m in history) == [0, 1, 2]
    assert parent.data.params["rollout.group_size"] == "3"
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {"success_curve.csv", "success_curve.png",
                                                                          "success_by_difficulty.png"}


def test_rerun_has_nothing_to_do(run_dir):
    r = subprocess.run([SNAKEMAKE, "--cores", "1", "-n"], cwd=run_dir, capture_output=True, text=True)
    assert r.returncode == 0 and "Nothing to be done" in (r.stdout + r.stderr)


def test_evaluate_every_2_plans_and_reports_iterations_0_and_2_only(run_dir, tmp_path):
    """`evaluate.every: 2` over 2 iterations: the evaluation's fingerprint changes, so Snakemake plans it again at
    iterations 0 and 2 and never at 1; kept as it is (mtime and input triggers only), the report is the one job and
    its curve has the two points."""
    import shutil

    import yaml

    from tests.conftest import planned_jobs

    d = tmp_path / "run"
    shutil.copytree(run_dir, d, symlinks=True, ignore=shutil.ignore_patterns("mlflow.db", "mlartifacts"))
    params = yaml.safe_load((d / "params.yaml").read_text())
    params["evaluate"]["every"] = 2
    params["tracking"] = {"enabled": False}
    (d / "params.yaml").write_text(yaml.safe_dump(params))
    for f in d.glob("results/iter_1/eval*"):
        f.unlink()
    shutil.rmtree(d / "results/report")
    assert planned_jobs(d) == {"evaluate@0", "evaluate@2", "report"}
    r = subprocess.run([SNAKEMAKE, "--cores", "1", "--quiet", "--rerun-triggers", "mtime", "input"], cwd=d,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (d / "results/iter_1/eval.parquet").exists()
    curve = pl.read_csv(d / "results/report/success_curve.csv")
    assert curve["iteration"].to_list() == [0, 2]
    evals = [json.loads((d / f"results/iter_{i}/eval_metrics.json").read_text())["success_rate"] for i in (0, 2)]
    assert curve["success_rate"].to_list() == pytest.approx(evals)
