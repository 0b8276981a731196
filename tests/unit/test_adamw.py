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


@pytest.mark.parametrize("keep, left, finished", [("last", [2, 3], [3]), ("all", [1, 2, 3], [1, 2, 3])])
def test_prune_keeps_the_state_resumed_from_until_the_run_is_finished(tmp_path, keep, left, finished):
    """Each stage deletes the states before the one it resumed from: killed after pruning and before its process
    exits, it is rerun by Snakemake from that state, which is still there. The report stage leaves the newest."""
    _, opt = adam_after_steps(0.1, 1)
    for it in (1, 2, 3):
        adamw.save(opt, tmp_path / f"iter_{it}", "policy")
        adamw.save(opt, tmp_path / f"iter_{it}", "reward_model")
        adamw.prune(tmp_path / f"iter_{it}", "policy", keep)

    def states(name):
        return sorted(int(p.parent.parent.name[5:]) for p in tmp_path.glob(f"iter_*/optimizer/{name}.pt"))
    assert states("policy") == left
    assert states("reward_model") == [1, 2, 3]                     # another model's states stay
    # the update of 3 rerun (killed after it pruned): it resumes from iteration 2's state
    _, fresh = adam_after_steps(0.1, 0)
    assert adamw.restore(fresh, tmp_path / "iter_2", "policy", required=True)
    adamw.prune_finished(tmp_path, keep)
    assert states("policy") == finished and states("reward_model") == finished
    assert not (tmp_path / "iter_1" / "optimizer").exists() or keep == "all"   # an emptied folder goes too
