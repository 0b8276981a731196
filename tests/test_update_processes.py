"""`runtime.update_processes`: the update stage under torchrun (gloo on the CPU) trains the weights one process
trains, each process taking a share of every minibatch, gradients summed across processes."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from pipeline.config import load_params
from pipeline.registry import STAGE_BY_NAME, processes_for

pytestmark = pytest.mark.e2e


def _update(grpo_run, d, processes: int):
    shutil.copytree(grpo_run, d, ignore=shutil.ignore_patterns("mlflow.db", "mlartifacts"))
    params = yaml.safe_load((d / "params.yaml").read_text())
    # 9-turn minibatches in micro-batches of 2: the two processes run 2 and 3 micro-batches per minibatch
    params["update"].update(epochs=2, minibatch_size=9, micro_batch_size=2)
    params["runtime"] = {"update_processes": processes}
    params["tracking"] = {"enabled": False}
    (d / "params.yaml").write_text(yaml.safe_dump(params))
    p = load_params(d / "params.yaml")
    stage = STAGE_BY_NAME["update"]
    cmd = stage.command(sys.executable, "params.yaml", "1", processes=processes_for(stage, p))
    assert ("torch.distributed.run" in cmd) == (processes > 1)
    env = {**os.environ, "CREDITRL_THREADS": "1"}
    r = subprocess.run(cmd, shell=True, cwd=d, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    records = [json.loads(x) for x in (d / "results/metrics/update_1.jsonl").read_text().splitlines()]
    losses = [x["metrics"]["update/step_loss"] for x in records if "update/step_loss" in x["metrics"]]
    return losses, load_file(d / "results/iter_1/checkpoint/model.safetensors")


def test_two_processes_train_what_one_trains(grpo_run, tmp_path):
    one, w1 = _update(grpo_run, tmp_path / "one", 1)
    two, w2 = _update(grpo_run, tmp_path / "two", 2)
    assert len(one) == len(two) >= 4
    assert one == pytest.approx(two, abs=1e-6, rel=1e-5)
    before = load_file(grpo_run / "results/iter_0/checkpoint/model.safetensors")
    moved = max(float((w1[k] - before[k]).abs().max()) for k in w1)
    assert moved > 1e-4                                          # the update changed the weights ...
    for k in w1:                                                 # ... and both runs changed them alike
        torch.testing.assert_close(w2[k], w1[k], atol=1e-6, rtol=1e-5)
