"""The stage tracker opens MLflow in a background thread: metrics logged while it opens still reach the child run
and the parent, the timing split adds up, and a broken store degrades to a warning; a stage's logged peak memory is
its own, not its launcher's."""

import json
import subprocess
import sys

import pytest

from pipeline.config.params import Params
from pipeline.workflow.tracking import Tracker


def test_metrics_logged_during_the_background_start_reach_child_and_parent(tmp_path, monkeypatch):
    monkeypatch.setenv("CREDITRL_INVOCATION", "test-invocation")
    p = Params()
    with Tracker(p, "update", 3, root=tmp_path) as t:
        t.log_metrics({"update/loss": 0.25}, step=3, parent=True)   # most likely before the start has finished
        t.log_metrics({"update/other": 1.5})
    with Tracker(p, "evaluate", 3, root=tmp_path) as t2:
        t2.log_metrics({"eval/success_rate": 0.5}, step=3, parent=True)
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name(p.tracking.experiment)
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    # the parent's name says which run folder, method and seed it is, then the driver (here the env override)
    assert set(runs) == {"update[3]", "evaluate[3]", next(n for n in runs if n.startswith("results grpo s0 env "))}
    parent = next(r for n, r in runs.items() if n.startswith("results grpo s0 env "))
    assert parent.data.tags["creditrl.run_dir"] == str((tmp_path / "results").resolve())
    assert parent.data.metrics == {"update/loss": 0.25, "eval/success_rate": 0.5}   # one parent for both stages
    child = runs["update[3]"]
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.data.metrics["update/loss"] == 0.25 and child.data.metrics["update/other"] == 1.5
    assert child.info.status == "FINISHED" and child.data.params["update.lr"] == str(p.update.lr)
    timing = [json.loads(line)["metrics"] for line in (tmp_path / "results/metrics/update_3.jsonl").read_text()
              .splitlines()][-1]
    assert timing["time/total_s"] == pytest.approx(
        timing["time/startup_s"] + timing["time/tracking_s"] + timing["time/work_s"], abs=0.05)
    assert not (tmp_path / "results/metrics/update_3.unsynced").exists()


def test_a_broken_store_warns_and_marks_the_stage_unsynced(tmp_path, monkeypatch):
    monkeypatch.setenv("CREDITRL_INVOCATION", "test-invocation")
    (tmp_path / "mlflow.db").write_bytes(b"not a database" * 100)
    with pytest.warns(UserWarning, match="MLflow tracking unavailable"):
        with Tracker(Params(), "group", 1, root=tmp_path) as t:
            t.log_metrics({"group/turns": 10.0})
    assert (tmp_path / "results/metrics/group_1.unsynced").exists()
    logged = [json.loads(line) for line in (tmp_path / "results/metrics/group_1.jsonl").read_text().splitlines()]
    assert logged[0]["metrics"] == {"group/turns": 10.0}


def test_a_stage_started_by_a_larger_process_logs_its_own_peak_not_its_parents():
    # a 1.5 GiB parent starts a child that touches 200 MiB: getrusage alone would report the parent's 1.5 GiB
    # (ru_maxrss survives exec); the child's own high-water mark is its 200 MiB plus the interpreter's
    big = bytearray(1536 << 20)
    big[::4096] = b"\1" * len(big[::4096])
    script = ("a = bytearray(200 << 20); a[::4096] = b'\\1' * len(a[::4096]); "
              "from pipeline.workflow.tracking import rss_peak; print(rss_peak()['time/peak_rss_mb'])")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    del big
    peak = float(r.stdout)
    assert 200 < peak < 600, peak


def test_a_stage_that_runs_a_small_command_does_not_count_its_memory_twice():
    # the child `true` inherits the 1 GiB process's high-water mark at fork (its ru_maxrss reads ~1 GiB): added to
    # the stage's own peak, that read 2 GiB
    script = ("import subprocess; a = bytearray(1 << 30); a[::4096] = b'\\1' * len(a[::4096]); "
              "subprocess.run(['true'], check=True); "
              "from pipeline.workflow.tracking import rss_peak; p = rss_peak(); "
              "print(p['time/peak_rss_mb'], p.get('time/children_peak_rss_mb', 0))")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    own, children = map(float, r.stdout.split())
    assert 1024 < own < 1400, own
    assert children > 1000, children      # what the child inherited, reported apart
