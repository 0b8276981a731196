"""Benchmarks: each writes CSV and PNG under `results/bench/` and logs one MLflow run.

Run with `python -m bench.<name>`; see each module's docstring. They are not timed tests; CI runs a tiny smoke
version of each (tests/e2e/test_bench.py).
"""

from __future__ import annotations

import os
import platform
import time
import warnings
from pathlib import Path

from pipeline.workflow import tracking

EXPERIMENT = "creditrl-bench"


def cpuinfo_fields(cpuinfo: str | None = None) -> dict[str, str]:
    """/proc/cpuinfo (or `cpuinfo`'s text) as key -> value, each key's first occurrence (the first processor's);
    empty where the file cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_name() -> str:
    """The CPU's model name (every figure names its machine)."""
    fields = cpuinfo_fields()
    return fields["model name"] if "model name" in fields else platform.processor() or "unknown"


def cpu_generation(cpuinfo: str | None = None) -> dict[str, int]:
    """The CPU's family and model numbers (`cpu_family`, `cpu_model` from /proc/cpuinfo, or `cpuinfo`'s text), which
    tell apart processors a virtual machine names alike: an AMD EPYC of family 25 (Zen 3, Zen 4) from one of family
    26 (Zen 5). Empty where the file does not give them."""
    fields = cpuinfo_fields(cpuinfo)
    return {name: int(fields[key]) for key, name in (("cpu family", "cpu_family"), ("model", "cpu_model"))
            if fields.get(key, "").isdigit()}


def label_seed(name: str) -> tuple[str, int]:
    """A bench run folder's arm label and seed from its name, `<label>_s<seed>`."""
    label, _, seed = name.rpartition("_s")
    return label, int(seed)


def open_experiment(root: Path | None = None):
    """(client, experiment id) of the benchmarks' experiment in the repository's MLflow store (`mlflow.db` at the
    repository root, or `CREDITRL_TRACKING_URI`); raises where MLflow is unavailable."""
    root = (root or tracking.repo_root()).resolve()
    uri = os.environ.get("CREDITRL_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    return tracking.open_experiment(uri, EXPERIMENT, root)


def log_run(name: str, params: dict, metrics: dict[str, float], artifacts: list[Path],
            root: Path | None = None, children=()) -> str | None:
    """Log one benchmark run to the repository's MLflow store (experiment `creditrl-bench`); never raises.

    `children`: callables `(client, experiment_id, parent_run_id)` that add child runs under it. If MLflow is
    unavailable the benchmark's CSV and PNG are still on disk; this warns and returns None.
    """
    try:
        from mlflow.entities import Metric, Param  # start-up cost: MLflow

        client, exp_id = open_experiment(root)
        run = client.create_run(exp_id, run_name=f"{name} {time.strftime('%Y-%m-%d %H:%M:%S')}",
                                tags={"creditrl.bench": name})
        rid = run.info.run_id
        ts = int(time.time() * 1000)
        client.log_batch(rid, params=[Param(k, str(v)[:6000]) for k, v in params.items()],
                         metrics=[Metric(k, float(v), ts, 0) for k, v in metrics.items()])
        for a in artifacts:
            client.log_artifact(rid, str(a))
        for child in children:
            child(client, exp_id, rid)
        client.set_terminated(rid)
        return rid
    except Exception as e:  # noqa: BLE001 - tracking must never fail a benchmark
        warnings.warn(f"MLflow unavailable for benchmark {name} ({type(e).__name__}: {e}); results are on disk",
                      stacklevel=2)
        return None
