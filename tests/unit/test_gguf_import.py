"""policy.path naming a GGUF file: the header check when the params load, and init's dequantized plain folder.

The GGUF files are written here with the `gguf` package's writer from a tiny Llama (as llama.cpp's converter lays
a Llama out: q/k rows permuted for its rotary layout, tied output omitted), so nothing is downloaded."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from pipeline.config.params import ParamsError, load_params
from pipeline.model.gguf_import import gguf_header, load_gguf, load_tokenizer
from pipeline.model.policy import build_tiny_model, load_policy, train_tokenizer
from tests.conftest import CHAT

CORPUS = ["push the box onto the target", "<action>up</action> <action>down</action>", "Turn 1 state: #  _ P X O",
          "Answer with one admissible action as <action>...</action>.", "left right up down"] * 20


@pytest.fixture(scope="module")
def tiny():
    from pipeline.config.params import TinyModelConfig

    tok = train_tokenizer(CORPUS, 320)
    model = build_tiny_model(tok, TinyModelConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                                  num_attention_heads=2), seed=3).eval()
    return model, tok


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, model, tok, qtype: str = "F32", arch: str = "llama", raw_type: str | None = None,
               chat_template: str | None = CHAT, bos: int | None = None) -> None:
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    vocab = tok.backend_tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_token_types([3 if t in ("<pad>", "<eos>") else 1 for t in tokens])
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    if bos is not None:
        w.add_bos_token_id(bos)
        w.add_add_bos_token(True)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in [("input_layernorm", "attn_norm"), ("self_attn.q_proj", "attn_q"),
                       ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                       ("self_attn.o_proj", "attn_output"), ("post_attention_layernorm", "ffn_norm"),
                       ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down")]:
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    for hf, gg in names.items():
        x = sd[hf]
        if gg.endswith("attn_q.weight"):
            x = _permute(x, cfg.num_attention_heads)
        elif gg.endswith("attn_k.weight"):
            x = _permute(x, cfg.num_key_value_heads)
        if x.ndim == 2 and qtype != "F32":
            q = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(gg, gguf.quants.quantize(x, q), raw_dtype=q)
        elif raw_type is not None and x.ndim == 2:   # bytes of a type the gguf package cannot dequantize
            q = gguf.GGMLQuantizationType[raw_type]
            block, size = gguf.GGML_QUANT_SIZES[q]
            w.add_tensor(gg, np.zeros((x.shape[0], x.shape[1] // block * size), np.uint8), raw_dtype=q)
        else:
            w.add_tensor(gg, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_an_f32_gguf_dequantizes_to_the_same_model_and_tokenizer(tiny, tmp_path):
    model, tok = tiny
    write_gguf(tmp_path / "tiny.gguf", model, tok)
    header = gguf_header(tmp_path / "tiny.gguf")
    assert (header.architecture, header.name, header.tensor_types) == ("llama", "tiny-test", ("F32",))
    loaded, ltok = load_gguf(tmp_path / "tiny.gguf")
    text = "Turn 1 state: push the box <action>up</action>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ltok(text, add_special_tokens=False)["input_ids"] == ids
    assert ltok.chat_template == CHAT and ltok.eos_token == "<eos>" and ltok.pad_token == "<pad>"
    alone = load_tokenizer(tmp_path / "tiny.gguf")             # without the weights (bench.warmstart's count)
    assert alone(text, add_special_tokens=False)["input_ids"] == ids and alone.chat_template == CHAT
    assert type(loaded).__name__ == "LlamaForCausalLM" and loaded.config.vocab_size == len(tok)
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), atol=1e-5, rtol=1e-5)
    # the load shared one reader of the file and gave gguf-py back its own afterwards
    import gguf
    from gguf.gguf_reader import GGUFReader
    from gguf.tensor_mapping import get_tensor_name_map

    assert gguf.GGUFReader is GGUFReader and gguf.get_tensor_name_map is get_tensor_name_map


def test_a_base_model_whose_file_asks_for_bos_gets_it_in_every_prompt(tiny, tmp_path):
    """No chat template, `tokenizer.ggml.add_bos_token` true (as Gemma's file): the prompt starts with BOS."""
    from pipeline.model.policy import encode_prompt

    model, tok = tiny
    write_gguf(tmp_path / "base.gguf", model, tok, chat_template=None, bos=tok.eos_token_id)
    assert gguf_header(tmp_path / "base.gguf").add_bos is True
    _, ltok = load_gguf(tmp_path / "base.gguf")
    assert not ltok.chat_template
    text = "push the box"
    assert encode_prompt(ltok, text) == [tok.eos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
    assert encode_prompt(load_tokenizer(tmp_path / "base.gguf"), text) == encode_prompt(ltok, text)


def test_a_q8_0_gguf_is_dequantized_close_to_the_original(tiny, tmp_path):
    model, tok = tiny
    write_gguf(tmp_path / "q8.gguf", model, tok, qtype="Q8_0")
    assert gguf_header(tmp_path / "q8.gguf").tensor_types == ("F32", "Q8_0")   # the norms stay F32
    loaded, _ = load_gguf(tmp_path / "q8.gguf")
    w0 = model.model.layers[0].mlp.up_proj.weight
    w1 = loaded.model.layers[0].mlp.up_proj.weight
    # Q8_0: 8-bit values with one fp16 scale d = max|w| / 127 per block of 32 weights, so each weight moves by at
    # most half a step plus 127 times the scale's fp16 rounding (2^-11 relative): 0.5 d + 0.062 d
    step = w0.detach().abs().reshape(-1, 32).amax(1, keepdim=True) / 127
    err = (w1 - w0).detach().abs().reshape(-1, 32)
    assert 0 < err.max() and bool((err <= step * 0.57).all())


def _plans_init(d) -> bool:
    r = subprocess.run([sys.executable, "-m", "snakemake", "results/iter_0/checkpoint", "--cores", "1", "-n"],
                       cwd=d, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return "rule init:" in r.stdout + r.stderr


def test_init_writes_a_plain_folder_that_reloads_and_warm_starts(tiny, tmp_path, monkeypatch):
    """init on a GGUF file, through Snakemake: a plain folder (no quantization config, safetensors, the chat
    template) that load_policy reads back; its warm start (a few steps, LoRA merged back) logs a loss that falls.
    The file is an input of init in both tools: other weights under the same name make Snakemake plan init again,
    and dvc.yaml lists it among init's deps."""
    from pipeline.workflow.dvcgen import render
    from tests.conftest import workflow_files

    model, tok = tiny
    write_gguf(tmp_path / "tiny.gguf", model, tok)
    params = {"policy": {"path": "tiny.gguf", "max_new_tokens": 8}, "tracking": {"enabled": False},
              "prompt": {"history_turns": 0}, "loop": {"iterations": 1},
              "warmstart": {"episodes": 6, "steps": 12, "clean_steps": 12, "batch_size": 8, "lr": 3e-3,
                            "lora": {"r": 4, "alpha": 8}}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    workflow_files(tmp_path)
    assert _plans_init(tmp_path)
    r = subprocess.run([sys.executable, "-m", "snakemake", "results/iter_0/checkpoint", "--cores", "1"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "results/iter_0/checkpoint"
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and (out / "model.safetensors").is_file()
    assert not (out / "adapter_config.json").exists()          # the warm start's adapters were merged
    reloaded, rtok = load_policy(out)
    assert rtok.chat_template == CHAT
    out_text = (tmp_path / "results/logs/init.log").read_text()
    assert "dequantizing tiny.gguf: llama (tiny-test), 20 tensors of type F32" in out_text
    assert "warm start step 12/12" in out_text
    ids = tok("push the box", add_special_tokens=False)["input_ids"]
    assert not torch.allclose(_logits(reloaded, ids), _logits(model, ids), atol=1e-3)   # trained, then merged

    assert not _plans_init(tmp_path)
    write_gguf(tmp_path / "tiny.gguf", model, tok, qtype="Q8_0")     # other weights under the same name
    assert _plans_init(tmp_path)
    monkeypatch.chdir(tmp_path)      # policy.path is relative to the project's folder, where both tools run
    dvc = yaml.safe_load(render(load_params(tmp_path / "params.yaml")))
    assert dvc["stages"]["init"]["deps"][-1] == "tiny.gguf"
    assert "tiny.gguf" not in dvc["stages"]["rollout"]["do"]["deps"]


def test_warm_start_lowers_the_loss_and_makes_actions_valid_and_lora_trains_adapters_only(tokenizer):
    """A handful of Sokoban demonstrations through a chat template. Full fine-tuning: the loss falls and greedy
    answers to the demonstration prompts become valid actions. LoRA: the loss falls too, and only the adapters
    change (the frozen weights stay bit-identical)."""
    import copy

    from pipeline.config.params import Params, TinyModelConfig
    from pipeline.data.section import LoraSettings
    from pipeline.envs.actions import parse_action
    from pipeline.model.policy import encode_prompt, generate, with_lora
    from pipeline.rollout.warmstart import demonstrations, supervised_warmstart

    tok = copy.deepcopy(tokenizer)      # trained on Sokoban text
    tok.chat_template = CHAT
    model = build_tiny_model(tok, TinyModelConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                                  num_attention_heads=2), seed=3).eval()
    demos = demonstrations(Params(prompt={"history_turns": 0}), 4, 0.0, seed=1)
    prompts = [d[0] for d in demos]
    admissible = [line.split("[")[1].rstrip("]").split(", ") for d in demos
                  for line in d[0].splitlines() if line.startswith("Admissible actions")]

    def valid_share(m) -> float:
        gens = generate(m, tok, [encode_prompt(tok, x) for x in prompts], 10, 0.0, 0)
        return sum(parse_action(g.text, a) is not None for g, a in zip(gens, admissible)) / len(gens)

    def mean(xs):
        return sum(xs) / len(xs)

    full = copy.deepcopy(model)
    before = valid_share(full)
    losses = supervised_warmstart(full, tok, demos, steps=60, batch_size=8, lr=3e-3, seed=0, clean_steps=60)
    assert mean(losses[-5:]) < 0.25 * mean(losses[:5])
    after = valid_share(full)
    assert before == 0.0 and after == 1.0, (before, after)

    lora = with_lora(copy.deepcopy(model), LoraSettings(r=8, alpha=16), seed=0)
    frozen = {k: v.clone() for k, v in lora.named_parameters() if not v.requires_grad}
    adapters = {k: v.clone() for k, v in lora.named_parameters() if v.requires_grad}
    losses = supervised_warmstart(lora, tok, demos, steps=30, batch_size=8, lr=1e-2, seed=0, clean_steps=30)
    assert mean(losses[-5:]) < 0.9 * mean(losses[:5])
    still = [k for k, v in lora.named_parameters() if k in frozen]
    assert len(still) == len(frozen) > 0 and all(torch.equal(dict(lora.named_parameters())[k], frozen[k])
                                                  for k in still)
    assert adapters and all("lora_" in k for k in adapters)
    lora_b = [(k, v) for k, v in lora.named_parameters() if k.endswith("lora_B.default.weight")]
    # all-linear: each layer's 7 projections (q, k, v, o, gate, up, down) carry an adapter
    assert len(lora_b) == 7 * model.config.num_hidden_layers
    assert all(not torch.equal(v, adapters[k]) for k, v in lora_b)


@pytest.mark.parametrize("what, fragment", [
    ("not-gguf", "not a readable GGUF file (it does not start with the GGUF magic bytes)"),
    ("arch", "GGUF architecture 'bogusnet' is not one transformers' GGUF loader reads"),
    ("qtype", "tensor type(s) Q8_1 cannot be dequantized"),
    ("missing", "no such GGUF file"),
])
def test_a_gguf_transformers_cannot_read_is_refused_when_the_params_load(tiny, tmp_path, what, fragment):
    model, tok = tiny
    f = tmp_path / "m.gguf"
    if what == "not-gguf":
        f.write_bytes(b"PK\x03\x04 a zip, not a model")
    elif what == "arch":
        write_gguf(f, model, tok, arch="bogusnet")
    elif what == "qtype":
        write_gguf(f, model, tok, raw_type="Q8_1")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"policy": {"path": str(f)}}))
    with pytest.raises(ParamsError) as e:
        load_params(tmp_path / "params.yaml")
    msg = str(e.value)
    assert str(tmp_path / "params.yaml") in msg and "key 'policy'" in msg and fragment in msg and str(f) in msg
