"""Memory settings of the update that must not change its maths: micro-batches with gradient accumulation
(`update.micro_batch_size`) and gradient checkpointing (`update.gradient_checkpointing`), with and without LoRA."""

import pytest
import torch

from pipeline.data.section import LoraSettings
from pipeline.model.policy import with_lora
from pipeline.model.ppo import policy_loss
from tests.conftest import sgd_update, tiny_llama


def turns(n=10, seed=1):
    """Turns of different prompt and response lengths, so that micro-batches hold different token counts."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 40, (3 + k % 4,), generator=g).tolist() for k in range(n)]
    responses = [torch.randint(1, 40, (1 + (k * 7) % 5,), generator=g).tolist() for k in range(n)]
    advantages = [1.5, -1.0, 0.5, -2.0, 1.0] * (n // 5)
    return prompts, responses, advantages


def train(model, **update):
    return sgd_update(model, *turns(), lr=0.5, epochs=2, minibatch_size=5, **update)


def test_token_mean_over_a_minibatch_is_the_sum_of_its_micro_batches_by_hand():
    # two turns: 1 token with advantage 1, ratio 1 -> -1; 3 tokens with advantage -1, ratio 1 -> +1 each
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    adv = torch.tensor([[1.0], [-1.0]])
    whole, _ = policy_loss(logp, logp, adv, mask, 0.2, 3.0)
    assert float(whole) == pytest.approx((-1 + 3) / 4)
    first, _ = policy_loss(logp[:1], logp[:1], adv[:1], mask[:1], 0.2, 3.0, tokens=4.0)
    second, _ = policy_loss(logp[1:], logp[1:], adv[1:], mask[1:], 0.2, 3.0, tokens=4.0)
    assert float(first) == pytest.approx(-0.25) and float(second) == pytest.approx(0.75)


@pytest.mark.parametrize("lora", [False, True])
def test_micro_batches_and_checkpointing_train_the_same_weights(lora):
    def fresh():
        m = tiny_llama()
        return with_lora(m, LoraSettings(r=4, alpha=8), seed=0) if lora else m

    ref, ref_stats = train(fresh())
    micro, micro_stats = train(fresh(), micro_batch_size=2)
    ckpt_model = fresh()
    ckpt_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt, _ = train(ckpt_model, micro_batch_size=3)
    init = dict(fresh().named_parameters())
    moved = 0
    for name, w in ref.items():
        assert torch.allclose(micro[name], w, atol=1e-6, rtol=0), name
        assert torch.allclose(ckpt[name], w, atol=1e-6, rtol=0), name
        moved += int(not torch.equal(w, init[name]))
        if lora and "lora_" not in name:
            assert torch.equal(ckpt[name], init[name]), name          # the base stays frozen
    assert moved > 0
    for k in ("loss", "pg_loss", "clipfrac", "approx_kl", "grad_norm"):
        assert micro_stats[k] == pytest.approx(ref_stats[k], abs=1e-6), k


def test_minibatches_are_near_equal_by_hand():
    from pipeline.data.batches import minibatches

    sizes = lambda n, size: [len(b) for b in minibatches(list(range(n)), size)]  # noqa: E731
    assert sizes(577, 64) == [58] * 7 + [57] * 3        # not nine of 64 and a last one of 1
    assert sizes(9, 4) == [3, 3, 3] and sizes(8, 4) == [4, 4] and sizes(3, 64) == [3] and sizes(0, 4) == []
    assert minibatches([5, 1, 4, 2, 3], 2) == [[5, 1], [4, 2], [3]]   # consecutive slices of the shuffled order
