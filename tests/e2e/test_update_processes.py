"""`runtime.update_processes`: the update stage under torchrun (gloo on the CPU) trains the weights one process
trains, each process taking a share of every minibatch, gradients summed across processes, whether each process
holds the whole model (`runtime.update_sharding: replicate`) or a shard of it (`fsdp`)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from pipeline.config.params import load_params
from pipeline.workflow.registry import STAGE_BY_NAME, processes_for

pytestmark = pytest.mark.e2e


def _update(grpo_run, d, processes: int, sharding: str = "replicate", iteration: int = 1,
            old_logprobs: str = "recompute"):
    """Run the update of `iteration` in `d` (a copy of the shared tiny run, made for iteration 1); its step losses,
    its checkpoint's weights and the stage's output."""
    if iteration == 1:
        shutil.copytree(grpo_run, d, ignore=shutil.ignore_patterns("mlflow.db", "mlartifacts"))
    params = yaml.safe_load((d / "params.yaml").read_text())
    # minibatches of at most 9 turns in micro-batches of 2: on a 9-turn minibatch the two processes run 2 and 3
    params["update"].update(epochs=2, minibatch_size=9, micro_batch_size=2, old_logprobs=old_logprobs)
    params["runtime"] = {"update_processes": processes, "update_sharding": sharding}
    params["tracking"] = {"enabled": False}
    (d / "params.yaml").write_text(yaml.safe_dump(params))
    p = load_params(d / "params.yaml")
    stage = STAGE_BY_NAME["update"]
    cmd = stage.command(sys.executable, "params.yaml", str(iteration), processes=processes_for(stage, p))
    assert ("torch.distributed.run" in cmd) == (processes > 1)
    env = {**os.environ, "CREDITRL_THREADS": "1"}
    r = subprocess.run(cmd, shell=True, cwd=d, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    records = [json.loads(x) for x in (d / f"results/metrics/update_{iteration}.jsonl").read_text().splitlines()]
    losses = [x["metrics"]["update/step_loss"] for x in records if "update/step_loss" in x["metrics"]]
    return losses, load_file(d / f"results/iter_{iteration}/checkpoint/model.safetensors"), r.stdout + r.stderr


def _assert_same(w2, w1):
    assert w2.keys() == w1.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def one_process(grpo_run, tmp_path_factory):
    """Iteration 1's update in one process, recomputing log pi_old: what both tests compare against (its folder,
    step losses, weights and output; the losses and weights are read here, before the first test continues the
    folder to iteration 2)."""
    d = tmp_path_factory.mktemp("update_processes") / "one"
    return (d, *_update(grpo_run, d, 1))


def test_two_processes_train_what_one_trains(grpo_run, one_process, tmp_path):
    d_one, one, w1, _ = one_process
    before = load_file(grpo_run / "results/iter_0/checkpoint/model.safetensors")
    moved = max(float((w1[k] - before[k]).abs().max()) for k in w1)
    assert moved > 1e-4                                          # the update changed the weights ...
    state1 = torch.load(d_one / "results/iter_1/optimizer/policy.pt", weights_only=True)
    for sharding in ("replicate", "fsdp"):
        two, w2, log = _update(grpo_run, tmp_path / sharding, 2, sharding)
        assert ("FSDP: each of 2 processes holds 1/2" in log) == (sharding == "fsdp")
        assert len(one) == len(two) >= 4
        assert one == pytest.approx(two, abs=1e-6, rel=1e-5), sharding
        _assert_same(w2, w1)                                     # ... and every run changed them alike
        # the AdamW moments the next iteration resumes from, in the one file format
        state2 = torch.load(tmp_path / sharding / "results/iter_1/optimizer/policy.pt", weights_only=True)
        assert state2["param_groups"] == state1["param_groups"]
        assert state2["state"].keys() == state1["state"].keys()
        for i, moments in state1["state"].items():
            for name, value in moments.items():
                torch.testing.assert_close(state2["state"][i][name], value, atol=1e-6, rtol=1e-4)
    # iteration 2 resumes AdamW from those moments: sharded by FSDP, as one process resumes them whole
    one, w1, _ = _update(grpo_run, d_one, 1, iteration=2)
    two, w2, _ = _update(grpo_run, tmp_path / "fsdp", 2, "fsdp", iteration=2)
    assert one == pytest.approx(two, abs=1e-6, rel=1e-5)
    _assert_same(w2, w1)


def test_the_engines_log_probs_stand_in_for_log_pi_old(grpo_run, one_process, tmp_path):
    """`update.old_logprobs: engine` skips the recompute pass; the tiny run's HF engine computed the same log-probs
    in fp32, so the update takes the same steps (its rollout's mismatch report: under 1e-5)."""
    _, recomputed, w1, log1 = one_process
    engine, w2, log2 = _update(grpo_run, tmp_path / "engine", 1, old_logprobs="engine")
    assert "recomputing log pi_old" in log1 and "recomputing log pi_old" not in log2
    assert "the rollout engine's log-probs stand in for the sampling checkpoint's" in log2
    assert len(engine) == len(recomputed) >= 4
    assert engine == pytest.approx(recomputed, abs=1e-4)
    for k in w1:                                  # log pi_old agreed to about 1e-6, so do the weights
        torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=1e-4)
