"""The real SLURM executor plugin, end to end: `snakemake --profile profiles/slurm` on the tiny configuration with
stand-ins for sbatch, squeue, sacct, scancel and srun on PATH (tests/fakeslurm) that run each job on this machine
and report its state as SLURM does. The jobs submitted carry the resources their rules declare."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, SNAKEMAKE, workflow_files

pytestmark = pytest.mark.e2e
TOOLS = ("sbatch", "squeue", "sacct", "scancel", "srun", "sinfo", "scontrol")


def test_slurm_profile_runs_the_sharded_rollout(tmp_path):
    import snakemake_executor_plugin_slurm  # noqa: F401  the cluster extra, which the README's test command installs
    work = tmp_path / "work"
    work.mkdir()
    workflow_files(work)
    for name in ("pipeline", "stages"):      # the code, on the "shared filesystem" the jobs run in
        shutil.copytree(ROOT / name, work / name, ignore=shutil.ignore_patterns("__pycache__"))
    params = yaml.safe_load((ROOT / "tests" / "tiny_params.yaml").read_text())
    params["rollout"].update(batch_size=3, shards=2)
    params["tracking"] = {"enabled": False}
    params["runtime"] = {"resources": {"rollout": {"mem_mb": 3000, "runtime": 17, "threads": 2}}}
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    # the initial policy made beforehand by the init stage (Snakemake takes it as made), so that only the rollout's
    # jobs go through SLURM; its own init, not the shared tiny run's, keeps this test off that run's busy worker
    init = subprocess.run([sys.executable, "-m", "stages.init", "--params", "params.yaml"], cwd=work,
                          capture_output=True, text=True, timeout=300)
    assert init.returncode == 0, init.stderr[-3000:]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        (bin_dir / tool).symlink_to(ROOT / "tests" / "fakeslurm" / "fakeslurm.py")
    state = tmp_path / "slurm"
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "FAKE_SLURM_DIR": str(state)}
    r = subprocess.run([SNAKEMAKE, "--profile", "profiles/slurm", "--slurm-init-seconds-before-status-checks", "1",
                        "--seconds-between-status-checks", "1",
                        "results/iter_1/steps.parquet"], cwd=work, env=env, capture_output=True, text=True,
                       timeout=900)
    jobs = [json.loads(p.read_text()) for p in sorted((state / "jobs").glob("*.json"))]
    logs = "\n".join(Path(j["output"]).read_text()[-1500:] for j in jobs if Path(j["output"]).is_file())
    assert r.returncode == 0, r.stderr[-4000:] + logs
    by_rule = {j["comment"]: j for j in jobs}
    assert set(by_rule) == {"rule_rollout_shard_wildcards_1_0", "rule_rollout_shard_wildcards_1_1",
                            "rule_rollout_wildcards_1"}
    assert all(j["state"] == "COMPLETED" for j in jobs)

    def asked(rule):
        a = by_rule[rule]["args"]
        return a[a.index("--mem") + 1], a[a.index("-t") + 1], next(x for x in a if x.startswith("--cpus-per-task"))

    assert asked("rule_rollout_shard_wildcards_1_0") == ("3000", "17", "--cpus-per-task=2")   # runtime.resources
    assert asked("rule_rollout_wildcards_1") == ("2000", "30", "--cpus-per-task=1")            # the merge's own
    assert not any(a.startswith("--gpus") for j in jobs for a in j["args"])                    # a CPU run
    assert (work / "results/iter_1/shards/rollout_1.parquet").is_file()
    steps = __import__("polars").read_parquet(work / "results/iter_1/steps.parquet")
    assert steps["episode_id"].n_unique() == 2 * 3
