#!/usr/bin/env python3
"""Stand-ins for SLURM's sbatch, squeue, sacct, scancel, srun, sinfo and scontrol that run every job on this
machine, for the test of snakemake-executor-plugin-slurm (tests/e2e/test_slurm.py). Called by the name of the tool
(a link to this file); the jobs' records live in $FAKE_SLURM_DIR/jobs/<id>.json.

sbatch records its arguments, answers the job id (as `--parsable` does) and starts the job in the background:
PENDING, then RUNNING, then COMPLETED or FAILED by its exit status, which sacct and squeue report the way SLURM does
(`<id>|<STATE>`, filtered by `--name`)."""

import fcntl
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(os.environ.get("FAKE_SLURM_DIR", "/tmp/fakeslurm"))
JOBS = ROOT / "jobs"


def _record(job_id: str) -> dict:
    return json.loads((JOBS / f"{job_id}.json").read_text())


def _save(rec: dict) -> None:
    tmp = JOBS / f".{rec['id']}.json.tmp"
    tmp.write_text(json.dumps(rec))
    os.replace(tmp, JOBS / f"{rec['id']}.json")


def _next_id() -> str:
    JOBS.mkdir(parents=True, exist_ok=True)
    with open(ROOT / "counter.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        counter = ROOT / "counter"
        n = int(counter.read_text()) + 1 if counter.exists() else 1000
        counter.write_text(str(n))
    return str(n)


def _option(args: list[str], *names: str) -> str | None:
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(n + "="):
                return a[len(n) + 1:]
    return None


def sbatch(args: list[str]) -> int:
    job_id = _next_id()
    script = _option(args, "--wrap")
    if script is None:     # the job script on stdin (pass_command_as_script) or as the last argument
        script = sys.stdin.read() if args and args[-1] == "/dev/stdin" else Path(args[-1]).read_text()
    workdir = _option(args, "-D", "--chdir") or os.getcwd()
    output = (_option(args, "--output", "-o") or "slurm-%j.out").replace("%j", job_id)
    rec = {"id": job_id, "name": _option(args, "--job-name", "-J"), "comment": _option(args, "--comment"),
           "args": args, "state": "PENDING", "workdir": workdir, "output": output}
    _save(rec)
    subprocess.Popen([sys.executable, os.path.abspath(__file__), "_run", job_id, script], cwd=workdir,
                     start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    print(job_id)
    return 0


def _run(job_id: str, script: str) -> int:
    rec = _record(job_id)
    cpus = _option(rec["args"], "--cpus-per-task") or "1"
    env = {**os.environ, "SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_CPUS_PER_TASK": cpus,
           "SLURM_JOB_NAME": rec["name"] or ""}
    Path(rec["output"]).parent.mkdir(parents=True, exist_ok=True)
    with open(rec["output"], "w") as log:
        proc = subprocess.Popen(["/bin/sh", "-c", script], cwd=rec["workdir"], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        rec.update(state="RUNNING", pid=proc.pid)
        _save(rec)
        code = proc.wait()
    rec = _record(job_id)
    if rec["state"] != "CANCELLED":
        rec.update(state="COMPLETED" if code == 0 else "FAILED", exit_code=code)
        _save(rec)
    return 0


def _jobs(args: list[str]) -> list[dict]:
    name = _option(args, "--name", "-n")
    recs = [json.loads(p.read_text()) for p in sorted(JOBS.glob("*.json"))] if JOBS.is_dir() else []
    return [r for r in recs if name is None or r["name"] == name]


def sacct(args: list[str]) -> int:
    if _option(args, "--name") is None:     # the plugin's account guess: no account
        return 0
    for r in _jobs(args):
        print(f"{r['id']}|{r['state']}")
    return 0


def squeue(args: list[str]) -> int:
    for r in _jobs(args):
        print(f"{r['id']}|{r['state']}")
    return 0


def scancel(args: list[str]) -> int:
    for job_id in [a for a in args if a.isdigit()]:
        rec = _record(job_id)
        rec["state"] = "CANCELLED"
        _save(rec)
        if rec.get("pid"):
            try:
                os.killpg(os.getpgid(rec["pid"]), signal.SIGTERM)
            except ProcessLookupError:
                pass
    return 0


def srun(args: list[str]) -> int:
    """Run the job step here: drop srun's options, run the command."""
    i = 0
    while i < len(args) and args[i].startswith("-"):
        i += 1
    os.execvp(args[i], args[i:])


def sinfo(args: list[str]) -> int:
    print("PARTITION\ndebug*")    # `sinfo -o %P`: the default partition is starred
    return 0


def scontrol(args: list[str]) -> int:
    print("MinJobAge               = 300 sec")
    return 0


if __name__ == "__main__":
    tool, rest = Path(sys.argv[0]).name, sys.argv[1:]
    if rest and rest[0] == "_run":
        sys.exit(_run(rest[1], rest[2]))
    sys.exit({"sbatch": sbatch, "sacct": sacct, "squeue": squeue, "scancel": scancel, "srun": srun,
              "sinfo": sinfo, "scontrol": scontrol}[tool](rest))
