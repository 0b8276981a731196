"""`bench.precision`'s attribution of a profile: operators by kind, events by phase, overhead as the rest."""

import pytest
import torch

from bench.precision import attribute, kind


@pytest.mark.parametrize("name, expected", [
    ("aten::mm", "matmul"), ("aten::addmm", "matmul"), ("aten::bmm", "matmul"), ("aten::linear", "matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
    ("aten::index", "gather/copy"), ("aten::index_put_", "gather/copy"), ("aten::copy_", "gather/copy"),
    ("aten::cat", "gather/copy"), ("aten::embedding_dense_backward", "gather/copy"),
    ("aten::mul", "elementwise"), ("aten::add_", "elementwise"), ("aten::_foreach_mul_", "elementwise"),
    ("aten::_log_softmax", "elementwise"), ("aten::addcdiv_", "elementwise"),
    ("aten::view", "other op"), ("aten::transpose", "other op"),
])
def test_kinds_of_operators(name, expected):
    assert kind(name) == expected


def test_a_profile_splits_into_forward_backward_and_optimizer():
    torch.manual_seed(0)
    w = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(w.parameters(), lr=1e-3)
    x = torch.randn(64, 256)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss = w(x).square().mean()
        loss.backward()
        opt.step()
    table, top = attribute(prof.events(), wall_s=10.0)
    assert table[("forward", "matmul")] > 0 and table[("backward", "matmul")] > 0
    assert sum(s for (ph, _), s in table.items() if ph == "optimizer") > 0
    assert sum(table.values()) == pytest.approx(10.0)              # the overhead is what the operators leave
    assert table[("overhead", "python")] > 9.0
    names = {(n, ph) for n, ph, _, _ in top}
    assert ("aten::addmm", "forward") in names and ("aten::mm", "backward") in names
