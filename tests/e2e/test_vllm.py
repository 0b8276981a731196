"""rollout.engine: vllm on this CPU (scripts/install-vllm): the rollout stage samples with vLLM's offline engine, and
the step table's log-probs are those the trainer recomputes at the sampling temperature.

The tiny policy here has head_dim 32 (hidden 64, 2 heads): vLLM's CPU attention refuses 16, the tiny test
configuration's, which the sampler reports as a params error."""

import json
import math
import re

import polars as pl
import pytest
import torch
import yaml

from pipeline.data import tables
from pipeline.model.policy import load_policy, pad_batch, token_logprobs
from tests.conftest import ROOT, stage_cli

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("vllm")]   # one worker starts the run once


@pytest.fixture(autouse=True)
def vllm_installed():
    """The README's test command runs scripts/install-vllm: vLLM missing is a broken install, not a skip."""
    import importlib.util

    assert importlib.util.find_spec("vllm"), "vLLM is not installed: run scripts/install-vllm"


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm")
    params = yaml.safe_load((ROOT / "tests" / "tiny_params.yaml").read_text())
    params["policy"]["tiny"].update(hidden_size=64, intermediate_size=128, num_attention_heads=2)
    params["policy"]["max_new_tokens"] = 8
    params["rollout"].update(engine="vllm", temperature=0.8, tasks_per_iteration=4, group_size=4,
                             branching={"mode": "entropy", "threshold": 0.7})   # ARPO's rollout, on vLLM's top-k
    params["warmstart"].update(episodes=60, steps=120)   # a policy that moves: branch points follow state changes
    params["tracking"] = {"enabled": False}
    (d / "params.yaml").write_text(yaml.safe_dump(params))
    stage_cli(d, "init")
    r = stage_cli(d, "rollout", 1)
    assert "sampling with vllm, prefix caching on" in r   # vLLM 0.32 caches prefixes on a CPU too
    if not torch.cuda.is_available():   # on a CPU the engine runs in the stage's own process (engines.py says why)
        assert "(EngineCore pid=" not in r and "(VllmWorker" not in r and "(MainProcess pid=" in r
    return d


def test_vllm_rollout_logprobs_match_the_trainers(vllm_run):
    d = vllm_run
    steps = tables.read_table(d / "results/iter_1/steps.parquet", tables.STEPS)
    steps = steps.filter(pl.col("response_ids").list.len() > 0)
    assert steps.height >= 16
    model, tok = load_policy(d / "results/iter_0/checkpoint")
    prompts, responses = steps["prompt_ids"].to_list(), steps["response_ids"].to_list()
    ids, _, resp = pad_batch(prompts, responses, tok.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, resp, temperature=0.8)
    engine = torch.cat([torch.tensor(x) for x in steps["response_logprobs"].to_list()])
    gap = (logp[resp] - engine).abs()
    assert float(gap.max()) < 1e-3, f"vLLM and the trainer differ by up to {float(gap.max()):.2e} nats"
    # a sampled response ends at EOS or at max_new_tokens, as HF's do
    eos = tok.eos_token_id
    assert all(r[-1] == eos or len(r) == 8 for r in responses)


def test_vllm_and_the_trainer_agree_on_arpo_entropy(vllm_run):
    """The branching rollout's entropies, from vLLM's top-10 log-probs, equal ARPO's quantity recomputed from the
    trainer's logits (the first 20 positions' 10 most likely tokens at the sampling temperature, their mean over
    the positions, over log |V|), and
    the tree it grew is whole: 4 episodes a task, branches holding their parents' turns."""
    d = vllm_run
    steps = tables.read_table(d / "results/iter_1/steps.parquet", tables.STEPS)
    sampled = steps.filter(~pl.col("shared") & (pl.col("response_ids").list.len() > 0))
    model, tok = load_policy(d / "results/iter_0/checkpoint")
    recomputed = []
    for p, r in zip(sampled["prompt_ids"].to_list(), sampled["response_ids"].to_list()):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([p + r])).logits[0, len(p) - 1: -1].float() / 0.8, -1)
        top = logp[:20].topk(10, -1).values                  # the mean over the min(20, |r|) positions read
        recomputed.append(float(-(top.exp() * top).sum()) / len(top) / math.log(len(tok)))
    assert sampled["entropy"].to_list() == pytest.approx(recomputed, rel=1e-3, abs=1e-5)
    assert steps.group_by("task_group").agg(pl.col("episode_id").n_unique())["episode_id"].to_list() == [4] * 4
    assert steps["shared"].any() and steps.filter(pl.col("shared"))["parent_episode"].null_count() == 0


def test_the_stages_after_a_branching_rollout(vllm_run):
    """group reports the branch points in one step group; the update with credit.attribution hard trains each
    shared turn once."""
    d = vllm_run
    params = yaml.safe_load((d / "params.yaml").read_text())
    params["credit"] = {"attribution": "hard"}
    (d / "params.yaml").write_text(yaml.safe_dump(params))
    out = stage_cli(d, "group", 1)
    assert re.search(r"branch_points [1-9]\d*\.000, branch_points_grouped 1\.000", out)
    stage_cli(d, "advantages", 1)
    steps = tables.read_table(d / "results/iter_1/steps.parquet", tables.STEPS)
    copies = int(steps["shared"].sum())
    out = stage_cli(d, "update", 1)
    assert f"credit.attribution hard: {copies} copies of shared turns merged into the {steps.height - copies} " \
           "sampled turns" in out


def test_vllm_refuses_a_head_dim_its_cpu_kernels_lack(vllm_run, tmp_path):
    from pipeline.config.params import load_params
    from pipeline.model.engines import open_sampler

    folder = tmp_path / "hd16"
    model, tok = load_policy(vllm_run / "results/iter_0/checkpoint")
    cfg = json.loads((vllm_run / "results/iter_0/checkpoint/config.json").read_text())
    model.config.num_attention_heads = model.config.num_key_value_heads = 4
    model.config.head_dim = 16
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    p = load_params(vllm_run / "params.yaml")
    with pytest.raises(ValueError, match=r"head_dim 16 is not one vLLM's CPU attention supports.*rollout.engine: hf"):
        open_sampler(p, folder, engine_seed=0)
    assert cfg["head_dim"] == 32


def lora_checkpoint(base, folder, seed=0):
    """A LoRA checkpoint on `base` whose adapter changes the policy (B random, not 0)."""
    from pipeline.data.section import LoraSettings
    from pipeline.model.policy import save_policy, with_lora

    model, tok = load_policy(base)
    model = with_lora(model, LoraSettings(r=4, alpha=8), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if "lora_B" in name:
                w.copy_(torch.randn(w.shape, generator=g) * 0.3)
    folder.mkdir(parents=True)
    save_policy(model, tok, folder, base=base)
    return folder


def test_vllm_samples_a_lora_checkpoint_with_the_trainers_logprobs(vllm_run, tmp_path):
    """A LoRA checkpoint served as base + adapter (rollout.vllm.lora: adapter): the log-probs vLLM returns are the
    trainer's of the adapted policy, and far from the base's."""
    from pipeline.config.params import load_params
    from pipeline.model.engines import open_sampler

    base = vllm_run / "results/iter_0/checkpoint"
    ck = lora_checkpoint(base, tmp_path / "iter_1" / "checkpoint")
    p = load_params(vllm_run / "params.yaml")
    p = p.model_copy(update={"rollout": p.rollout.model_copy(update={
        "vllm": p.rollout.vllm.model_copy(update={"lora": "adapter"})})})
    steps = tables.read_table(vllm_run / "results/iter_1/steps.parquet", tables.STEPS)
    prompts = steps["prompt_ids"].to_list()[:12]
    set_threads = torch.set_num_threads
    sampler, tok = open_sampler(p, ck, engine_seed=0)
    # vLLM's CPU worker, here in this process, stubs out torch.set_num_threads; the sampler puts it back
    assert torch.set_num_threads is set_threads
    try:
        gens = sampler(prompts, 8, 0.8, seed=0)
    finally:
        sampler.close()
    responses = [g.response_ids for g in gens]
    assert sum(map(len, responses)) >= 24
    ids, _, resp = pad_batch(prompts, responses, tok.pad_token_id)
    engine = torch.cat([torch.tensor(g.logprobs) for g in gens])
    gaps = {}
    for name, folder in (("adapted", ck), ("base", base)):
        model, _ = load_policy(folder)
        with torch.no_grad():
            logp, _ = token_logprobs(model, ids, resp, temperature=0.8)
        gaps[name] = float((logp[resp] - engine).abs().max())
    assert gaps["adapted"] < 1e-3 < 0.05 < gaps["base"], gaps


def test_a_merged_lora_copy_is_the_adapted_policy(vllm_run, tmp_path):
    """rollout.vllm.lora: merged serves a plain folder of base + adapter, which vLLM samples as it samples any
    checkpoint (the module's run): that folder holds no adapter, and its log-probs are the adapted policy's, far
    from the base's."""
    import shutil

    from pipeline.model.engines import merged_copy
    from pipeline.model.policy import is_adapter

    base = vllm_run / "results/iter_0/checkpoint"
    ck = lora_checkpoint(base, tmp_path / "iter_1" / "checkpoint")
    steps = tables.read_table(vllm_run / "results/iter_1/steps.parquet", tables.STEPS).head(12)
    ids, _, resp = pad_batch(steps["prompt_ids"].to_list(), steps["response_ids"].to_list(), 0)
    merged = merged_copy(ck, "float32")
    try:
        assert not is_adapter(merged) and (merged / "config.json").is_file()
        logp = {}
        for name, folder in (("merged", merged), ("adapted", ck), ("base", base)):
            model, _ = load_policy(folder)
            with torch.no_grad():
                logp[name] = token_logprobs(model, ids, resp, temperature=0.8)[0][resp]
    finally:
        shutil.rmtree(merged)
    assert float((logp["merged"] - logp["adapted"]).abs().max()) < 1e-4
    assert float((logp["merged"] - logp["base"]).abs().max()) > 0.05
