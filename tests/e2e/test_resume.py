"""Kill and resume, determinism, non-finite numbers, on the tiny configuration.

- Determinism: the same stage run twice on the same inputs (and thread count) writes byte-identical tables and
  weights.
- Kill and resume: an OPRL run from GRPO's iteration 0 is SIGKILLed (Snakemake and its job together) in the middle
  of rollout@1, fit@2 and update@2 (which resume AdamW from iteration 1's optimiser state); each kill leaves nothing
  under the stage's final output names, and after `snakemake --unlock` the plain command finishes the run. Every
  table and checkpoint then equals, byte for byte, those of the uninterrupted OPRL run of the shared `method_runs`
  fixture (same params and seed).
- A NaN reward or advantage stops the advantages or update stage naming the iteration and the task group, and
  nothing is written.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
import yaml

from pipeline.data.tables import ADVANTAGES, STEPS, write_table
from tests.conftest import ROOT, SNAKEMAKE, snakemake_failure, workflow_files

pytestmark = pytest.mark.e2e


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("mlflow.db", "mlartifacts", ".snakemake"))
    params = yaml.safe_load((dst / "params.yaml").read_text())
    params["tracking"] = {"enabled": False}
    (dst / "params.yaml").write_text(yaml.safe_dump(params))
    return dst


def stage(d: Path, name: str, it: int | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", f"stages.{name}", "--params", "params.yaml"]
    if it is not None:
        cmd += ["--iteration", str(it)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CREDITRL_THREADS": "1"}
    return subprocess.run(cmd, cwd=d, capture_output=True, text=True, timeout=600, env=env)


def test_same_inputs_give_byte_identical_rollouts_and_checkpoints(grpo_run, tmp_path):
    runs = []
    for k in range(2):
        d = copy_run(grpo_run, tmp_path / f"run{k}")
        shutil.rmtree(d / "results" / "iter_1" / "checkpoint")
        (d / "results" / "iter_1" / "steps.parquet").unlink()
        for name in ("rollout", "group", "advantages", "update"):
            r = stage(d, name, 1)
            assert r.returncode == 0, r.stderr[-3000:]
        runs.append(d / "results" / "iter_1")
    a, b = runs
    for rel in ("steps.parquet", "groups.parquet", "advantages.parquet", "checkpoint/model.safetensors"):
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    # the thread count is part of the contract: the fixture's rollout ran with 2 threads, and CPU reductions split
    # over 2 threads round differently in the last bits of the log-probs
    fixture = pl.read_parquet(grpo_run / "results/iter_1/steps.parquet")
    mine = pl.read_parquet(a / "steps.parquet")
    assert mine.drop("response_logprobs").equals(fixture.drop("response_logprobs"))


def test_nan_reward_stops_advantages_and_nan_advantage_stops_update(grpo_run, tmp_path):
    d = copy_run(grpo_run, tmp_path / "run")
    it1 = d / "results" / "iter_1"
    steps = pl.read_parquet(it1 / "steps.parquet")
    victim = steps.row(3, named=True)
    write_table(steps.with_columns(pl.when(pl.int_range(pl.len()) == 3).then(float("nan"))
                                   .otherwise(pl.col("reward")).alias("reward")), it1 / "steps.parquet", STEPS)
    advantages = it1 / "advantages.parquet"
    kept = pl.read_parquet(advantages)
    advantages.unlink()
    r = stage(d, "advantages", 1)
    assert r.returncode == 1
    assert (f"error in stage advantages (iteration 1): {Path('results/iter_1/steps.parquet')}: column 'reward' holds "
            f"nan at episode_id {victim['episode_id']}, step {victim['step']} (first of 1 such rows); expected finite "
            "numbers") in r.stderr
    assert not advantages.exists() and not list(it1.glob(".advantages.parquet.tmp-*"))

    write_table(steps, it1 / "steps.parquet", STEPS)
    write_table(kept.with_columns(pl.when(pl.int_range(pl.len()) == 5).then(float("inf"))
                                  .otherwise(pl.col("advantage")).alias("advantage")), advantages, ADVANTAGES)
    shutil.rmtree(it1 / "checkpoint")
    r = stage(d, "update", 1)
    bad = kept.row(5, named=True)
    assert r.returncode == 1
    assert (f"advantages.parquet: column 'advantage' holds inf at episode_id {bad['episode_id']}, step "
            f"{bad['step']} (first of 1 such rows)") in r.stderr
    assert not (it1 / "checkpoint").exists() and not list(it1.glob(".checkpoint.tmp-*"))


def wait_for(path: Path, marker: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and marker in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise AssertionError(f"snakemake ended (status {proc.returncode}) before {path} showed {marker!r}")
        time.sleep(0.05)
    raise AssertionError(f"{path} never showed {marker!r}")


def kill_then_resume(d: Path, cores: int, kills: list[tuple[list[tuple[str, str]], list[str]]]) -> None:
    """For each (marks, outs) of `kills`: start Snakemake in `d`, SIGKILL it with its jobs once every stage log of
    `marks` shows its line, check that none of `outs` (under results/) exists, unlock. Then finish the run with the
    plain command; the test fails with the stages' logs if it does not."""
    results = d / "results"
    for marks, outs in kills:
        proc = subprocess.Popen([SNAKEMAKE, "--cores", str(cores), "--quiet"], cwd=d, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        for log, marker in marks:
            wait_for(results / "logs" / log, marker, proc)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for o in outs:
            assert not (results / o).exists(), \
                f"{o} exists after a SIGKILL in {', '.join(log[:-4] for log, _ in marks)}"
        assert subprocess.run([SNAKEMAKE, "--unlock"], cwd=d, capture_output=True).returncode == 0
    r = subprocess.run([SNAKEMAKE, "--cores", str(cores), "--quiet"], cwd=d, capture_output=True, text=True,
                       timeout=900)
    if r.returncode != 0:
        pytest.fail(snakemake_failure(d, r))


def tree_bytes(results: Path) -> dict[str, bytes]:
    """Every table and weight file of the iterations (logs, benchmarks and metrics hold times; left out)."""
    out = {}
    for p in sorted(results.glob("iter_*/**/*")):
        if p.is_file() and p.suffix in (".parquet", ".safetensors", ".json") and "eval_metrics" not in p.name:
            out[str(p.relative_to(results))] = p.read_bytes()
    return out


def test_killed_anywhere_the_run_resumes_to_identical_tables(grpo_run, method_runs, tmp_path):
    reference = method_runs["oprl"].folder
    d = tmp_path / "killed"
    d.mkdir()
    workflow_files(d)
    params = yaml.safe_load((ROOT / "tests" / "tiny_params.yaml").read_text())
    params["credit"] = {"method": "oprl"}
    params["tracking"] = {"enabled": False}
    (d / "params.yaml").write_text(yaml.safe_dump(params))
    results = d / "results"
    # iteration 0 (init, evaluate@0) is GRPO's, as in the reference run: the kills start from there
    shutil.copytree(grpo_run / "results/iter_0", results / "iter_0")
    kill_then_resume(d, 1, [  # (stage logs, a line each prints once it is working; outputs that must not exist)
        ([("rollout_1.log", "[rollout[1]")], ["iter_1/steps.parquet"]),
        ([("fit_2.log", "[fit[2]")], ["iter_2/reward_model", "iter_2/step_rewards.parquet"]),
        ([("update_2.log", "recomputing log pi_old")], ["iter_2/checkpoint"]),
    ])
    assert not list(results.glob("**/.*.tmp-*"))                 # no temporaries left behind either
    got, want = tree_bytes(results), tree_bytes(reference / "results")
    assert sorted(got) == sorted(want)
    different = [k for k in want if got[k] != want[k]]
    assert not different, f"resumed run differs from the uninterrupted one in {different}"
    assert sorted(p.relative_to(results).as_posix() for p in results.glob("**/*.pt")) == \
        ["iter_2/optimizer/policy.pt", "iter_2/optimizer/reward_model.pt"]


def test_stages_finish_without_mlflow_and_sync_later(grpo_run, tmp_path):
    d = copy_run(grpo_run, tmp_path / "run")
    params = yaml.safe_load((d / "params.yaml").read_text())
    params["tracking"] = {"enabled": True}                   # the default store: mlflow.db at the root
    (d / "params.yaml").write_text(yaml.safe_dump(params))
    (d / "mlflow.db").write_bytes(b"this is not an SQLite database" * 100)   # a broken store
    r = stage(d, "group", 1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MLflow tracking unavailable" in r.stderr and "pipeline.workflow.tracking sync" in r.stderr
    metrics = d / "results" / "metrics" / "group_1.jsonl"
    logged = [json.loads(line) for line in metrics.read_text().splitlines()]
    share = next(rec["metrics"] for rec in logged if "group/share_turns_in_nonsingleton" in rec["metrics"])
    assert (d / "results" / "metrics" / "group_1.unsynced").exists()

    (d / "mlflow.db").unlink()                               # the store is back
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "pipeline.workflow.tracking", "sync", "--params", "params.yaml"], cwd=d,
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "synced 1 stage(s)" in r.stdout, r.stderr[-3000:]
    assert not (d / "results" / "metrics" / "group_1.unsynced").exists()
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{d / 'mlflow.db'}")
    exp = client.get_experiment_by_name("creditrl")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"group_1", next(n for n in runs if n.startswith("sync "))}
    got = runs["group_1"].data.metrics["group/share_turns_in_nonsingleton"]
    assert got == pytest.approx(share["group/share_turns_in_nonsingleton"])
