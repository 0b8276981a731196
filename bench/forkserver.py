"""Benchmark: a whole run with and without the fork server (`runtime.fork_server`), side by side.

    python -m bench.forkserver                               # the tests' tiny configuration
    python -m bench.forkserver --params P --cores 2 --repeats 2

Each repeat runs the params' workflow to the end twice in fresh folders, once with the server off and once on,
alternating which goes first, and measures the wall time and the CPU-seconds of Snakemake and everything it started
(`getrusage` of the waited-for children), then checks that the two runs wrote the same bytes in every table and
checkpoint (metrics files, logs and benchmark files hold times and are left out). MLflow tracking is off in both.
Writes `OUT/forkserver.csv`.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import polars as pl
import yaml

from bench.learning import _workflow
from pipeline.config.files import read_params
from pipeline.config.params import ParamsError, load_params
from pipeline.data.tables import atomic_file

ROOT = Path(__file__).resolve().parents[1]
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
SKIP = ("metrics", "logs", "benchmarks")


def one_run(params: dict, folder: Path, server: bool, cores: int) -> dict:
    _workflow(folder)
    params = {**params, "runtime": {**(params.get("runtime") or {}), "fork_server": server},
              "tracking": {"enabled": False}}
    (folder / "params.yaml").write_text(yaml.safe_dump(params))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    r = subprocess.run([SNAKEMAKE, "--cores", str(cores), "--quiet"], cwd=folder, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"the run in {folder} failed:\n{r.stderr[-3000:]}")
    jobs = len(list((folder / "results" / "benchmarks").glob("*.tsv")))
    return {"fork_server": server, "wall_s": round(wall, 2), "jobs": jobs,
            "cpu_s": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 2)}


def outputs(results: Path) -> dict[str, bytes]:
    return {str(f.relative_to(results)): f.read_bytes() for f in sorted(results.rglob("*"))
            if f.is_file() and not set(f.relative_to(results).parts) & set(SKIP)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=Path, default=ROOT / "tests" / "tiny_params.yaml")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("results/bench"))
    a = ap.parse_args(argv)
    try:
        load_params(a.params)
    except ParamsError as e:
        raise SystemExit(str(e)) from None
    params = read_params(a.params)[0]
    params.pop("run", None)                          # each run in its own folder's results/
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-forkserver-") as tmp:
        for rep in range(a.repeats):
            order = (False, True) if rep % 2 == 0 else (True, False)
            done = {}
            for server in order:
                folder = Path(tmp) / f"r{rep}_{'server' if server else 'plain'}"
                row = one_run(params, folder, server, a.cores)
                done[server] = outputs(folder / "results")
                rows.append({"repeat": rep, **row})
                print(f"repeat {rep}, fork server {'on' if server else 'off'}: {row['wall_s']} s wall, "
                      f"{row['cpu_s']} CPU-s, {row['jobs']} jobs", flush=True)
            differ = sorted(k for k in done[False].keys() | done[True].keys()
                            if done[False].get(k) != done[True].get(k))
            rows[-1]["same_bytes"] = rows[-2]["same_bytes"] = not differ
            if differ:
                print(f"  outputs that differ: {differ[:10]}", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    target = a.out / "forkserver.csv"
    with atomic_file(target) as tmp_file:
        pl.DataFrame(rows).write_csv(tmp_file)
    df = pl.DataFrame(rows).group_by("fork_server").agg(pl.col("wall_s", "cpu_s").mean()).sort("fork_server")
    off, on = df.row(0, named=True), df.row(1, named=True)
    print(f"mean: wall {off['wall_s']:.1f} s -> {on['wall_s']:.1f} s ({off['wall_s'] / on['wall_s']:.2f}x), "
          f"CPU {off['cpu_s']:.1f} -> {on['cpu_s']:.1f} CPU-s ({off['cpu_s'] / on['cpu_s']:.2f}x)")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
