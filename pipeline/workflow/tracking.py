"""MLflow tracking: one parent run per pipeline invocation, one child run per stage and iteration.

Every stage uses one absolute tracking URI (default: the SQLite database `mlflow.db` at the repository root) and
artifacts under `mlartifacts/` there. The parent run is found by the invocation's key: the process id and start
time of the `snakemake` or `dvc` process that launched the stage (a stage run by hand gets its own parent). A file
lock makes parallel stages agree on one parent.

Tracking is not a single point of failure: if MLflow cannot be reached the stage warns, goes on, and its metrics
are still in `results/metrics/` (written whatever happens to MLflow).

Opening the store (importing MLflow, checking the database schema, creating the runs) is a large share of a short
stage. It runs in a background thread while the stage works; the first call that needs the
runs waits for it, and only that wait counts as the stage's tracking time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import psutil
from filelock import FileLock

from pipeline.config.params import Params, load_params, params_dict
from pipeline.workflow.threads import in_effect

INVOCATION_TAG = "creditrl.invocation"


def repo_root() -> Path:
    return Path(os.environ.get("CREDITRL_ROOT", Path.cwd())).resolve()


def tracking_uri(params: Params, root: Path | None = None) -> str:
    root = root or repo_root()
    if params.tracking.tracking_uri:
        return params.tracking.tracking_uri
    return f"sqlite:///{root / 'mlflow.db'}"


# The tag by which MLflow 3 marks a model-training experiment (not GenAI). MLflow 3.17's UI does not read it to choose
# the page an experiment opens on (`runs_page` says what does); other versions' may.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


def open_experiment(uri: str, experiment: str, root: Path):
    """(client, experiment id) of `experiment` in the MLflow store at `uri`, created (with its artifacts under
    `root/mlartifacts`) where it does not exist yet. The stages, `sync` and the benchmarks open MLflow here.

    Every experiment carries `EXPERIMENT_KIND` (an existing one gets it when next opened); the address that opens
    MLflow 3.17's UI on the table of runs is `runs_page`'s."""
    from mlflow import MlflowClient  # start-up cost: MLflow's import is slow, and tracking may be off

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        exp_id = client.create_experiment(experiment, artifact_location=(root / "mlartifacts").as_uri(),
                                          tags=dict([EXPERIMENT_KIND]))
        return client, exp_id
    if exp.tags.get(EXPERIMENT_KIND[0]) != EXPERIMENT_KIND[1]:
        client.set_experiment_tag(exp.experiment_id, *EXPERIMENT_KIND)
    return client, exp.experiment_id


def invocation() -> tuple[str, str]:
    """(key, driver): the nearest ancestor that is snakemake or dvc identifies this pipeline invocation."""
    override = os.environ.get("CREDITRL_INVOCATION")
    if override:
        return override, "env"
    try:

        proc = psutil.Process().parent()
        while proc is not None and proc.pid > 1:
            cmd = " ".join(proc.cmdline()).lower()
            for driver in ("snakemake", "dvc"):
                if driver in Path(proc.cmdline()[0]).name.lower() or f"/{driver} " in cmd or f"-m {driver}" in cmd \
                        or (len(proc.cmdline()) > 1 and Path(proc.cmdline()[1]).name.lower() == driver):
                    return f"{driver}-{proc.pid}-{int(proc.create_time())}", driver
            proc = proc.parent()
    except Exception:  # noqa: BLE001 - process inspection is best effort
        pass
    return f"manual-{os.getpid()}-{int(time.time())}", "manual"


def gpu_peak() -> dict[str, float]:
    """`time/gpu_peak_mb`: the most GPU memory torch held at once in this process, where it used a GPU."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {"time/gpu_peak_mb": max(torch.cuda.max_memory_allocated(d) for d in range(torch.cuda.device_count()))
            / 2**20}


def rss_peak() -> dict[str, float]:
    """`time/peak_rss_mb`: the most resident memory this process held at once (the kernel's own count, so a stage
    forked by the fork server or shorter than a sampler's interval is measured too); and
    `time/children_peak_rss_mb`: the largest of its finished children's peaks (an engine process, a compiler).

    The process's own peak is its memory's high-water mark (VmHWM in /proc/self/status) where Linux has one:
    getrusage's ru_maxrss is carried over exec from the parent, so a stage that Snakemake or a bench started
    would read its launcher's peak where that was larger. For the same reason a child's peak starts at what this
    process held when it forked the child, even one that only runs `true`: it is reported apart, never added to
    the stage's own (that sum counted the stage twice)."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        status = Path("/proc/self/status").read_text()
        own = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
    except (OSError, StopIteration, IndexError, ValueError):
        pass
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"time/peak_rss_mb": own / 1024, "time/children_peak_rss_mb": children / 1024}


class Tracker:
    """Child run of a stage; every call is safe when MLflow is down (it warns once and goes on)."""

    def __init__(self, params: Params, stage: str, iteration: int | None, root: Path | None = None,
                 metrics_dir: Path | None = None, run_name: str | None = None, tags: dict[str, str] | None = None):
        """`metrics_dir` (default `results/metrics`) holds the metrics file; `run_name` and `tags` name and tag the
        child run (default `stage[iteration]`)."""
        self.params = params
        self.stage = stage
        self.iteration = iteration
        self.root = root or repo_root()
        self.client = None
        self.run_id = None
        self.parent_id = None
        self.run_name = run_name
        self.tags = tags or {}
        self.metrics_file = (metrics_dir or self.root / params.run.dir / "metrics") / (
            f"{stage}.jsonl" if iteration is None else f"{stage}_{iteration}.jsonl")
        self.metrics_file.parent.mkdir(parents=True, exist_ok=True)
        self.metrics_file.write_text("")
        self.unsynced_marker = self.metrics_file.with_suffix(".unsynced")
        self.unsynced_marker.unlink(missing_ok=True)
        self.t_enter = time.time()
        self.tracking_s = 0.0  # time the stage spent waiting for MLflow
        self._finished = False
        self._starter = None
        if params.tracking.enabled:
            self._starter = threading.Thread(target=self._guard, args=(self._start,), name="mlflow-start",
                                             daemon=True)
            self._starter.start()

    def wait_started(self) -> None:
        """Block until the background start has finished (successfully or not)."""
        if self._starter is not None and self._starter is not threading.current_thread():
            t = time.time()
            self._starter.join()
            self._starter = None
            self.tracking_s += time.time() - t

    def _guard(self, fn, *args):
        starting = fn == self._start
        if not starting:
            self.wait_started()
        if self.params.tracking.enabled and (self.client is not None or starting):
            t = time.time()
            try:
                return fn(*args)
            except Exception as e:  # noqa: BLE001 - tracking must never stop the pipeline
                warnings.warn(f"MLflow tracking unavailable ({type(e).__name__}: {e}); metrics are still written to "
                              f"{self.metrics_file}; `python -m pipeline.workflow.tracking sync` logs them later",
                              stacklevel=3)
                self.unsynced_marker.write_text(f"{type(e).__name__}: {e}\n")
                self.client = None
            finally:
                if not starting:
                    self.tracking_s += time.time() - t
        return None

    def _start(self) -> None:

        key, driver = invocation()
        with FileLock(str(self.root / ".mlflow.lock"), timeout=60):
            client, exp_id = open_experiment(tracking_uri(self.params, self.root), self.params.tracking.experiment,
                                             self.root)
            found = client.search_runs(
                [exp_id], filter_string=f"tags.`{INVOCATION_TAG}` = '{key}' and tags.`creditrl.role` = 'parent'",
                max_results=1)
            if found:
                parent = found[0].info.run_id
            else:
                run = client.create_run(exp_id, run_name=f"{self._run_label()} {driver} "
                                        f"{time.strftime('%Y-%m-%d %H:%M:%S')}",
                                        tags={INVOCATION_TAG: key, "creditrl.driver": driver, "creditrl.role": "parent",
                                              **self._run_tags()})
                parent = run.info.run_id
                self._log_params(client, parent)
        name = self.run_name or (self.stage if self.iteration is None else f"{self.stage}[{self.iteration}]")
        tags = {"mlflow.parentRunId": parent, "creditrl.stage": self.stage, INVOCATION_TAG: key,
                "creditrl.role": "stage", **self._run_tags(), **self.tags}
        if self.iteration is not None:
            tags["creditrl.iteration"] = str(self.iteration)
        child = client.create_run(exp_id, run_name=name, tags=tags)
        self._log_params(client, child.info.run_id)
        self.client, self.run_id, self.parent_id = client, child.info.run_id, parent

    def _run_tags(self) -> dict[str, str]:
        """What tells runs apart in MLflow: the run folder, the credit method and the seed."""
        return {"creditrl.run_dir": str((self.root / self.params.run.dir).resolve()),
                "creditrl.method": self.params.credit.method, "creditrl.seed": str(self.params.seed)}

    def _run_label(self) -> str:
        return f"{self.params.run.dir} {self.params.credit.method} s{self.params.seed}"

    def _log_params(self, client, run_id: str) -> None:
        from mlflow.entities import Param  # start-up cost: MLflow

        items = [Param(k, str(v)[:6000]) for k, v in params_dict(self.params).items()]
        for i in range(0, len(items), 100):
            client.log_batch(run_id, params=items[i: i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None, parent: bool = False) -> None:
        """Log to the child run (and to the parent with `parent=True`); always appended to the metrics file."""
        record = {"stage": self.stage, "iteration": self.iteration, "step": step, "parent": parent,
                  "time": time.time(), "metrics": metrics}
        with self.metrics_file.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self._guard(self._log_metrics, metrics, step, parent)

    def _log_metrics(self, metrics, step, parent) -> None:
        from mlflow.entities import Metric  # start-up cost: MLflow

        ts = int(time.time() * 1000)
        batch = [Metric(k, float(v), ts, step or 0) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)
        if parent:
            self.client.log_batch(self.parent_id, metrics=batch)

    def log_artifact(self, path: str | Path, parent: bool = False) -> None:
        self._guard(lambda: self.client.log_artifact(self.parent_id if parent else self.run_id, str(path)))

    def _log_timing(self) -> None:
        """`time/*` metrics of this stage process: start-up (interpreter and module imports, up to the tracker),
        tracking (time the stage waited for MLflow; the store opens in the background), work (the rest); read by
        `bench.breakdown`."""
        try:

            started = psutil.Process().create_time()
        except Exception:  # noqa: BLE001 - best effort
            return
        self.wait_started()
        now = time.time()
        self.log_metrics({"time/startup_s": max(self.t_enter - started, 0.0), "time/tracking_s": self.tracking_s,
                          "time/work_s": max(now - self.t_enter - self.tracking_s, 0.0),
                          "time/total_s": now - started} | in_effect() | gpu_peak() | rss_peak())

    def finish(self, status: str = "FINISHED", end_parent: bool = False) -> None:
        if not self._finished:
            self._finished = True
            if status == "FINISHED":
                self._log_timing()

        def _end():
            self.client.set_terminated(self.run_id, status=status)
            if end_parent:
                self.client.set_terminated(self.parent_id, status=status)

        self._guard(_end)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.finish("FAILED" if exc_type else "FINISHED")
        return False


def sync(params: Params, root: Path | None = None) -> int:
    """Log to MLflow every stage whose tracking failed (a `results/metrics/*.unsynced` marker beside its
    metrics file): one parent run for this sync, a child run per stage with its params and every metric record
    (parent-level ones on the parent too). Returns the number of stages synced; markers go once synced."""
    from mlflow.entities import Metric  # start-up cost: MLflow

    root = root or repo_root()
    markers = sorted((root / params.run.dir / "metrics").glob("*.unsynced"))
    if not markers:
        return 0
    client, exp_id = open_experiment(tracking_uri(params, root), params.tracking.experiment, root)
    parent = client.create_run(exp_id, run_name=f"sync {time.strftime('%Y-%m-%d %H:%M:%S')}",
                               tags={"creditrl.role": "parent", "creditrl.driver": "sync",
                                     "creditrl.method": params.credit.method}).info.run_id
    t = Tracker.__new__(Tracker)
    t.params = params
    t._log_params(client, parent)
    for marker in markers:
        records = [json.loads(line) for line in marker.with_suffix(".jsonl").read_text().splitlines() if line]
        stage = marker.stem
        child = client.create_run(exp_id, run_name=stage, tags={
            "mlflow.parentRunId": parent, "creditrl.role": "stage", "creditrl.synced": "true",
            "creditrl.stage": records[0]["stage"] if records else stage})
        t._log_params(client, child.info.run_id)
        for rec in records:
            ts = int(rec["time"] * 1000)
            batch = [Metric(k, float(v), ts, rec["step"] or 0) for k, v in rec["metrics"].items()]
            client.log_batch(child.info.run_id, metrics=batch)
            if rec.get("parent"):
                client.log_batch(parent, metrics=batch)
        client.set_terminated(child.info.run_id)
        marker.unlink()
    client.set_terminated(parent)
    return len(markers)


def runs_page(params: Params, port: int, root: Path | None = None) -> str:
    """The address of the MLflow UI's table of the experiment's runs. MLflow 3.17's UI takes the page an experiment
    opens on from its workflow switch (the `workflowType` query, then the browser's last choice, GenAI by default),
    not from `EXPERIMENT_KIND`; the query opens it on the runs."""
    root = root or repo_root()
    _, exp_id = open_experiment(tracking_uri(params, root), params.tracking.experiment, root)
    return f"http://127.0.0.1:{port}/#/experiments/{exp_id}?workflowType=machine_learning"


def main(argv=None) -> None:

    ap = argparse.ArgumentParser(prog="python -m pipeline.workflow.tracking",
                                 description="sync: log to MLflow the stages whose tracking failed during a run. "
                                 "ui: serve the MLflow UI on the run's store and print the address of its runs.")
    ap.add_argument("command", choices=["sync", "ui"])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--port", type=int, default=5000, help="ui: the port on 127.0.0.1")
    args = ap.parse_args(argv)
    params = load_params(args.params)
    if args.command == "ui":
        print(f"MLflow UI of {tracking_uri(params)}: the runs of {params.tracking.experiment!r} at "
              f"{runs_page(params, args.port)}", flush=True)
        os.execvp(sys.executable, [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", tracking_uri(params),
                                   "--host", "127.0.0.1", "--port", str(args.port)])
    n = sync(params)
    print(f"synced {n} stage(s) to {tracking_uri(params)}")


if __name__ == "__main__":
    main()
