"""Sharded rollout and evaluation: N shard jobs and a merge write the tables the unsharded stage writes, byte for
byte, because every response is sampled with its episode's own seed in a batch that does not depend on N."""

import shutil
import subprocess

import pytest
import torch
import yaml

from pipeline.config.params import ParamsError, load_params
from pipeline.model.policy import _SeededSampling
from pipeline.rollout.shards import ShardError, shard_slices
from tests.conftest import ROOT, SNAKEMAKE, planned_jobs, snakemake_failure, workflow_files


def test_shards_are_whole_batches_starting_on_a_task():
    # 10 episodes in batches of 4: blocks [0,4) [4,8) [8,10); two shards take 1 and 2 blocks
    assert shard_slices(10, 4, 2, 2, "rollout.shards") == [range(0, 4), range(4, 10)]
    assert shard_slices(10, 4, 3, 2, "rollout.shards") == [range(0, 4), range(4, 8), range(8, 10)]
    assert shard_slices(10, 4, 1, 3, "rollout.shards") == [range(0, 10)]      # one shard: any batch size
    with pytest.raises(ShardError, match=r"rollout.shards: 4 shards, but its 10 episodes make only 3 batch"):
        shard_slices(10, 4, 4, 2, "rollout.shards")
    with pytest.raises(ShardError, match=r"rollout.batch_size \(4\) must be a multiple of the episodes per task \(3\)"):
        shard_slices(12, 4, 2, 3, "rollout.shards")


def test_params_refuse_more_shards_than_batches(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"evaluate": {"shards": 2}}))   # 256 held-out episodes, one batch of 256
    with pytest.raises(ParamsError, match=r"evaluate.shards: 2 shards, but its 256 episodes make only 1 batch"):
        load_params(f)


def test_seeded_sampling_draws_from_the_tempered_softmax_whatever_the_batch():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    temperature = 0.7
    n = 20000
    rows = logits.repeat(n, 1)
    picks = _SeededSampling(temperature, list(range(n)), torch.device("cpu"))(None, rows).argmax(-1)
    freq = torch.bincount(picks, minlength=4).double() / n
    expected = torch.softmax(logits[0].double() / temperature, -1)      # 0.786, 0.189, 0.0451, 0.0108
    assert torch.allclose(freq, expected, atol=0.01), (freq, expected)
    # row 7's draw is its own: alone, or among other rows, it picks the same token at every step
    other = torch.tensor([[0.0, 0.0, 3.0, 0.0]])
    alone = _SeededSampling(temperature, [7], torch.device("cpu"))
    mixed = _SeededSampling(temperature, [1, 7, 2], torch.device("cpu"))
    for _ in range(20):
        assert alone(None, logits).argmax(-1).item() == mixed(None, torch.cat([other, logits, other])).argmax(-1)[1]


def _params(d, name: str, shards: int, **run) -> str:
    p = yaml.safe_load((ROOT / "tests" / "tiny_params.yaml").read_text())
    p["loop"]["iterations"] = 1
    p["rollout"].update(tasks_per_iteration=3, group_size=2, batch_size=2, shards=shards)   # 3 batches of 2
    p["evaluate"].update(tasks=3, episodes_per_task=2, shards=shards)
    p["tracking"] = {"enabled": False}
    p["run"] = {"dir": f"results_{name}", **run}
    (d / f"{name}.yaml").write_text(yaml.safe_dump(p))
    return f"{name}.yaml"


TABLES = ("iter_1/steps.parquet", "iter_0/eval.parquet", "iter_0/eval_metrics.json")


@pytest.mark.e2e
def test_three_shards_write_the_tables_of_one(tmp_path):
    workflow_files(tmp_path)
    one = _params(tmp_path, "one", 1)
    three = _params(tmp_path, "three", 3, base={"params": "one.yaml", "through": 0})   # the same initial policy
    targets = [f"results_one/{t}" for t in TABLES]
    r = subprocess.run([SNAKEMAKE, *targets, "--cores", "2", "--quiet", "--config", f"params={one}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        pytest.fail(snakemake_failure(tmp_path, r))
    plan = planned_jobs(tmp_path, three)
    assert {"rollout_shard@1-0", "rollout_shard@1-1", "rollout_shard@1-2", "rollout@1",
            "evaluate_shard@0-0", "evaluate_shard@0-2", "evaluate@0"} <= plan
    assert "init" not in plan
    r = subprocess.run([SNAKEMAKE, *[t.replace("results_one", "results_three") for t in targets], "--cores", "2",
                        "--quiet", "--config", f"params={three}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        pytest.fail(snakemake_failure(tmp_path, r))
    assert sorted(p.name for p in (tmp_path / "results_three/iter_1/shards").iterdir()) == [
        "rollout_0.parquet", "rollout_1.parquet", "rollout_2.parquet"]
    assert sorted(p.name for p in (tmp_path / "results_three/iter_0/shards").iterdir()) == [
        "evaluate_0.parquet", "evaluate_1.parquet", "evaluate_2.parquet"]
    for t in TABLES:
        assert (tmp_path / "results_one" / t).read_bytes() == (tmp_path / "results_three" / t).read_bytes(), t
    shutil.rmtree(tmp_path / "results_one")
