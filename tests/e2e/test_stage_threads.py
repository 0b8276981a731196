"""runtime.torch_threads in a stage that loads torch, started as the workflow starts it."""

import os

import pytest
import yaml

from tests.conftest import ROOT
from tests.unit.test_threads import run_stage


@pytest.mark.e2e
@pytest.mark.hardware
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores to tell 1 thread from all")
def test_a_torch_stage_runs_with_the_requested_threads(tmp_path):
    params = yaml.safe_load((ROOT / "tests" / "tiny_params.yaml").read_text())
    params["runtime"] = {"torch_threads": 1}
    params["tracking"] = {"enabled": False}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(params))
    _, metrics = run_stage(tmp_path, "init")
    assert metrics["runtime/torch_threads"] == 1
