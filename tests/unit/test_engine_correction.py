"""`update.engine_correction: tis`: the rollout engine's own log-probs as the behaviour policy, each token's loss
weighted by min(π_old / π_engine, cap) (truncated importance sampling; docs/credit-assignment.md, Policy update)."""

from __future__ import annotations

import math
import types

import pytest
import torch

from pipeline.config.params import Params
from pipeline.model.ppo import policy_loss
from stages import update

# One turn of three tokens. The trainer's π_old: 0.5, 0.2, 0.9; the engine sampled them with 0.25, 0.5, 0.3.
# The weights π_old / π_engine: 2, 0.4 and 3, the last truncated at verl's cap 2.
OLD = [math.log(0.5), math.log(0.2), math.log(0.9)]
ENGINE = [math.log(0.25), math.log(0.5), math.log(0.3)]


def passes(monkeypatch, on_policy: bool, **update_keys):
    p = Params(update={"old_logprobs": "recompute", **update_keys})
    ctx = types.SimpleNamespace(params=p, log=lambda _: None,
                                path=lambda name, *a: "ckpt" if on_policy or name != update.paths.ROLLOUT_CHECKPOINT
                                else "older")
    monkeypatch.setattr(update, "old_logprobs", lambda *a: [torch.tensor(OLD)])
    recomputed = []
    monkeypatch.setattr(update, "behaviour_logprobs",
                        lambda *a: recomputed.append(1) or [torch.tensor([math.log(0.4), math.log(0.2), math.log(0.9)])])
    turns = update.Turns([[7]], [[1, 2, 3]], [1.0], engine_logprobs=[ENGINE])
    out, stats = update.logprob_passes(ctx, None, 0, turns, procs=None)
    return out, stats, recomputed


def test_tis_weighs_each_token_by_the_trainers_over_the_engines_probability(monkeypatch):
    turns, stats, _ = passes(monkeypatch, True, engine_correction="tis")
    assert turns.old_logps[0].tolist() == pytest.approx(OLD)
    assert turns.weights[0].tolist() == pytest.approx([2.0, 0.4, 2.0])
    assert stats["engine_weight_mean"] == pytest.approx(4.4 / 3)
    assert stats["engine_weight_capped_share"] == pytest.approx(2 / 3)
    # KL(engine || trainer) estimated on the engine's samples: mean(log π_engine − log π_old) = log(0.5 x 2.5 / 3) / 3
    assert stats["engine_kl"] == pytest.approx(math.log(1.25 / 3) / 3)
    # the mismatch is still reported: |Δ log p| = log 2, log 2.5, log 3
    assert stats["logprob_mismatch_abs_max"] == pytest.approx(math.log(3.0), abs=1e-6)
    assert stats["logprob_mismatch_abs_mean"] == pytest.approx(math.log(15.0) / 3, abs=1e-6)
    # a higher cap keeps the third token's whole weight
    turns, _, _ = passes(monkeypatch, True, engine_correction="tis", engine_weight_cap=5.0)
    assert turns.weights[0].tolist() == pytest.approx([2.0, 0.4, 3.0])


def test_without_it_the_on_policy_loss_has_no_weights(monkeypatch):
    turns, stats, _ = passes(monkeypatch, True)
    assert turns.weights is None and not any(k.startswith("engine_weight") for k in stats)
    assert "logprob_mismatch_abs_mean" in stats


def test_one_step_off_policy_the_engine_is_the_behaviour_policy(monkeypatch):
    """At lag 1 the behaviour policy's log-probs are the engine's instead of a recomputed pass over the rollout
    checkpoint, and the off-policy cap (5) applies: weights 2, 0.4, 3."""
    turns, stats, recomputed = passes(monkeypatch, False, engine_correction="tis")
    assert recomputed == []
    assert turns.weights[0].tolist() == pytest.approx([2.0, 0.4, 3.0])
    assert stats["behaviour_weight_mean"] == pytest.approx(5.4 / 3)
    # without it the rollout checkpoint is recomputed (0.4, 0.2, 0.9): weights 1.25, 1, 1
    turns, stats, recomputed = passes(monkeypatch, False)
    assert recomputed == [1]
    assert turns.weights[0].tolist() == pytest.approx([1.25, 1.0, 1.0])


def test_a_weight_below_one_shrinks_the_tokens_step():
    """Sign and size: the engine drew the token more often than the trainer would have (weight 0.4), so its
    gradient is 0.4 times the unweighted one, in the same direction (a positive advantage raises its log-prob)."""
    def grad(weight):
        logp = torch.tensor([[math.log(0.2)]], requires_grad=True)
        loss, _ = policy_loss(logp, torch.tensor([[math.log(0.2)]]), torch.tensor([[1.0]]),
                              torch.ones(1, 1, dtype=torch.bool), 0.2, 3.0, weight=weight)
        loss.backward()
        return logp.grad.item()
    plain, weighted = grad(None), grad(torch.tensor([[0.4]]))
    assert plain == pytest.approx(-1.0) and weighted == pytest.approx(-0.4)


def test_tis_with_the_engines_log_probs_as_log_pi_old_is_refused():
    with pytest.raises(ValueError, match="update.engine_correction tis .* set update.old_logprobs: recompute"):
        Params(update={"engine_correction": "tis", "old_logprobs": "engine"})
