"""`update.skip_zero_advantage`: the update leaves out the turns whose advantage is 0 and trains exactly what it
trains on tables that never held them; an iteration whose turns all have advantage 0 leaves the weights as they
were."""

import subprocess
import sys

import polars as pl
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import continue_grpo_run

pytestmark = pytest.mark.e2e

STEPS = "results/iter_1/steps.parquet"
ADVANTAGES = "results/iter_1/advantages.parquet"
CHECKPOINT = "results/iter_1/checkpoint/model.safetensors"
TERMS = ("episode_advantage", "step_advantage", "penalty", "advantage")


def _copy(grpo_run, d, **update):
    """The shared tiny run continued in `d`, the engine's log-probs as log pi_old (so that leaving turns out leaves
    no other pass over them) and `update` merged into its section; the advantages of the episodes with an even id
    set to 0 (the tiny run's rewards leave none at 0). Returns those turns."""
    continue_grpo_run(grpo_run, d, update={"old_logprobs": "engine", **update})
    adv = pl.read_parquet(d / ADVANTAGES)
    even = pl.col("episode_id") % 2 == 0
    zeroed = (pl.when(even).then(0.0).otherwise(pl.col(c)).alias(c) for c in TERMS)
    adv.with_columns(zeroed).write_parquet(d / ADVANTAGES)
    return adv.filter(even).select("episode_id", "step")


def _update(d):
    """Iteration 1's update in `d`, in one process: its weights and output."""
    r = subprocess.run([sys.executable, "-m", "stages.update", "--params", "params.yaml", "--iteration", "1"], cwd=d,
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return load_file(d / CHECKPOINT), r.stdout + r.stderr


def _assert_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0)


def test_turns_with_zero_advantage_are_left_out_and_the_rest_train_as_if_alone(grpo_run, tmp_path):
    zero = _copy(grpo_run, tmp_path / "skip", skip_zero_advantage=True)
    original = pl.read_parquet(grpo_run / ADVANTAGES)
    total = original.height
    assert 0 < zero.height < total
    assert original.filter(pl.col("advantage") == 0.0).height == 0
    skipped, out = _update(tmp_path / "skip")
    assert f"{zero.height} of {total} turns have advantage 0 and are left out; {total - zero.height} train" in out

    # the update without the option on tables from which those turns were removed: the same weights, bit for bit
    d = tmp_path / "removed"
    _copy(grpo_run, d)
    for name in (STEPS, ADVANTAGES):
        pl.read_parquet(d / name).join(zero, on=["episode_id", "step"], how="anti").write_parquet(d / name)
    removed, _ = _update(d)
    _assert_equal(skipped, removed)

    # and not what the update of every turn trains
    _copy(grpo_run, tmp_path / "every")
    every, _ = _update(tmp_path / "every")
    assert any(not torch.equal(skipped[k], every[k]) for k in every)


def test_an_iteration_whose_advantages_are_all_zero_keeps_the_weights(grpo_run, tmp_path):
    d = tmp_path / "all_zero"
    _copy(grpo_run, d, skip_zero_advantage=True, old_logprobs="recompute", kl_coef=0.1)   # no pass over no turns
    t = pl.read_parquet(d / ADVANTAGES)
    t.with_columns(pl.lit(0.0).alias(c) for c in TERMS).write_parquet(d / ADVANTAGES)
    weights, out = _update(d)
    assert f"{t.height} of {t.height} turns have advantage 0 and are left out; 0 train" in out
    _assert_equal(weights, load_file(grpo_run / "results/iter_0/checkpoint/model.safetensors"))
