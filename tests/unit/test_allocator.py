"""runtime.allocator: every stage process runs with tcmalloc where it is installed, the caller's LD_PRELOAD is
what the stage's children see, and a choice the machine cannot honour is refused at params load
(pipeline/config/allocator.py). tcmalloc is installed by scripts/install-vllm: these tests need it."""

import os
import subprocess
import sys

import pytest
import yaml

from pipeline.config import allocator, params
from pipeline.config.allocator import CALLER, environ, loaded, tcmalloc_library
from pipeline.config.files import ParamsError
from pipeline.config.params import check_dependencies, load_params
from tests.unit.test_threads import run_stage, write_group_input

LIB = "/usr/lib/libtcmalloc_minimal.so.4"


def test_the_environment_a_process_needs_for_each_choice():
    assert environ("system", {}, LIB) is None
    assert environ("auto", {"HOME": "/h"}, LIB) == {"HOME": "/h", "LD_PRELOAD": LIB, CALLER: ""}
    # the caller's own preload is kept after ours, and remembered to be put back
    assert environ("tcmalloc", {"LD_PRELOAD": "libfoo.so"}, LIB) == {"LD_PRELOAD": f"{LIB} libfoo.so",
                                                                     CALLER: "libfoo.so"}
    assert environ("auto", {"LD_PRELOAD": f"libfoo.so:{LIB}"}, LIB) is None        # preloaded by the caller
    assert environ("auto", {CALLER: "", "LD_PRELOAD": LIB}, LIB) is None            # executed once already


def test_what_is_installed_and_what_is_loaded(tmp_path):
    assert tcmalloc_library((str(tmp_path),)) is None
    (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
    assert tcmalloc_library((str(tmp_path / "none"), str(tmp_path))) == str(tmp_path / "libtcmalloc.so.4")
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")                        # the minimal one first
    assert tcmalloc_library((str(tmp_path),)) == str(tmp_path / "libtcmalloc_minimal.so.4")
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 42 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert loaded(str(maps)) == "system"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 43 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.9\n")
    assert loaded(str(maps)) == "tcmalloc"
    assert loaded(str(tmp_path / "absent")) == "system"


PROBE = ("import os; from pipeline.config.allocator import loaded, preload, CALLER; preload({'allocator': %r}); "
         "print(os.getpid(), loaded(), os.environ.get('LD_PRELOAD'), CALLER in os.environ)")


def probe(choice, preload=None):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", CALLER)}
    if preload:
        env["LD_PRELOAD"] = preload
    r = subprocess.run([sys.executable, "-c", PROBE % choice], env=env, capture_output=True, text=True, timeout=60,
                       check=True)
    return r.stdout.split()


def test_a_process_is_executed_again_with_tcmalloc_and_its_children_see_the_callers_preload():
    assert tcmalloc_library() is not None, "tcmalloc is not installed: run scripts/install-vllm"
    _, how, preload, marked = probe("auto")
    assert (how, preload, marked) == ("tcmalloc", "None", "False")     # LD_PRELOAD gone again, as the caller had it
    libm = "libm.so.6"                                                   # harmless: Python has it loaded anyway
    _, how, preload, marked = probe("auto", libm)
    assert (how, preload, marked) == ("tcmalloc", libm, "False")
    _, how, preload, _ = probe("system")
    assert (how, preload) == ("system", "None")
    _, how, preload, _ = probe("not-a-choice")                          # the schema refuses it later; no exec
    assert how == "system"


def test_a_stage_reports_the_allocator_it_runs_with(tmp_path):
    write_group_input(tmp_path)
    for choice, expected in (("auto", "tcmalloc"), ("system", "system")):
        (tmp_path / "p.yaml").write_text(yaml.safe_dump({"runtime": {"allocator": choice, "torch_threads": 1},
                                                         "tracking": {"enabled": False}}))
        out, metrics = run_stage(tmp_path, "group", "--iteration", "1")
        assert f"{expected}'s malloc (runtime.allocator {choice})" in out
        assert metrics["runtime/tcmalloc"] == float(expected == "tcmalloc")


def test_a_choice_the_machine_cannot_honour_is_refused_at_params_load(tmp_path, monkeypatch):
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"runtime": {"allocator": "tcmalloc"}}))
    p = load_params(tmp_path / "p.yaml")
    check_dependencies(p, tmp_path / "p.yaml")                           # installed here
    monkeypatch.setattr(params, "tcmalloc_library", lambda: None)
    with pytest.raises(ParamsError, match=r"p.yaml: key 'runtime.allocator': tcmalloc, but its library"):
        check_dependencies(p, tmp_path / "p.yaml")
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"runtime": {"allocator": "jemalloc"}}))
    with pytest.raises(ParamsError, match=r"key 'runtime.allocator'"):
        load_params(tmp_path / "p.yaml")
    assert allocator.choice_in({"allocator": "jemalloc"}) == "system"
