"""bench.merge_rounding: what a bf16 merge keeps of a LoRA update, by hand on weights whose bf16 spacing is known."""
import pytest
import torch

from bench import merge_rounding as mr


def _adapter(b: list[float], a: list[float]) -> dict[str, torch.Tensor]:
    """A rank-1 adapter on one 1 x 2 weight: dW = B A (B is 1 x 1, A is 1 x 2)."""
    return {"base_model.model.layer.lora_A.weight": torch.tensor([a]),
            "base_model.model.layer.lora_B.weight": torch.tensor([[b[0]]])}


def test_an_update_below_half_the_spacing_is_rounded_away_and_one_of_a_whole_spacing_is_kept():
    # bf16 keeps 8 significant bits: at 1.0 the spacing is 2^-7, so half of it is 2^-8
    base = {"layer.weight": torch.tensor([[1.0, 1.0]])}
    small = mr.rounding(base, _adapter([1.0], [2.0 ** -9, 2.0 ** -9]), 1.0)
    assert small["kept"] == 0.0 and small["error"] == pytest.approx(1.0) and small["lost"] == 1.0
    whole = mr.rounding(base, _adapter([1.0], [2.0 ** -7, 2.0 ** -7]), 1.0)
    assert whole["kept"] == 1.0 and whole["error"] == 0.0 and whole["lost"] == 0.0


def test_a_mixed_update_keeps_the_share_of_its_square_norm_that_survives():
    # entry 1: 2^-7 at 1.0 survives; entry 2: 2^-9 at 1.0 is lost. kept = (2^-14) / (2^-14 + 2^-18) = 16/17;
    # error = |(0, -2^-9)| / |dW| = 2^-9 / sqrt(2^-14 + 2^-18) = sqrt(1/17); the scale (alpha / r) multiplies dW
    base = {"layer.weight": torch.tensor([[1.0, 1.0]])}
    r = mr.rounding(base, _adapter([0.5], [2.0 ** -7, 2.0 ** -9]), 2.0)
    assert r["kept"] == pytest.approx(16 / 17, abs=1e-9)
    assert r["error"] == pytest.approx((1 / 17) ** 0.5, abs=1e-9)
    assert r["lost"] == 0.5


def test_the_spacing_follows_the_weight_and_a_missing_base_weight_is_named():
    # at 4.0 the spacing is 2^-5: an update of 2^-7 (a whole spacing at 1.0) is below half of it there
    r = mr.rounding({"layer.weight": torch.tensor([[4.0, 1.0]])}, _adapter([1.0], [2.0 ** -7, 2.0 ** -7]), 1.0)
    assert r["lost"] == 0.5 and r["kept"] == pytest.approx(0.5)
    with pytest.raises(KeyError, match="the base has no layer.weight"):
        mr.rounding({"other.weight": torch.ones(1, 2)}, _adapter([1.0], [1.0, 1.0]), 1.0)
    with pytest.raises(ValueError, match="update is zero"):
        mr.rounding({"layer.weight": torch.ones(1, 2)}, _adapter([0.0], [1.0, 1.0]), 1.0)


def test_an_update_to_a_zero_weight_is_kept_not_counted_lost():
    # at 0.0 bf16 holds 2^-10 exactly; at 1.0 it rounds 1 + 2^-10 back to 1: kept 1/2, lost 1/2
    r = mr.rounding({"layer.weight": torch.tensor([[0.0, 1.0]])}, _adapter([1.0], [2.0 ** -10, 2.0 ** -10]), 1.0)
    assert r["kept"] == pytest.approx(0.5) and r["lost"] == 0.5
