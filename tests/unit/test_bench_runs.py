"""A benchmark's run folders: params written once, kept when the same, refused when a finished run had others."""
import os

import pytest
import yaml

from bench.learning import write_run_params


def test_a_run_folder_with_results_refuses_other_params_and_keeps_the_same_ones(tmp_path):
    first = {"seed": 0, "policy": {"path": "/a/model.gguf"}, "loop": {"iterations": 3}}
    write_run_params(tmp_path, first)
    f = tmp_path / "params.yaml"
    assert yaml.safe_load(f.read_text()) == first

    os.utime(f, (1_000_000, 1_000_000))
    write_run_params(tmp_path, {"seed": 0, "policy": {"path": "/a/model.gguf"}, "loop": {"iterations": 3}})
    assert f.stat().st_mtime == 1_000_000            # the same params: the file (and Snakemake's view of it) untouched

    other = {"seed": 0, "policy": {"path": "/b/model.gguf"}, "loop": {"iterations": 3}}
    write_run_params(tmp_path, other)                 # no results yet: nothing to protect, the new params written
    assert yaml.safe_load(f.read_text()) == other

    (tmp_path / "results").mkdir()
    with pytest.raises(SystemExit, match=r"params.yaml: a run made with other params is there \(loop.iterations: 3 "
                                         r"-> absent, policy.path: '/b/model.gguf' -> '/c/model.gguf'\)"):
        write_run_params(tmp_path, {"seed": 0, "policy": {"path": "/c/model.gguf"}, "loop": {}})
    assert yaml.safe_load(f.read_text()) == other   # nothing written


def test_relative_model_and_data_paths_are_anchored_where_the_command_runs(tmp_path):
    """A benchmark run works in a folder of its own: `models/x.gguf` and `data/sql` of the config, relative to the
    checkout, become absolute there; an absolute path, a path that names nothing and other keys stay as they are."""
    from bench.learning import anchored

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "x.gguf").write_bytes(b"GGUF")
    (tmp_path / "data" / "sql").mkdir(parents=True)
    raw = {"policy": {"path": "models/x.gguf", "dtype": "auto"}, "env": {"name": "sql", "data_path": "data/sql"},
           "run": {"dir": "results/x"}}
    out = anchored(raw, tmp_path)
    assert out == {"policy": {"path": str(tmp_path / "models" / "x.gguf"), "dtype": "auto"},
                   "env": {"name": "sql", "data_path": str(tmp_path / "data" / "sql")}, "run": {"dir": "results/x"}}
    assert raw["policy"]["path"] == "models/x.gguf"             # a copy
    same = {"policy": {"path": "/abs/m.gguf"}, "env": {"name": "sokoban", "data_path": "data/absent"}}
    assert anchored(same, tmp_path) == same
    assert anchored({"policy": {"path": None}}, tmp_path) == {"policy": {"path": None}}


def test_runs_grouped_by_dtype_name_what_auto_resolved_to(tmp_path):
    """bench.compare --group-by policy.dtype: a run of `auto` is grouped by the dtype it computed in (its
    precision record), so bf16 and fp32 runs of one config compare as bfloat16 against float32."""
    import json

    from bench.compare import Run

    for name, dtype, resolved in (("a", "auto", "bfloat16"), ("b", "float32", "float32"), ("c", "auto", None)):
        d = tmp_path / name
        (d / "results" / "iter_0" / "checkpoint").mkdir(parents=True)
        (d / "params.yaml").write_text(yaml.safe_dump({"policy": {"dtype": dtype}, "run": {"dir": "results"}}))
        (d / "results" / "iter_0" / "eval_metrics.json").write_text(json.dumps({"success_rate": 0.5}))
        if resolved:
            (d / "results" / "iter_0" / "checkpoint" / "precision.json").write_text(json.dumps(
                {"requested": dtype, "dtype": resolved}))
    assert [Run(tmp_path / n, "policy.dtype").method for n in "abc"] == ["bfloat16", "float32", "auto"]
    assert Run(tmp_path / "a").method == "grpo"


def _killed_run(d):
    """A Snakemake run in `d` killed mid-job (SIGKILL): its lock stays behind, as a bench stopped by hand leaves it."""
    import signal
    import subprocess
    import sys
    import time

    d.mkdir()
    (d / "Snakefile").write_text('rule all:\n    output: "a.txt"\n    shell: "sleep 60; echo done > a.txt"\n')
    p = subprocess.Popen([sys.executable, "-m", "snakemake", "--cores", "1", "--quiet"], cwd=d,
                         start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):                    # until Snakemake has locked the folder and started the job
        if any((d / ".snakemake" / "locks").glob("*.lock")):
            break
        time.sleep(0.1)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    (d / "Snakefile").write_text('rule all:\n    output: "a.txt"\n    shell: "echo done > a.txt"\n')
    return p


def test_a_stale_lock_is_removed_and_the_run_goes_on(tmp_path, capsys):
    """A campaign resumed after a kill found every run folder locked and recorded its runs as crashed in 2 s; the
    bench now unlocks a folder no Snakemake process works in, and runs it."""
    import subprocess
    import sys

    from bench.learning import _snakemake

    d = tmp_path / "run"
    _killed_run(d)
    r = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "--quiet"], cwd=d, capture_output=True,
                       text=True, check=False)
    assert r.returncode != 0 and "Directory cannot be locked" in r.stderr       # Snakemake alone refuses
    _snakemake(d, 1)
    assert (d / "a.txt").read_text() == "done\n"
    assert "run: a stale Snakemake lock (a run killed earlier): unlocked, started again" in capsys.readouterr().out


def test_a_lock_held_by_a_live_snakemake_is_kept(tmp_path):
    """A folder another Snakemake process works in is not unlocked: the bench fails, naming the folder."""
    import subprocess
    import sys

    from bench.learning import _snakemake

    d = tmp_path / "run"
    _killed_run(d)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "snakemake"], cwd=d)
    try:
        with pytest.raises(RuntimeError, match=f"snakemake failed in {d}"):
            _snakemake(d, 1)
        assert not (d / "a.txt").exists()
    finally:
        live.kill()
        live.wait()


def test_side_by_side_runs_a_seeds_arms_before_the_next_seeds_base(tmp_path, monkeypatch):
    """Two workers, three seeds: the arms of seed 0 start as soon as its base ends, before seed 2's base is made (a
    campaign records whole pairs early); a failed base fails its seed's arms, unstarted, and the others still run."""
    import threading
    import time

    from bench import learning

    events, lock = [], threading.Lock()

    def log(what):
        with lock:
            events.append(what)

    def base_run(seed):
        log(f"base {seed} start")
        time.sleep({0: 0.1, 1: 0.35, 2: 0.1}[seed])
        if seed == 1 and fail:
            raise RuntimeError("snakemake failed in base_s1")
        log(f"base {seed} end")

    def arm(d, cores):
        log(f"{d.name} start")
        time.sleep(0.2)
        log(f"{d.name} end")

    monkeypatch.setattr(learning, "_snakemake", arm)
    runs = [tmp_path / f"{a}_s{s}" for s in (0, 1, 2) for a in ("gigpo", "grpo")]
    done = []
    fail = False
    learning.run_side_by_side(base_run, [0, 1, 2], runs, jobs=2, cores=1,
                              on_done=lambda d, e, wall: done.append((d.name, e)))
    at = {e: i for i, e in enumerate(events)}
    assert at["base 2 start"] > max(at["gigpo_s0 start"], at["grpo_s0 start"])
    assert at["gigpo_s0 start"] > at["base 0 end"] and at["gigpo_s1 start"] > at["base 1 end"]
    assert sorted(n for n, e in done) == sorted(d.name for d in runs) and all(e is None for _, e in done)

    events.clear()
    done.clear()
    fail = True
    with pytest.raises(RuntimeError, match=r"2 of 6 runs failed: .*gigpo_s1: snakemake failed in base_s1; "
                                           r".*grpo_s1: snakemake failed in base_s1"):
        learning.run_side_by_side(base_run, [0, 1, 2], runs, jobs=2, cores=1,
                                  on_done=lambda d, e, wall: done.append((d.name, e)))
    assert sorted(n for n, _ in done) == ["gigpo_s0", "gigpo_s2", "grpo_s0", "grpo_s2"]
    assert not any(e.endswith("_s1 start") for e in events)
