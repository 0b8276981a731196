"""LoRA (`policy.lora`): the update trains only the adapter, a checkpoint is the adapter plus a pointer to its base,
rollout and evaluate sample from base + adapter, and a rerun of an update reproduces its adapter byte for byte (its
KL reference the same model with the adapters off).

The tiny configuration's shared GRPO run is continued with LoRA on: its initial policy and iteration 1's rollout
stay, and every update (and what follows it) reruns with adapters.
"""

import json
import shutil
import subprocess
import sys

import polars as pl
import pytest
import torch

from pipeline.data import tables
from pipeline.model.policy import adapter_base, load_policy, pad_batch, token_logprobs
from tests.conftest import SNAKEMAKE, continue_grpo_run, snakemake_failure

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def lora_run(grpo_run, tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    continue_grpo_run(grpo_run, d, policy={"lora": {"r": 4, "alpha": 8}},
                      # lr large enough that the adapter visibly moves the tiny policy; a KL term, whose reference
                      # from iteration 2 on is the loaded model with its adapters off
                      update={"lr": 0.05, "kl_coef": 0.05},
                      runtime={"keep_optimizer": "all"})
    r = subprocess.run([SNAKEMAKE, "--cores", "2", "--quiet"], cwd=d, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        pytest.fail(snakemake_failure(d, r))
    return d


def folder_bytes(d):
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def test_checkpoints_are_adapters_pointing_at_the_initial_policy(lora_run):
    base = lora_run / "results/iter_0/checkpoint"
    for it in (1, 2):
        ck = lora_run / f"results/iter_{it}/checkpoint"
        assert not (ck / "model.safetensors").exists()
        assert json.loads((ck / "adapter_config.json").read_text())["base_model_name_or_path"] == \
            "../../iter_0/checkpoint"
        assert adapter_base(ck) == base.resolve()
        weights = (ck / "adapter_model.safetensors").stat().st_size
        assert weights < (base / "model.safetensors").stat().st_size / 5


def test_the_update_changes_only_adapter_weights(lora_run):
    base, _ = load_policy(lora_run / "results/iter_0/checkpoint")
    base_weights = dict(base.named_parameters())
    trained, _ = load_policy(lora_run / "results/iter_2/checkpoint", train=True)
    changed = 0
    for name, w in trained.named_parameters():
        if "lora_" in name:
            assert w.requires_grad
            changed += int("lora_B" in name and w.abs().max() > 0)   # B starts at 0
        else:
            assert not w.requires_grad
            key = name.removeprefix("base_model.model.").replace(".base_layer", "")
            assert torch.equal(w, base_weights[key]), name
    assert changed > 0


def test_rollouts_sample_from_base_plus_adapter(lora_run):
    """Iteration 2's rollout recorded the log-probs of the adapter of iteration 1, not of the base."""
    steps = tables.read_table(lora_run / "results/iter_2/steps.parquet", tables.STEPS).filter(
        pl.col("response_ids").list.len() > 0).head(16)
    prompts, responses = steps["prompt_ids"].to_list(), steps["response_ids"].to_list()
    recorded = torch.cat([torch.tensor(x) for x in steps["response_logprobs"].to_list()])
    gaps = {}
    for it in (0, 1):
        model, tok = load_policy(lora_run / f"results/iter_{it}/checkpoint")
        ids, _, resp = pad_batch(prompts, responses, tok.pad_token_id)
        with torch.no_grad():
            logp, _ = token_logprobs(model, ids, resp)
        gaps[it] = float((logp[resp] - recorded).abs().max())
    assert gaps[1] < 1e-4 < 1e-2 < gaps[0]


def test_rerun_update_reproduces_the_adapter(lora_run, tmp_path):
    d = tmp_path / "rerun"
    shutil.copytree(lora_run, d)
    ck = d / "results/iter_2/checkpoint"
    before = (ck / "adapter_model.safetensors").read_bytes()
    assert (d / "results/iter_1/optimizer/policy.pt").is_file()       # keep_optimizer: all
    shutil.rmtree(ck)
    r = subprocess.run([sys.executable, "-m", "stages.update", "--params", "params.yaml", "--iteration", "2"],
                       cwd=d, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "adapters switched off" in r.stdout + r.stderr
    assert (ck / "adapter_model.safetensors").read_bytes() == before
