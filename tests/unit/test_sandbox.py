"""The Python sandbox (pipeline/envs/sandbox.py) attacked guard by guard: each hostile program comes back as an
`Outcome` within its limits, in bounded time, and leaves nothing behind: no process, no file outside its own
folder, the test process (the trainer's stand-in) untouched."""

import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest

from pipeline.envs.sandbox import Limits, run_python, unavailable
from tests.conftest import ROOT

# one worker runs them in turn: the sandboxes of one machine share the process cap of its user (nobody)
pytestmark = pytest.mark.xdist_group("sandbox")
FAST = Limits(cpu_s=2, wall_s=6.0)


def test_the_machine_can_run_the_sandbox():
    assert unavailable() is None        # the README's test command installs bubblewrap (scripts/install-sandbox)


def leftover(token: str) -> list[str]:
    """Processes still alive whose command line holds `token`."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if token in line and "ps -eo" not in line]


def test_a_program_runs_and_its_output_comes_back():
    o = run_python("import math\nprint(math.comb(52, 5))\n")
    assert (o.stdout, o.stderr, o.exit_code, o.signal, o.timed_out) == ("2598960\n", "", 0, None, False)


def test_an_endless_loop_is_stopped_by_its_cpu_limit():
    o = run_python("while True:\n    pass\n", Limits(cpu_s=1, wall_s=6.0))
    assert o.signal == signal.SIGXCPU and not o.timed_out and o.wall_s < 4


def test_a_sleep_past_the_wall_limit_is_killed_at_it():
    o = run_python("import time\ntime.sleep(60)\n", Limits(wall_s=1.5))
    assert o.timed_out and o.signal == signal.SIGKILL and 1.4 < o.wall_s < 4


def test_a_fork_bomb_stops_at_the_process_cap_and_leaves_no_process():
    token = uuid.uuid4().hex
    bomb = f"import os, time\n# {token}\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(30)\n"
    o = run_python(bomb, Limits(processes=16, wall_s=3.0))
    assert o.timed_out and o.wall_s < 6
    assert leftover(token) == [] and leftover("creditrl-sandbox-") == []


def test_a_child_that_detaches_and_outlives_its_parent_dies_with_the_sandbox():
    token = uuid.uuid4().hex
    code = (f"import os, time\n# {token}\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
            "print('parent leaves')\n")
    o = run_python(code, FAST)
    assert o.stdout == "parent leaves\n" and o.wall_s < 4
    assert leftover(token) == []


def test_a_ten_gigabyte_allocation_fails_inside():
    o = run_python("b = bytearray(10 ** 10)\n", FAST)
    assert o.exit_code == 1 and "MemoryError" in o.stderr


def test_a_gigabyte_of_output_is_stopped_at_the_file_cap_and_cut():
    o = run_python("import sys\nfor _ in range(10 ** 5):\n    sys.stdout.write('x' * 10 ** 4)\n",
                   Limits(file_mb=1, output_bytes=100, wall_s=6.0))
    assert o.truncated and o.stdout == "x" * 100 and o.exit_code != 0 and o.wall_s < 4


def test_writes_to_the_project_and_to_tmp_stay_inside(tmp_path):
    name = f"escape-{uuid.uuid4().hex}.txt"
    code = (f"import os\nfor path in [{str(ROOT / name)!r}, '/tmp/{name}', {str(tmp_path / name)!r}]:\n"
            "    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
            "    except OSError as e:\n        print('refused', path, type(e).__name__)\n")
    o = run_python(code, FAST)
    assert o.stdout.count("refused") == 2 and f"wrote /tmp/{name}" in o.stdout     # its own private /tmp
    assert not (ROOT / name).exists() and not Path(f"/tmp/{name}").exists() and not (tmp_path / name).exists()


def test_no_network():
    o = run_python("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=3)\n    print('connected')\n"
                   "except OSError as e:\n    print('refused', e.errno)\n", FAST)
    assert o.stdout.startswith("refused") and "connected" not in o.stdout and o.wall_s < 4


def test_the_parent_can_be_neither_signalled_nor_read(monkeypatch):
    monkeypatch.setenv("CREDITRL_TEST_SECRET", "hunter2")
    me = os.getpid()
    code = (f"import os, signal\ntry:\n    os.kill({me}, signal.SIGKILL)\n    print('signalled')\n"
            f"except OSError as e:\n    print('kill', type(e).__name__)\ntry:\n"
            f"    print(open('/proc/{me}/environ').read())\nexcept OSError as e:\n    print('environ', type(e).__name__)\n"
            "print(sorted(os.environ))\n")
    o = run_python(code, FAST)
    assert "kill ProcessLookupError" in o.stdout and "environ FileNotFoundError" in o.stdout
    assert "hunter2" not in o.stdout and "CREDITRL_TEST_SECRET" not in o.stdout
    assert os.getpid() == me                                           # still here
