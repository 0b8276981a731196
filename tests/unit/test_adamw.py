"""Optimiser state between iterations (`pipeline.model.adamw`, `runtime.keep_optimizer`)."""

import pytest
import torch

from pipeline.model import adamw


def adam_after_steps(lr: float, steps: int):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = torch.optim.AdamW([w], lr=lr, weight_decay=0.0)
    for _ in range(steps):
        opt.zero_grad()
        (w ** 2).sum().backward()
        opt.step()
    return w, opt


def test_restore_loads_the_moments_and_keeps_the_new_learning_rate(tmp_path):
    _, saved = adam_after_steps(0.1, 3)
    adamw.save(saved, tmp_path / "iter_1", "policy")
    w, fresh = adam_after_steps(0.5, 0)
    assert adamw.restore(fresh, tmp_path / "iter_1", "policy", required=True)
    assert fresh.param_groups[0]["lr"] == 0.5                       # the params' learning rate, not the saved 0.1
    state = fresh.state[w]
    assert float(state["step"]) == 3.0
    assert torch.equal(state["exp_avg"], saved.state[saved.param_groups[0]["params"][0]]["exp_avg"])


def test_a_missing_state_is_an_error_after_the_first_iteration(tmp_path):
    _, opt = adam_after_steps(0.1, 0)
    assert not adamw.restore(opt, tmp_path / "iter_0", "policy", required=False)
    with pytest.raises(FileNotFoundError, match=r"iter_3/optimizer/policy\.pt.*keep_optimizer: all"):
        adamw.restore(opt, tmp_path / "iter_3", "policy", required=True)


@pytest.mark.parametrize("keep, left", [("last", [3]), ("all", [1, 2, 3])])
def test_prune_keeps_the_newest_state_or_all(tmp_path, keep, left):
    _, opt = adam_after_steps(0.1, 1)
    for it in (1, 2, 3):
        adamw.save(opt, tmp_path / f"iter_{it}", "policy")
        adamw.save(opt, tmp_path / f"iter_{it}", "reward_model")
        adamw.prune(tmp_path / f"iter_{it}", "policy", keep)
    assert sorted(p.parent.parent.name for p in tmp_path.glob("iter_*/optimizer/policy.pt")) == \
        [f"iter_{i}" for i in left]
    assert len(list(tmp_path.glob("iter_*/optimizer/reward_model.pt"))) == 3   # another model's states stay
