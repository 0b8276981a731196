"""The loop's jobs one after another, without Snakemake: for a machine that has the stages' own dependencies only
(a GPU box with torch and transformers but no workflow tools), and to time every job there.

    python -m bench.sequential --params configs/smollm2-sokoban.yaml
    python -m bench.sequential --params gpu.yaml --stop-after 400   # start no iteration after 400 s
    python -m bench.sequential --params a.yaml --through 0          # iteration 0 only (for runs with run.base)

Runs the same jobs in the same order Snakemake would on one core (iteration 0's init and evaluation, then each
iteration's rollout, group, fit, advantages, update and evaluate, then the report), each the same command line
(`python -m stages.<stage> --params ... --iteration i`, a sharded stage's shards and then its merge; its log in
`results/logs/`), skipping a job whose outputs all exist (unlike Snakemake, it does not compare their times with
their inputs'). Each job's wall seconds and peak RSS (the job's process tree, sampled every 0.2 s)
go to a benchmark file in Snakemake's format (`results/benchmarks/<stage>_<i>.tsv`, so `bench.breakdown` reads
the run as it reads a Snakemake one), with the GPU memory in use at its peak (NVML, where there is a GPU) as an
extra column. `--stop-after S` starts no new iteration once S seconds have passed (the report is then skipped);
a job that fails stops the run with its log's last lines. A summary of every job is printed at the end and
written to `results/benchmarks/sequential.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from pipeline.config.params import ParamsError, load_params
from pipeline.data.paths import at
from pipeline.data.tables import write_text_atomic
from pipeline.workflow.registry import enabled_stages, job_file, processes_for, resources_for, shard_ids
from pipeline.workflow.runs import job_paths, ordered_jobs, share_base


class _Gpu:
    """Memory in use on GPU 0 (NVML), or None without one."""

    def __init__(self):
        try:
            import pynvml  # nvidia-ml-py, where the machine has a GPU

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:
            self._nvml = None

    def used_mb(self) -> float | None:
        if self._nvml is None:
            return None
        return self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used / 2**20


class _Peak(threading.Thread):
    """Samples a process tree's RSS and the GPU's memory every `period` seconds until stopped."""

    def __init__(self, pid: int, gpu: _Gpu, period: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.gpu, self.period = pid, gpu, period
        self.rss_mb, self.gpu_mb = 0.0, None
        self._halt = threading.Event()

    def run(self):
        while not self._halt.is_set():
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
                rss = 0
                for p in procs:
                    try:
                        rss += p.memory_info().rss
                    except psutil.Error:
                        pass
                self.rss_mb = max(self.rss_mb, rss / 2**20)
            except psutil.Error:
                pass
            used = self.gpu.used_mb()
            if used is not None:
                self.gpu_mb = max(self.gpu_mb or 0.0, used)
            self._halt.wait(self.period)

    def stop(self):
        self._halt.set()
        self.join()


def plan(params, through: int | None = None) -> list[tuple]:
    """(stage, iteration, shard) of every job through iteration `through` (default: the loop's last, then the
    report), in Snakemake's order on one core: a sharded stage's shard jobs, then its merge."""
    last = params.loop.iterations if through is None else min(through, params.loop.iterations)
    jobs = [(stage, it, k) for stage, it in ordered_jobs(params, last) for k in (shard_ids(stage, params) or [None])]
    if last == params.loop.iterations:
        jobs += [(s, None, None) for s in enabled_stages(params) if s.name == "report"]
    return jobs


def job_name(stage, it, shard) -> str:
    """As Snakemake's plan names it: `rollout@1`, `rollout_shard@1-0`, `init`."""
    return stage.name + ("" if it is None else f"@{it}") + ("" if shard is None else f"-{shard}")


def run(params_file: str, stop_after: float | None = None, through: int | None = None, log=print) -> list[dict]:
    params = load_params(params_file)
    share_base(params, log=log)
    gpu = _Gpu()
    start = time.monotonic()
    jobs = plan(params, through)
    first = {}   # each iteration's first job: --stop-after is checked there
    for stage, it, k in jobs:
        first.setdefault(it, (stage, it, k))
    done: list[dict] = []
    stopped = None
    for stage, it, shard in jobs:
        outs = job_paths(stage, params, it, stage.outs_for(params), shard)
        if all(Path(o).exists() for o in outs):
            continue
        elapsed = time.monotonic() - start
        if stop_after is not None and (it or 0) >= 1 and first[it] == (stage, it, shard) and elapsed > stop_after:
            stopped = it
            log(f"[sequential] {elapsed:.0f} s > --stop-after {stop_after:.0f}: iteration {it} not started")
            break
        threads = resources_for(stage, params)["threads"]
        cmd = stage.command(sys.executable, params_file, None if it is None else str(it),
                            None if shard is None else str(shard), processes_for(stage, params))
        log_file, bench_file = (Path(f) for f in job_paths(
            stage, params, it, [job_file(stage, params, "logs"), job_file(stage, params, "benchmarks")], shard))
        log_file.parent.mkdir(parents=True, exist_ok=True)
        name = job_name(stage, it, shard)
        log(f"[sequential] {name}: {cmd}")
        t0 = time.monotonic()
        with open(log_file, "w") as out:
            proc = subprocess.Popen(cmd, shell=True, stdout=out, stderr=subprocess.STDOUT,
                                    env=os.environ | {"CREDITRL_THREADS": str(threads)})
            peak = _Peak(proc.pid, gpu)
            peak.start()
            rc = proc.wait()
            peak.stop()
        wall = time.monotonic() - t0
        row = {"job": name, "stage": stage.name, "iteration": it, "wall_s": round(wall, 2),
               "max_rss_mb": round(peak.rss_mb, 1),
               "gpu_mem_mb": None if peak.gpu_mb is None else round(peak.gpu_mb, 1), "rc": rc}
        done.append(row)
        if rc != 0:
            tail = log_file.read_text(errors="replace").splitlines()[-20:]
            log(f"[sequential] {name} failed (exit {rc}); the end of {log_file}:\n" + "\n".join(tail))
            break
        bench_file.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(bench_file, "s\th:m:s\tmax_rss\tgpu_mem_mb\n"
                          f"{wall:.4f}\t{time.strftime('%H:%M:%S', time.gmtime(wall))}\t{peak.rss_mb:.2f}\t"
                          f"{'NA' if peak.gpu_mb is None else f'{peak.gpu_mb:.1f}'}\n")
        gpu_txt = "" if peak.gpu_mb is None else f", GPU memory in use {peak.gpu_mb / 1024:.1f} GiB"
        log(f"[sequential] {name}: {wall:.1f} s, peak RSS {peak.rss_mb / 1024:.2f} GiB{gpu_txt} "
            f"({time.monotonic() - start:.0f} s in all)")
    summary = Path(at(params, "results/benchmarks/sequential.json"))
    summary.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(summary, json.dumps({"params": params_file, "jobs": done,
                                           "wall_s": round(time.monotonic() - start, 1),
                                           "stopped_before_iteration": stopped}, indent=1))
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--stop-after", type=float, default=None,
                    help="seconds after which no new iteration is started")
    ap.add_argument("--through", type=int, default=None, help="the last iteration to run (no report before the "
                    "loop's last); e.g. 0 for the initial policy and its evaluation, which other runs then share")
    args = ap.parse_args(argv)
    try:
        done = run(args.params, args.stop_after, args.through)
    except (ParamsError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if all(r["rc"] == 0 for r in done) else 1


if __name__ == "__main__":
    sys.exit(main())
