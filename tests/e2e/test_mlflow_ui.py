"""MLflow's UI on a fresh store of the stages' runs, in headless Chromium: `python -m pipeline.workflow.tracking ui`
serves it and prints the address of the experiment's runs, and that page lists the parent runs (not MLflow 3's
GenAI overview, where an experiment opens by default). The experiment carries `mlflow.experimentKind`
= `custom_model_development`, an old experiment gets it when next opened."""

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from pipeline.config.params import Params
from pipeline.workflow.tracking import EXPERIMENT_KIND, Tracker, open_experiment
from tests.conftest import chromium_dom

pytestmark = pytest.mark.e2e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def visible_text(dom: str) -> str:
    text = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", text))


def test_the_ui_opens_the_experiment_on_its_runs(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    raw = {"run": {"dir": "results"}, "tracking": {"tracking_uri": uri}}
    for seed in (0, 1):        # two invocations of the pipeline: two parent runs, a stage's child run under each
        monkeypatch.setenv("CREDITRL_INVOCATION", f"test-{seed}")
        with Tracker(Params.model_validate({**raw, "seed": seed}), "rollout", 1, root=tmp_path) as t:
            t.log_metrics({"train/success_rate": 0.25 * (seed + 1)}, step=1, parent=True)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("creditrl")
    assert exp.tags[EXPERIMENT_KIND[0]] == "custom_model_development"
    # an experiment made before the tag existed gets it when next opened
    old = client.create_experiment("older")
    open_experiment(uri, "older", tmp_path)
    assert client.get_experiment(old).tags[EXPERIMENT_KIND[0]] == "custom_model_development"

    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    port = free_port()
    ui = subprocess.Popen([sys.executable, "-m", "pipeline.workflow.tracking", "ui", "--params", "params.yaml",
                           "--port", str(port)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env={**os.environ, "PYTHONPATH": str(os.getcwd())})
    try:
        first = ui.stdout.readline()
        address = re.search(r"http://\S+", first).group(0)
        assert address == f"http://127.0.0.1:{port}/#/experiments/{exp.experiment_id}?workflowType=machine_learning"
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert ui.poll() is None and time.monotonic() < deadline, "the MLflow UI did not start"
                time.sleep(0.5)
        text = visible_text(chromium_dom(address, tmp_path / "profile", budget_ms=20000))
        for seed in (0, 1):
            assert f"results grpo s{seed}" in text, text[:2000]
        assert "Traces 0" not in text and "Token Usage" not in text      # not the GenAI overview
    finally:
        ui.terminate()
        ui.wait(timeout=30)

