"""Policies: the tiny default's tokenizer, and any local Hugging Face folder (here a tiny Qwen2 with a chat
template, saved on the spot, standing in for Qwen2.5-1.5B-Instruct)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.config.params import Params
from pipeline.envs.base import make_env
from pipeline.model.policy import encode_prompt, encode_response, generate, load_policy, render_prompt, resolve_device
from pipeline.rollout.episodes import EpisodeSpec, play_episodes
from tests.conftest import CHAT


def test_grid_cells_are_single_tokens(tokenizer):
    ids = tokenizer("_$@#\n1 2", add_special_tokens=False)["input_ids"]
    assert [tokenizer.decode([i]) for i in ids] == ["_", "$", "@", "#", "\n", "1", " ", "2"]
    assert encode_response(tokenizer, "<action>up</action>")[-1] == tokenizer.eos_token_id


def test_sampling_ignores_the_folders_generation_config(qwen_folder, tmp_path):
    """Qwen2.5-Instruct's generation_config.json sets repetition_penalty 1.05, top_k 20, top_p 0.8 and temperature
    0.7. Sampling must ignore them: the log-probs it records are those the trainer recomputes, softmax(logits / T) at
    the rollout temperature, and the tokens are the ones drawn without them."""
    import shutil

    from transformers import GenerationConfig

    from pipeline.model.policy import pad_batch, token_logprobs

    d = tmp_path / "qwen-sampling"
    shutil.copytree(qwen_folder, d)
    GenerationConfig(do_sample=True, repetition_penalty=1.05, top_k=20, top_p=0.8, temperature=0.7,
                     no_repeat_ngram_size=1).save_pretrained(d)
    plain, tok = load_policy(qwen_folder)
    model, _ = load_policy(d)
    assert model.generation_config.repetition_penalty == 1.05
    prompts = [encode_prompt(tok, "go"), encode_prompt(tok, "push the box to the target")]
    gens = generate(model, tok, prompts, 12, 1.3, seed=5)
    assert [g.response_ids for g in gens] == [g.response_ids for g in generate(plain, tok, prompts, 12, 1.3, seed=5)]
    ids, _, resp = pad_batch(prompts, [g.response_ids for g in gens], tok.pad_token_id)
    logp, _ = token_logprobs(model, ids, resp, temperature=1.3)
    for i, g in enumerate(gens):
        assert torch.allclose(logp[i][resp[i]], torch.tensor(g.logprobs), atol=1e-5)


def test_local_folder_with_chat_template(qwen_folder):
    model, tok = load_policy(qwen_folder)
    assert model.config.model_type == "qwen2"
    text = render_prompt(tok, "hello")
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    gens = generate(model, tok, [encode_prompt(tok, "hi"), encode_prompt(tok, "a longer prompt")], 5, 1.0, seed=1)
    assert all(1 <= len(g.response_ids) <= 5 and len(g.logprobs) == len(g.response_ids) for g in gens)
    again = generate(model, tok, [encode_prompt(tok, "hi"), encode_prompt(tok, "a longer prompt")], 5, 1.0, seed=1)
    assert [g.response_ids for g in gens] == [g.response_ids for g in again]  # seeded sampling
    p = Params()
    steps = play_episodes(model, tok, lambda: make_env(p.env), [EpisodeSpec(7, 0, 0)], history_turns=2,
                          max_new_tokens=4, temperature=1.0, batch_size=4, seed=0)
    assert steps.height == p.env.max_turns or steps["terminated"].any()
    assert steps["prompt"][0].startswith("Sokoban.")


def test_runtime_device_resolves_and_refuses_a_missing_gpu(qwen_folder, monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="runtime.device is 'cuda:1', but this torch .* sees no GPU"):
        resolve_device("cuda:1")
    model, _ = load_policy(qwen_folder, device="auto")
    assert model.device == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ValueError, match="runtime.device is 'cuda:1', but torch sees 1 GPU"):
        resolve_device("cuda:1")


def test_init_stage_takes_the_given_folder(qwen_folder, tmp_path):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"policy": {"path": str(qwen_folder)},
                                                          "tracking": {"enabled": False}}))
    r = subprocess.run([sys.executable, "-m", "stages.init", "--params", "params.yaml"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    model, tok = load_policy(tmp_path / "results/iter_0/checkpoint")
    assert model.config.model_type == "qwen2" and tok.chat_template == CHAT


def test_token_logprobs_match_a_masked_full_forward_and_generation(qwen_folder):
    """The fast path (no padding mask on a right-padded batch, LM head only on response columns) gives the same
    log-probs and entropies as a full forward with a padding mask, and the same log-probs as sampling."""
    from pipeline.model.policy import pad_batch, token_logprobs

    model, tok = load_policy(qwen_folder)
    prompts = [encode_prompt(tok, "hi"), encode_prompt(tok, "a much longer prompt than the first one")]
    gens = generate(model, tok, prompts, 4, 1.0, seed=3)
    ids, attn, resp = pad_batch(prompts, [g.response_ids for g in gens], tok.pad_token_id)
    assert not attn.all()  # the batch is padded
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        ref_all = torch.log_softmax(logits, -1)
        ref = ref_all.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        ref_ent = -(ref_all.exp() * ref_all).sum(-1)
        for targets in (resp, None):
            logp, ent = token_logprobs(model, ids, targets, with_entropy=True)
            assert logp.shape == ent.shape == resp.shape
            assert torch.allclose(logp[resp], ref[resp], atol=1e-5)
            assert torch.allclose(ent[resp], ref_ent[resp], atol=1e-5)
    for i, g in enumerate(gens):
        assert torch.allclose(logp[i][resp[i]], torch.tensor(g.logprobs), atol=1e-4)


def test_log_prob_passes_report_progress_with_a_rate(monkeypatch):
    """A long `log π_old` pass is not silent: with the interval at 0, a line after each batch but the last, and the
    log-probs are those of one pass without progress."""
    from pipeline import progress
    from pipeline.model import ppo
    from tests.conftest import batch, tiny_llama

    prompts, responses, *_ = batch()            # 16 turns
    model = tiny_llama()
    quiet = ppo.sequence_logprobs(model, prompts, responses, 0, 5)
    monkeypatch.setattr(progress, "MAX_SILENCE_S", 0.0)
    lines = []
    loud = ppo.sequence_logprobs(model, prompts, responses, 0, 5, progress=lines.append)
    assert [x.split(",")[0] for x in lines] == [f"log-probs of {n}/16 turns" for n in (5, 10, 15)]
    assert all(x.endswith(" turns/s") or x.endswith(" s/turn") for x in lines)
    assert all(torch.equal(a, b) for a, b in zip(quiet, loud, strict=True))


def test_a_progress_line_gives_seconds_per_item_when_an_item_takes_over_a_second():
    from pipeline.progress import Ticker

    t = Ticker(60)
    t.started, t.last = 100.0, 166.0                # 2 steps in 66 s: "0.03 steps/s" said nothing
    assert t.pace(2) == "33.0 s/step"
    t.last = 101.0                                  # 5 turns in 1 s
    assert t.pace(5, "turn") == "5.00 turns/s"
    assert t.pace(1) == "1.00 steps/s"


def test_the_kl_reference_at_iteration_1_is_log_pi_old_without_a_second_pass(tmp_path, monkeypatch):
    """`update.kl_coef` > 0: at iteration 1 the update starts from the reference (checkpoint 0; LoRA's fresh
    adapters add zero), so its log-probs are log π_old's; from iteration 2 on, checkpoint 0 is read and run."""
    import stages.update as update
    from pipeline.config.params import load_params
    from pipeline.workflow.cli import StageContext
    from tests.conftest import ROOT

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["update"]["kl_coef"] = 0.1
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw))
    p = load_params(tmp_path / "p.yaml")
    read = []
    monkeypatch.setattr(update, "checkpoint_logprobs", lambda ctx, ckpt, *a: read.append(str(ckpt)) or ["ref"])
    old = [torch.tensor([-0.5, -1.0])]
    ctx = lambda it: StageContext(p, "p.yaml", it, "update", 0.0)  # noqa: E731
    assert update.reference_logprobs(ctx(1), None, 0, None, None, old) is old and read == []
    assert update.reference_logprobs(ctx(2), None, 0, None, None, old) == ["ref"]
    assert read == ["results/iter_0/checkpoint"]
    p = p.model_copy(update={"update": p.update.model_copy(update={"kl_coef": 0.0})})
    assert update.reference_logprobs(ctx(2), None, 0, None, None, old) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_under_lora_the_kl_reference_is_the_model_with_its_adapters_off(qwen_folder, tmp_path, monkeypatch, dtype):
    """A LoRA run's checkpoint of i-1 is adapters over checkpoint 0, so the KL reference (checkpoint 0) is the
    loaded model with its adapters switched off: the same log-probs as checkpoint 0 loaded on its own (to 1e-6),
    without loading it, and not those of the adapted model. The adapters stay on afterwards."""
    import shutil

    from pipeline.model.distributed import Processes
    from pipeline.model.policy import load_trainable, save_policy, with_lora
    from pipeline.model.ppo import Turns, sequence_logprobs
    from pipeline.workflow.cli import StageContext
    from stages import update

    monkeypatch.chdir(tmp_path)
    first, second = Path("results/iter_0/checkpoint"), Path("results/iter_1/checkpoint")
    shutil.copytree(qwen_folder, first)
    p = Params(policy={"path": str(first), "dtype": dtype, "lora": {"r": 4}}, update={"kl_coef": 0.1})
    base, tok = load_policy(first, train=True)
    adapted = with_lora(base, p.policy.lora, seed=0)
    torch.manual_seed(1)
    for name, w in adapted.named_parameters():
        if "lora_B" in name:                    # fresh adapters add zero: give them something to add
            w.data.normal_(0, 0.5)
    save_policy(adapted, tok, second, base=first)

    model = load_trainable(second, p.policy, "cpu", seed=0)[0]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, len(tok), (n,), generator=g).tolist() for n in (6, 9, 4)]
    responses = [torch.randint(5, len(tok), (n,), generator=g).tolist() for n in (3, 5, 2)]
    turns = Turns(prompts, responses, [1.0, -1.0, 0.5])
    loaded = []
    monkeypatch.setattr(update, "load_policy", lambda *a, **k: loaded.append(a[0]) or load_policy(*a, **k))
    ctx = StageContext(p, "p.yaml", 2, "update", 0.0)
    ref = update.reference_logprobs(ctx, model, tok.pad_token_id, turns, Processes(0, 1, "cpu"), old=None)
    assert loaded == []
    alone = update.checkpoint_logprobs(ctx, first, tok.pad_token_id, turns, Processes(0, 1, "cpu"))
    assert loaded == [first]
    on = sequence_logprobs(model, prompts, responses, tok.pad_token_id, 4, p.rollout.temperature)
    for r, a, o in zip(ref, alone, on, strict=True):
        assert torch.allclose(r, a, atol=1e-6)
        assert (r - o).abs().max() > 1e-2          # the adapters change what the model computes
    after = sequence_logprobs(model, prompts, responses, tok.pad_token_id, 4, p.rollout.temperature)
    assert all(torch.equal(a, o) for a, o in zip(after, on, strict=True))
