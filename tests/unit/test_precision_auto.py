"""`policy.dtype: auto`: bf16 where the device computes it natively, fp32 elsewhere; decided once per run by init,
recorded beside iteration 0's checkpoint, read by every later stage, and compared by `run.base`
(docs/models.md, Precision). Each branch of `auto` is forced here, whatever CPU runs the suite."""

from __future__ import annotations

import json
import types

import pytest
import torch
import yaml

from pipeline.config.params import Params, load_params
from pipeline.model import precision
from pipeline.model.policy import resolve_params
from pipeline.model.precision import RECORD, cpu_flags, native_bf16, resolve

CPU = torch.device("cpu")


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu avx2\n")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512f", "avx512_bf16"}      # the first processor's line
    assert cpu_flags(tmp_path / "absent") == set()
    (tmp_path / "arm").write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert cpu_flags(tmp_path / "arm") == {"fp", "asimd", "bf16"}


@pytest.mark.parametrize("flags, dtype, why", [
    ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16", "CPU flags avx512_bf16"),       # AMD EPYC (Zen 4)
    ({"avx2", "avx512f", "amx_bf16", "amx_tile"}, "bfloat16", "CPU flags amx_bf16"),  # Xeon with AMX
    ({"avx2", "fma"}, "float32", "CPU without avx512_bf16 or amx_bf16"),              # AVX2-only Xeon
    ({"avx2", "avx512f"}, "float32", "CPU without avx512_bf16 or amx_bf16"),          # AVX-512 without bf16
])
def test_auto_on_a_cpu_follows_its_bf16_flags(flags, dtype, why):
    assert resolve("auto", CPU, flags) == (dtype, f"policy.dtype auto: {why}")
    # an explicit dtype is kept whatever the CPU
    for name in ("float32", "bfloat16", "float16"):
        assert resolve(name, CPU, flags) == (name, f"policy.dtype {name}")


@pytest.mark.parametrize("capability, native", [((8, 0), True), ((9, 0), True), ((7, 5), False), ((6, 1), False)])
def test_auto_on_a_gpu_follows_its_compute_capability(monkeypatch, capability, native):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU")
    got, why = native_bf16(torch.device("cuda"))
    assert got is native and why == f"GPU, compute capability {capability[0]}.{capability[1]}"
    assert resolve("auto", torch.device("cuda"))[0] == ("bfloat16" if native else "float32")
    assert native_bf16(torch.device("mps")) == (False, "mps device")


def _auto_run(tmp_path, name="run", **extra):
    params = {"policy": {"dtype": "auto"}, "runtime": {"device": "cpu"}, "tracking": {"enabled": False},
              "run": {"dir": name}, **extra}
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(params))
    return tmp_path / f"{name}.yaml"


def test_init_records_the_dtype_and_later_stages_read_it(qwen_folder, tmp_path, monkeypatch):
    """Init resolves `auto` on its machine and writes the record; a later stage on a machine without bf16 still
    computes in the run's bf16, and a record beside the checkpoint is what decides, not the machine."""
    from stages import init

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(precision, "cpu_flags", lambda *a: {"avx512f", "avx512_bf16"})
    f = _auto_run(tmp_path, policy={"dtype": "auto", "path": str(qwen_folder)})
    init.main(["--params", str(f)])
    record = json.loads((tmp_path / "run/iter_0/checkpoint" / RECORD).read_text())
    assert record == {"requested": "auto", "dtype": "bfloat16", "why": "policy.dtype auto: CPU flags avx512_bf16"}

    monkeypatch.setattr(precision, "cpu_flags", lambda *a: {"avx2"})
    p, why = resolve_params(load_params(f))
    assert p.policy.dtype == "bfloat16" and "as the run's initial policy" in why
    # init itself resolves afresh (a rerun on this machine computes in fp32 and says so in its record)
    p, why = resolve_params(load_params(f), fresh=True)
    assert (p.policy.dtype, why) == ("float32", "policy.dtype auto: CPU without avx512_bf16 or amx_bf16")
    # a run without a record (made before records) resolves on the machine, and says so
    other = _auto_run(tmp_path, "other")
    p, why = resolve_params(load_params(other))
    assert p.policy.dtype == "float32" and f"no {RECORD}" in why
    # an explicit dtype is never touched
    explicit = Params(policy={"dtype": "float16"})
    assert resolve_params(explicit)[0] is explicit


def test_stage_log_names_the_resolved_dtype(tmp_path, monkeypatch, capsys):
    from pipeline.workflow.cli import parse_args

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(precision, "cpu_flags", lambda *a: {"amx_bf16"})
    f = _auto_run(tmp_path)
    ctx = parse_args("rollout", per_iteration=True, argv=["--params", str(f), "--iteration", "1"])
    assert ctx.params.policy.dtype == "bfloat16" and ctx.requested_dtype == "auto"
    assert "computing in bfloat16 (policy.dtype auto: CPU flags amx_bf16 (no precision.json" in capsys.readouterr().out
    # a stage that loads no model keeps `auto` and imports no torch for it
    assert parse_args("group", per_iteration=True, argv=["--params", str(f), "--iteration", "1"]).params \
        .policy.dtype == "auto"


def test_run_base_computed_in_another_dtype_is_refused(tmp_path, monkeypatch):
    from pipeline.workflow.runs import share_base

    monkeypatch.chdir(tmp_path)
    base = _auto_run(tmp_path, "base")
    ckpt = tmp_path / "base/iter_0/checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"weights")
    precision.write_record(ckpt, "auto", "bfloat16", "policy.dtype auto: CPU flags avx512_bf16")
    arm = Params(policy={"dtype": "auto"}, runtime={"device": "cpu"},
                 run={"dir": "arm", "base": {"params": str(base), "through": 0}})
    monkeypatch.setattr(precision, "cpu_flags", lambda *a: {"avx2"})
    with pytest.raises(ValueError, match=r"its initial policy computes in bfloat16 \(policy.dtype auto: CPU flags "
                       r"avx512_bf16; .*precision.json\), but policy.dtype auto is float32 here"):
        share_base(arm, log=lambda _: None)
    assert not (tmp_path / "arm").exists()          # nothing linked
    monkeypatch.setattr(precision, "cpu_flags", lambda *a: {"avx512_bf16"})
    assert share_base(arm, log=lambda _: None) == ["init"]
    # a record that is not JSON, or names no dtype, is a clear error
    (ckpt / RECORD).write_text('{"dtype": "int8"}')
    with pytest.raises(ValueError, match=r"precision.json: dtype 'int8' is none of float32, bfloat16, float16"):
        precision.read_record(ckpt)


@pytest.mark.parametrize("dtype, update_dtype, uses_engine", [
    ("float32", "policy", True), ("bfloat16", "policy", False),
    ("float32", "bfloat16", False),     # an fp32 sampler, a bf16 trainer: they compute different log-probs
    ("bfloat16", "float32", False),
    ("float32", "float32", True)])
def test_old_logprobs_auto_takes_the_engines_only_in_fp32(dtype, update_dtype, uses_engine):
    from stages.update import engine_logprobs

    p = Params(policy={"dtype": dtype}, update={"old_logprobs": "auto", "dtype": update_dtype})
    ctx = types.SimpleNamespace(params=p, log=lambda _: None)
    turns = types.SimpleNamespace(prompts=[[1]], engine_logprobs=[[-0.5, -1.25]])
    got = engine_logprobs(ctx, turns)
    if uses_engine:
        assert torch.equal(got[0], torch.tensor([-0.5, -1.25]))
    else:
        assert got is None
