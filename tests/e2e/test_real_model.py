"""A real pretrained LLM through every stage of one iteration, at tiny sizes: SmolLM2-135M-Instruct from its GGUF file
(scripts/install-models; CI installs it), dequantized and warm-started by init, then rollout, group, advantages,
update and evaluate with vLLM's CPU engine and with Hugging Face generate.

What a real model adds over the tiny one: its own chat template in every prompt, a 49,152-token vocabulary, and
the engine's sampled log-probs against the trainer's on 30 layers."""

import json

import numpy as np
import polars as pl
import pytest
import torch
import yaml

from pipeline.data import tables
from pipeline.model.policy import load_policy, pad_batch, token_logprobs
from tests.conftest import ROOT, stage_cli

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("smollm2")]   # one worker builds the run once
SMOL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(autouse=True)
def smollm2_installed():
    """The README's test command installs the file (scripts/install-models): its absence is a broken install."""
    assert SMOL.is_file(), f"{SMOL}: missing; run scripts/install-models (the README's test command does)"

TEMPERATURE = 0.9
MAX_NEW = 10


def params(engine: str) -> dict:
    return {"seed": 5, "loop": {"iterations": 1}, "env": {"name": "sokoban", "max_turns": 2},
            "prompt": {"history_turns": 0},
            "policy": {"path": str(SMOL), "max_new_tokens": MAX_NEW, "lora": {"r": 8, "alpha": 16}},
            "warmstart": {"episodes": 3, "steps": 1, "clean_steps": 1, "batch_size": 2, "lr": 1e-5},
            "rollout": {"engine": engine, "tasks_per_iteration": 2, "group_size": 2, "batch_size": 4,
                        "temperature": TEMPERATURE, "vllm": {"max_model_len": 512}},
            "update": {"epochs": 1, "minibatch_size": 8, "lr": 1e-5},
            "evaluate": {"tasks": 2, "episodes_per_task": 1, "temperature": 0.0},
            "tracking": {"enabled": False}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """init, then rollout, group, advantages and update with vLLM's engine, then evaluate with Hugging Face's
    (the two engines' samplers on one real model, at the cost of one run). The update trains LoRA adapters, as the
    SmolLM2 configs do (full fine-tuning is the tiny runs' default, and the warm start's here)."""
    d = tmp_path_factory.mktemp("smollm2")
    (d / "params.yaml").write_text(yaml.safe_dump(params("vllm")))
    logs = {"init": stage_cli(d, "init")}
    for name in ("rollout", "group", "advantages", "update"):
        logs[name] = stage_cli(d, name, 1)
    (d / "params.yaml").write_text(yaml.safe_dump(params("hf")))
    logs["evaluate"] = stage_cli(d, "evaluate", 1)
    return d, logs


@pytest.fixture(scope="module")
def policies(run):
    """The checkpoints of iterations 0 and 1, each read once for the module's tests (a 517 MB folder each)."""
    d, _ = run
    return {i: load_policy(d / f"results/iter_{i}/checkpoint") for i in (0, 1)}


def test_init_dequantizes_and_warm_starts_smollm2(run):
    d, logs = run
    assert "dequantizing SmolLM2-135M-Instruct.Q4_1.gguf: llama" in logs["init"]
    assert "LlamaForCausalLM: 134,515,008 parameters, vocabulary 49152, chat template: yes" in logs["init"]
    assert "warm start step 1/1" in logs["init"]
    config = json.loads((d / "results/iter_0/checkpoint/config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config


def test_a_real_model_plays_an_iteration_with_its_chat_template(run, policies):
    d, logs = run
    assert "sampling with vllm, prefix caching on" in logs["rollout"]
    steps = tables.read_table(d / "results/iter_1/steps.parquet", tables.STEPS)
    assert steps.height >= 4
    (m0, tok), (m1, _) = policies[0], policies[1]
    for ids in steps["prompt_ids"].to_list():
        text = tok.decode(ids)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
        assert "Answer with one admissible action as <action>...</action>." in text
    ids = [i for row in steps["prompt_ids"].to_list() + steps["response_ids"].to_list() for i in row]
    assert 0 <= min(ids) and max(ids) < 49152
    assert all(r[-1] == tok.eos_token_id or len(r) == MAX_NEW for r in steps["response_ids"].to_list() if r)
    # the update trained: iteration 1's checkpoint is an adapter on iteration 0's, and base + adapter (merged for
    # sampling) differs from the base
    assert (d / "results/iter_1/checkpoint/adapter_config.json").is_file()
    assert not torch.equal(m0.model.layers[0].mlp.up_proj.weight, m1.model.layers[0].mlp.up_proj.weight)
    # and Hugging Face's generate played iteration 1's checkpoint on the held-out tasks
    assert "with hf" in logs["evaluate"]
    assert json.loads((d / "results/iter_1/eval_metrics.json").read_text())["episodes"] == 2


def test_vllm_samples_smollm2_with_the_trainers_logprobs(run, policies):
    """log pi_old of the update (the trainer's forward at the sampling temperature) equals the engine's log-probs
    of the sampled tokens. Through 30 layers the engine's oneDNN kernels and the trainer's differ by a machine-
    dependent amount (measured 3.5e-5 nats on one Xeon, 1.5e-3 on CI's); a real mismatch, the trainer at
    temperature 1 instead of 0.9, is two orders above the tolerance, and the test checks that it is caught."""
    d, _ = run
    steps = tables.read_table(d / "results/iter_1/steps.parquet", tables.STEPS)
    steps = steps.filter(pl.col("response_ids").list.len() > 0)
    model, tok = policies[0]
    ids, _, resp = pad_batch(steps["prompt_ids"].to_list(), steps["response_ids"].to_list(), tok.pad_token_id)
    engine = torch.cat([torch.tensor(x) for x in steps["response_logprobs"].to_list()])
    gaps = {}
    for t in (TEMPERATURE, 1.0):
        with torch.no_grad():
            logp, _ = token_logprobs(model, ids, resp, temperature=t)
        gaps[t] = float((logp[resp] - engine).abs().max())
    assert gaps[TEMPERATURE] < 5e-3 and gaps[1.0] > 0.1, f"largest gap, nats, by the trainer's temperature: {gaps}"


def test_igpos_gain_is_positive_for_a_turn_whose_result_holds_the_answer(policies):
    """IGPO on SmolLM2: a search result that names the answer raises the policy's probability of answering it
    (a positive information gain), and by more than a result that does not name it."""
    from pipeline.credit.methods.igpo import answer_logprobs
    from pipeline.data.section import FitBatching

    model, tok = policies[0]
    question = "Answer the question, searching as needed. Question: In which town was the Velmoran Archive founded?"
    found = ("<information>Doc 1 (Title: Velmoran Archive) The Velmoran Archive was founded in the town of "
             "Quellbrook in 1821.</information>")
    other = ("<information>Doc 1 (Title: Velmoran Archive) The Velmoran Archive holds maps and letters of "
             "merchants.</information>")

    def prompt(*turns):
        messages = [{"role": "user", "content": question}]
        for result in turns:
            messages += [{"role": "assistant", "content": "<search>Velmoran Archive</search>"},
                         {"role": "user", "content": result}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]

    prefix = tok("<answer>", add_special_tokens=False)["input_ids"]
    gold = tok("Quellbrook", add_special_tokens=False)["input_ids"]
    p = np.exp(answer_logprobs(model, [prompt(), prompt(found), prompt(other)], [(prefix, gold)] * 3,
                               tok.pad_token_id, FitBatching(batch_size=3)))
    assert p[1] - p[0] > 0.05 and p[1] - p[0] > p[2] - p[0], p
