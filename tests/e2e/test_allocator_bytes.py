"""The allocator changes no output (runtime.allocator, pipeline/config/allocator.py): the shared tiny run's stages ran
with tcmalloc, and iteration 1's advantages and update rerun with the C library's malloc write the same bytes."""

import json
import shutil
import subprocess

import pytest
import yaml

from tests.conftest import SNAKEMAKE, snakemake_failure

pytestmark = pytest.mark.e2e


def allocators(run):
    """stage -> runtime/tcmalloc of iteration 1's advantages and update, from the run's metrics records."""
    out = {}
    for stage in ("advantages", "update"):
        for line in (run / "results/metrics" / f"{stage}_1.jsonl").read_text().splitlines():
            out[stage] = json.loads(line)["metrics"].get("runtime/tcmalloc", out.get(stage))
    return out


def test_the_update_writes_the_same_bytes_with_either_allocator(grpo_run, tmp_path):
    assert allocators(grpo_run) == {"advantages": 1.0, "update": 1.0}    # auto: tcmalloc, installed with vLLM
    params = yaml.safe_load((grpo_run / "params.yaml").read_text())
    d = tmp_path / "system"
    shutil.copytree(grpo_run, d, symlinks=True, ignore=shutil.ignore_patterns("mlflow.db", "mlartifacts"))
    params["runtime"].update(allocator="system", fork_server=False)   # in no stage's params: nothing reruns for it
    params["tracking"] = {"enabled": False}
    (d / "params.yaml").write_text(yaml.safe_dump(params))
    for rel in ("iter_1/advantages.parquet", "iter_1/checkpoint", "iter_1/optimizer", "metrics"):
        p = d / "results" / rel
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    r = subprocess.run([SNAKEMAKE, "results/iter_1/checkpoint", "--cores", "1"], cwd=d, capture_output=True,
                       text=True, timeout=600)
    if r.returncode != 0:
        pytest.fail(snakemake_failure(d, r))
    assert allocators(d) == {"advantages": 0.0, "update": 0.0}
    for rel in ("iter_1/advantages.parquet", "iter_1/checkpoint/model.safetensors"):
        assert (d / "results" / rel).read_bytes() == (grpo_run / "results" / rel).read_bytes(), rel
