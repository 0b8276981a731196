"""The fork server (`runtime.fork_server`, on in tests/tiny_params.yaml, so the shared runs use it): a stage forked
from it writes the bytes a plain process writes, fails with the plain process's message and status, dies with its
launcher, and a launcher with no server behind it runs the stage itself."""

import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import yaml

from pipeline.workflow import forkserver
from tests.conftest import SNAKEMAKE, snakemake_failure

pytestmark = pytest.mark.e2e


def test_the_shared_run_used_the_server_and_a_plain_rerun_writes_the_same_bytes(grpo_run, tmp_path):
    params = yaml.safe_load((grpo_run / "params.yaml").read_text())
    assert params["runtime"]["fork_server"] is True
    d = tmp_path / "plain"
    shutil.copytree(grpo_run, d, symlinks=True, ignore=shutil.ignore_patterns("mlflow.db", "mlartifacts"))
    params["runtime"]["fork_server"] = False            # no stage's params: nothing reruns for it
    params["tracking"] = {"enabled": False}
    (d / "params.yaml").write_text(yaml.safe_dump(params))
    for rel in ("iter_1/advantages.parquet", "iter_1/checkpoint", "iter_1/optimizer"):
        p = d / "results" / rel
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():                                # the optimiser state: only the last iteration's is kept
            p.unlink()
    r = subprocess.run([SNAKEMAKE, "results/iter_1/checkpoint", "--cores", "1"], cwd=d, capture_output=True,
                       text=True, timeout=600)
    if r.returncode != 0:
        pytest.fail(snakemake_failure(d, r))
    for rel in ("iter_1/advantages.parquet", "iter_1/checkpoint/model.safetensors"):
        assert (d / "results" / rel).read_bytes() == (grpo_run / "results" / rel).read_bytes(), rel


@pytest.fixture
def server(monkeypatch):
    monkeypatch.delenv(forkserver.ENV, raising=False)
    forkserver.start(True)
    assert os.environ.get(forkserver.ENV)
    yield forkserver._server["proc"]
    forkserver.stop()
    assert forkserver.ENV not in os.environ


def _stage(args, cwd, **kw):
    return subprocess.Popen([sys.executable, "-m", *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def test_a_failing_stage_fails_alike_forked_or_plain(server, tmp_path):
    (tmp_path / "bad.yaml").write_text("loop: {iterations: -1}\n")
    forked = _stage(["stages.group", "--params", "bad.yaml", "--iteration", "1"], tmp_path)
    out_f, err_f = forked.communicate(timeout=120)
    env = {k: v for k, v in os.environ.items() if k != forkserver.ENV}
    plain = _stage(["stages.group", "--params", "bad.yaml", "--iteration", "1"], tmp_path, env=env)
    out_p, err_p = plain.communicate(timeout=120)
    assert forked.returncode == plain.returncode == 2                      # a params error's status
    assert err_f == err_p and "loop.iterations" in err_p and out_f == out_p
    assert [c.pid for c in psutil.Process(server.pid).children()] == []     # the child was reaped


def test_a_killed_launcher_takes_its_stage_with_it(server, grpo_run, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(grpo_run, d, symlinks=True, ignore=shutil.ignore_patterns("mlflow.db", "mlartifacts"))
    shutil.rmtree(d / "results/iter_0/checkpoint")
    launcher = _stage(["stages.init", "--params", "params.yaml"], d)
    deadline = time.monotonic() + 60
    while not (children := psutil.Process(server.pid).children()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(children) == 1
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    assert psutil.wait_procs(children, timeout=10)[1] == []                 # gone, not left running
    assert not (d / "results/iter_0/checkpoint").exists()


def test_a_launcher_without_a_server_runs_the_stage_itself(tmp_path, monkeypatch):
    monkeypatch.setenv(forkserver.ENV, str(tmp_path / "no-such-socket"))
    (tmp_path / "bad.yaml").write_text("loop: {iterations: -1}\n")
    r = subprocess.run([sys.executable, "-m", "stages.group", "--params", "bad.yaml", "--iteration", "1"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "loop.iterations" in r.stderr


def test_a_server_whose_code_changed_refuses_and_the_stage_runs_the_new_code(tmp_path):
    from tests.conftest import ROOT

    d = tmp_path / "project"                           # a copy of the code, which the server imports from its cwd
    for name in ("pipeline", "stages"):
        shutil.copytree(ROOT / name, d / name, ignore=shutil.ignore_patterns("__pycache__"))
    sock = tmp_path / "s"
    server = subprocess.Popen([sys.executable, "-m", "pipeline.workflow.forkserver", str(sock), str(os.getpid())],
                              cwd=d, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _code_change(d, sock, server)
    finally:                                            # never left serving, whatever failed
        if server.poll() is None:
            server.kill()
            server.wait()


def _code_change(d, sock, server):
    deadline = time.monotonic() + 120
    while not sock.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    (d / "bad.yaml").write_text("loop: {iterations: -1}\n")
    env = {**os.environ, forkserver.ENV: str(sock)}

    def group():
        return subprocess.run([sys.executable, "-m", "stages.group", "--params", "bad.yaml", "--iteration", "1"],
                              cwd=d, env=env, capture_output=True, text=True, timeout=120)

    first = group()
    stage = d / "pipeline" / "workflow" / "cli.py"     # imported by the server; a stage module is read afresh
    stage.write_text(stage.read_text().replace("from __future__ import annotations\n", "from __future__ import "
                                               "annotations\nimport sys\nprint('the new code', file=sys.stderr)\n"))
    second = group()
    assert first.returncode == second.returncode == 2
    assert "the new code" not in first.stderr and "the new code" in second.stderr
    assert server.wait(timeout=30) == 0 and not sock.exists()       # it stopped serving, and exited
    assert "pipeline/workflow/cli.py changed since it was imported" in server.stderr.read()
