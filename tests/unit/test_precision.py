"""Mixed precision keeps fp32 master weights (pipeline.model.precision), and log-probs are taken at the sampling
temperature (docs/credit-assignment.md, Policy update)."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.config.params import UpdateConfig
from pipeline.model.policy import generate, load_policy
from pipeline.model.ppo import Turns, ppo_update, sequence_logprobs
from pipeline.model.precision import compute_dtype

PAD, EOS = 0, 1


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, eos_token_id=EOS,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(d)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, **{f"t{i}": i for i in range(2, 48)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                                  pad_token="<pad>", eos_token="<eos>")
    tok.save_pretrained(d)
    return d


def batch():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 48, (5,), generator=g).tolist() for _ in range(8)]
    responses = [torch.randint(2, 48, (3,), generator=g).tolist() for _ in range(8)]
    return prompts, responses, [1.0, -1.0] * 4


def one_step(model, lr: float):
    prompts, responses, adv = batch()
    old = sequence_logprobs(model, prompts, responses, PAD, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    cfg = UpdateConfig(lr=lr, epochs=1, minibatch_size=8)
    return ppo_update(model, opt, Turns(prompts, responses, adv, old), cfg, PAD, seed=0).stats


def q_proj(model) -> torch.Tensor:
    return model.model.layers[0].self_attn.q_proj.weight.detach().float().clone()


def test_bf16_training_keeps_fp32_master_weights_that_move_at_lr_1e_6(folder, tmp_path):
    model, tok = load_policy(folder, "bfloat16", train=True)
    assert compute_dtype(model) == torch.bfloat16 and model.dtype == torch.float32
    before = q_proj(model)
    one_step(model, 1e-6)
    model.save_pretrained(tmp_path / "after")                  # checkpoints keep the fp32 master weights
    after = LlamaForCausalLM.from_pretrained(tmp_path / "after", dtype="auto")
    assert after.dtype == torch.float32 and (q_proj(after) != before).float().mean() > 0.9
    # the same step on weights stored in bf16 rounds almost every change away (1e-6 is far below bf16's
    # resolution except for weights within about 1e-4 of zero)
    plain, _ = load_policy(folder, "bfloat16")
    plain_before = q_proj(plain)
    one_step(plain, 1e-6)
    assert (q_proj(plain) != plain_before).float().mean() < 0.05


def test_bf16_forward_runs_in_bf16_and_fp16_scales_its_loss(folder):
    fp32, _ = load_policy(folder, "float32", train=True)
    bf16, _ = load_policy(folder, "bfloat16", train=True)
    prompts, responses, _ = batch()
    a = torch.cat(sequence_logprobs(fp32, prompts, responses, PAD, 8))
    b = torch.cat(sequence_logprobs(bf16, prompts, responses, PAD, 8))
    assert 0 < (a - b).abs().max() < 0.1                       # bf16 matmuls: close, not equal
    fp16, _ = load_policy(folder, "float16", train=True)
    before = q_proj(fp16)
    stats = one_step(fp16, 1e-4)
    assert stats["skipped_steps"] == 0 and (q_proj(fp16) != before).float().mean() > 0.9


def test_log_pi_old_is_taken_at_the_sampling_temperature(folder):
    model, tok = load_policy(folder, "float32")
    prompts, _, _ = batch()
    gens = generate(model, tok, prompts, 4, 0.7, seed=5)
    responses = [g.response_ids for g in gens]
    engine = torch.cat([torch.tensor(g.logprobs) for g in gens])
    at_t = torch.cat(sequence_logprobs(model, prompts, responses, PAD, 8, temperature=0.7))
    assert torch.exp(at_t - engine).sub(1).abs().max() < 1e-4  # the ratio of an unchanged policy is 1
    at_1 = torch.cat(sequence_logprobs(model, prompts, responses, PAD, 8))
    assert (at_1 - engine).abs().max() > 0.05                  # at temperature 1 it would not be
    # and PPO at that temperature starts from ratio 1: nothing clipped, no KL, on the first minibatch
    cfg = UpdateConfig(epochs=1, minibatch_size=64, lr=1e-3)
    stats = ppo_update(copy.deepcopy(model), torch.optim.AdamW(model.parameters(), lr=0.0),
                       Turns(prompts, responses, [1.0] * 8,
                             sequence_logprobs(model, prompts, responses, PAD, 8, temperature=0.7)), cfg, PAD,
                       seed=0, temperature=0.7).stats
    assert stats["clipfrac"] == 0.0 and abs(stats["approx_kl"]) < 1e-6


@pytest.mark.parametrize("packing", ["none", "tree"])
def test_a_lora_base_stored_in_bf16_trains_the_adapters_exactly_as_autocast_did(folder, packing):
    """Under LoRA in bf16 the frozen linear weights are stored in bf16 (`frozen_in_compute_dtype`): autocast cast
    them to the same values on every forward, so one update step gives bit-identical adapters; the adapters, the
    embedding (tied to the LM head) and the norms stay fp32."""
    from pipeline.config.params import PolicyConfig
    from pipeline.data.section import LoraSettings
    from pipeline.model.policy import load_trainable
    from pipeline.model.precision import frozen_in_compute_dtype

    policy = PolicyConfig(dtype="bfloat16", lora=LoraSettings(r=4, alpha=8))
    results = []
    for frozen_low in (False, True):
        model, _ = load_trainable(folder, policy, "cpu", seed=0, frozen_low_precision=frozen_low)
        for name, w in model.named_parameters():       # B = 0 would hide the adapter's effect on the base's input
            if "lora_B" in name:
                torch.manual_seed(1)
                torch.nn.init.normal_(w, std=0.5)
        dtypes = {n: w.dtype for n, w in model.named_parameters()}
        prompts, responses, adv = batch()
        old = sequence_logprobs(model, prompts, responses, PAD, 8)
        opt = torch.optim.AdamW([w for w in model.parameters() if w.requires_grad], lr=1e-2)
        ppo_update(model, opt, Turns(prompts, responses, adv, old), UpdateConfig(lr=1e-2, epochs=1, minibatch_size=8,
                   packing=packing), PAD, seed=0)
        results.append(({n: w.detach().clone() for n, w in model.named_parameters() if w.requires_grad}, dtypes,
                        old))
    (plain, plain_dtypes, plain_old), (low, low_dtypes, low_old) = results
    assert all(torch.equal(a, b) for a, b in zip(plain_old, low_old))
    assert plain.keys() == low.keys() and all(torch.equal(plain[n], low[n]) for n in plain)
    assert set(plain_dtypes.values()) == {torch.float32}
    cast = {n for n, d in low_dtypes.items() if d == torch.bfloat16}
    # q k v o, gate up down of the one layer; not the embedding, the norms or the adapters
    assert len(cast) == 7 and all("base_layer" in n for n in cast)
    assert all(low_dtypes[n] == torch.float32 for n in plain)
    # an fp32 model is left as it is
    fp32, _ = load_trainable(folder, PolicyConfig(dtype="float32", lora=LoraSettings(r=4, alpha=8)), "cpu", seed=0)
    assert frozen_in_compute_dtype(fp32) == 0 and {w.dtype for w in fp32.parameters()} == {torch.float32}


def test_stochastic_rounding_to_bf16_is_unbiased_and_leaves_what_bf16_holds():
    from pipeline.model.precision import stochastic_bf16

    g = torch.Generator().manual_seed(0)
    # at 1.0 bf16's spacing is 2^-7: 1 + 2^-9 lies a quarter of the way from 1 to 1 + 2^-7, which nearest rounding
    # drops; stochastic rounding goes up a quarter of the time (40,000 draws: a standard error of 0.0022)
    x = torch.full((40000,), 1 + 2.0 ** -9)
    assert torch.equal(x.to(torch.bfloat16).float(), torch.ones(40000))
    up = stochastic_bf16(x, g).float()
    assert set(up.unique().tolist()) == {1.0, 1 + 2.0 ** -7}
    assert float((up > 1).float().mean()) == pytest.approx(0.25, abs=0.01)
    down = stochastic_bf16(-x, g).float()          # a negative value: its magnitude rounds the same way
    assert set(down.unique().tolist()) == {-1.0, -1 - 2.0 ** -7}
    assert float((down < -1).float().mean()) == pytest.approx(0.25, abs=0.01)
    exact = torch.tensor([1.0, -3.5, 0.0, 2.0 ** -20, 1 + 2.0 ** -7, -(2.0 ** 100)])
    assert torch.equal(stochastic_bf16(exact, g).float(), exact)


def _quarter_spacing_adapter(folder, out):
    """A LoRA checkpoint on `folder` whose only update is q_proj's: every entry + 2^-9 on a base weight of 1.0,
    a quarter of bf16's spacing there (the base is saved beside it with q_proj set to 1.0)."""
    from pipeline.data.section import LoraSettings
    from pipeline.model.policy import load_policy, save_policy, with_lora

    model, tok = load_policy(folder)
    torch.nn.init.ones_(model.model.layers[0].self_attn.q_proj.weight)
    save_policy(model, tok, out / "base")
    model = with_lora(model, LoraSettings(r=4, alpha=4), seed=0)        # alpha / r = 1
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    torch.nn.init.constant_(q.lora_A["default"].weight, 2.0 ** -5)
    torch.nn.init.constant_(q.lora_B["default"].weight, 2.0 ** -6)      # dW = 4 x 2^-5 x 2^-6 = 2^-9
    save_policy(model, tok, out / "adapter", base=out / "base")
    return out / "adapter"


def test_a_stochastic_merge_keeps_in_expectation_the_update_a_nearest_merge_drops(folder, tmp_path):
    """`policy.merge_rounding`: merged in bf16, an update of a quarter spacing is lost on every weight; merged in
    fp32 and rounded stochastically, a quarter of the weights move up a whole spacing, so the mean update is kept;
    the same checkpoint merges to the same weights every time, and weights without an adapter are the nearest
    merge's."""
    from pipeline.model.policy import load_policy

    adapter = _quarter_spacing_adapter(folder, tmp_path)
    nearest, _ = load_policy(adapter, "bfloat16")
    st, _ = load_policy(adapter, "bfloat16", merge_rounding="stochastic")
    again, _ = load_policy(adapter, "bfloat16", merge_rounding="stochastic")
    qn = nearest.model.layers[0].self_attn.q_proj.weight
    qs = st.model.layers[0].self_attn.q_proj.weight
    assert qn.dtype == qs.dtype == torch.bfloat16
    assert torch.equal(qn.float(), torch.ones(32, 32))                  # the whole update rounded away
    assert set(qs.float().unique().tolist()) == {1.0, 1 + 2.0 ** -7}
    # 1,024 weights, each up with probability 1/4: the mean update 2^-9 within 4 standard errors (0.0135 x 2^-7)
    assert float(qs.float().mean() - 1) == pytest.approx(2.0 ** -9, abs=4 * (0.1875 / 1024) ** 0.5 * 2.0 ** -7)
    assert all(torch.equal(a, b) for a, b in zip(st.parameters(), again.parameters()))
    rest = [(n, w) for n, w in st.named_parameters() if "q_proj" not in n]
    plain = dict(nearest.named_parameters())
    assert rest and all(w.dtype == torch.bfloat16 and torch.equal(w, plain[n]) for n, w in rest)
    # what vLLM loads (`rollout.vllm.lora: merged`) is the same merge, saved as a plain bf16 folder
    import shutil

    from pipeline.model.engines import merged_copy
    copy_dir = merged_copy(adapter, "bfloat16", "stochastic")
    try:
        served, _ = load_policy(copy_dir, "bfloat16")
        assert all(torch.equal(a, b) for a, b in zip(served.parameters(), st.parameters()))
    finally:
        shutil.rmtree(copy_dir)
    # an fp32 policy has nothing to round: the setting changes nothing
    f32, _ = load_policy(adapter, "float32", merge_rounding="stochastic")
    assert float(f32.model.layers[0].self_attn.q_proj.weight.mean() - 1) == pytest.approx(2.0 ** -9, rel=1e-4)


def test_update_dtype_float32_trains_a_bf16_sampled_policy_exactly_as_an_fp32_run_does(folder):
    """`update.dtype: float32` under `policy.dtype: bfloat16`: the update loads the policy as an fp32 run's does (no
    autocast, the LoRA base left in fp32), so one PPO step moves the adapters bit for bit as the fp32 run's step,
    and not as the bf16 update's (which differ by more than 1e-4 here)."""
    from pipeline.config.params import Params
    from pipeline.model.policy import load_trainable, trainer_policy

    def adapters_after_one_step(dtype: str, update_dtype: str = "policy"):
        p = Params.model_validate({"policy": {"dtype": dtype, "lora": {"r": 4, "alpha": 8}},
                                   "update": {"dtype": update_dtype}})
        model, _ = load_trainable(folder, trainer_policy(p), "cpu", seed=0)
        for name, w in model.named_parameters():
            if "lora_B" in name:
                torch.manual_seed(1)
                torch.nn.init.normal_(w, std=0.5)
        dtypes = {w.dtype for w in model.parameters()}
        prompts, responses, adv = batch()
        old = sequence_logprobs(model, prompts, responses, PAD, 8)
        opt = torch.optim.AdamW([w for w in model.parameters() if w.requires_grad], lr=1e-2)
        ppo_update(model, opt, Turns(prompts, responses, adv, old), UpdateConfig(lr=1e-2, epochs=1, minibatch_size=8),
                   PAD, seed=0)
        return {n: w.detach().clone() for n, w in model.named_parameters() if w.requires_grad}, dtypes, \
            compute_dtype(model)

    fp32, fp32_dtypes, _ = adapters_after_one_step("float32")
    mixed, mixed_dtypes, mixed_compute = adapters_after_one_step("bfloat16", "float32")
    bf16, bf16_dtypes, bf16_compute = adapters_after_one_step("bfloat16")
    assert mixed_compute == torch.float32 and bf16_compute == torch.bfloat16
    assert mixed_dtypes == fp32_dtypes == {torch.float32} and torch.bfloat16 in bf16_dtypes
    assert fp32.keys() == mixed.keys() == bf16.keys() and len(fp32) == 14
    assert all(torch.equal(fp32[n], mixed[n]) for n in fp32)
    assert max(float((fp32[n] - bf16[n]).abs().max()) for n in fp32) > 1e-4


def test_update_dtype_float16_under_fsdp_is_refused_as_policy_dtype_float16_is():
    from pipeline.config.params import Params

    runtime = {"update_processes": 2, "update_sharding": "fsdp"}
    with pytest.raises(ValueError, match="fsdp does not scale fp16"):
        Params.model_validate({"policy": {"dtype": "bfloat16"}, "update": {"dtype": "float16"}, "runtime": runtime})
    Params.model_validate({"policy": {"dtype": "float16"}, "update": {"dtype": "float32"}, "runtime": runtime})
