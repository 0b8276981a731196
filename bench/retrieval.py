"""Benchmark: the search environment's BM25 retriever (`pipeline.envs.search.index`) on generated corpora.

    python -m bench.retrieval --sizes 10000 100000 --queries 2000      # writes results/bench/retrieval.csv

For each size, a world of the generator's kinds scaled to about that many passages (`pipeline.envs.search.world`);
then, on one thread of this process: the index's build from the texts (tokenising included), its save to the
cache and its load from there (what every later stage does), and `--queries` searches at k = 3, once with the
expert's queries (entity names, 2-3 terms) and once with whole questions (8-15 terms), each query new to the
retriever (no memo). Prints and writes per size: passages, build, save and load seconds, queries per second and
the median and 99th-percentile latency of each query kind, and the index's size on disk.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

from bench import cpu_name
from pipeline.data.tables import write_text_atomic
from pipeline.envs.search import world as search_world

ROOT = Path(__file__).resolve().parents[1]


def world(size: int, seed: int = 0) -> tuple[list[str], list[str], list[str]]:
    """Passage texts (title and text), entity names and question texts of a generated world of about `size`
    passages."""
    scale = size / sum(search_world.COUNTS.values())
    counts = {k: max(2, round(v * scale)) for k, v in search_world.COUNTS.items()}
    corpus, train, test = search_world.generate(seed=seed, counts=counts)
    texts = [d["contents"].replace('"', "", 2) for d in corpus]
    names = [d["contents"].split("\n", 1)[0].strip('"') for d in corpus]
    return texts, names, [q["question"] for q in train + test]


def timed_queries(retriever, queries: list[str], k: int = 3) -> tuple[float, float, float]:
    lat = []
    t0 = time.perf_counter()
    for q in queries:
        t = time.perf_counter()
        retriever.search(q, k)
        lat.append(time.perf_counter() - t)
    total = time.perf_counter() - t0
    return len(queries) / total, float(np.median(lat)) * 1e3, float(np.percentile(lat, 99)) * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from pipeline.envs.search.index import Retriever, _cached

    rows = []
    for size in args.sizes:
        t = time.perf_counter()
        texts, names, questions = world(size)
        made = time.perf_counter() - t
        rng = random.Random(size)
        t = time.perf_counter()
        r = Retriever(texts)
        build = time.perf_counter() - t
        with tempfile.TemporaryDirectory() as d:
            _cached.cache_clear()
            t = time.perf_counter()
            Retriever.cached(texts, Path(d))              # builds again and saves
            save = time.perf_counter() - t - build
            disk = sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file()) / 2**20
            _cached.cache_clear()
            t = time.perf_counter()
            Retriever.cached(texts, Path(d))              # a later stage: reads it
            load = time.perf_counter() - t
        name_q = rng.sample(names, min(args.queries, len(names)))
        question_q = rng.sample(questions, min(args.queries, len(questions)))
        nqps, nmed, np99 = timed_queries(r, name_q)
        qqps, qmed, qp99 = timed_queries(r, question_q)
        row = {"passages": len(texts), "generate_s": round(made, 2), "build_s": round(build, 2),
               "save_s": round(max(save, 0.0), 2), "load_s": round(load, 2), "index_mib": round(disk, 1),
               "name_queries_per_s": round(nqps, 1), "name_median_ms": round(nmed, 3), "name_p99_ms": round(np99, 3),
               "question_queries_per_s": round(qqps, 1), "question_median_ms": round(qmed, 3),
               "question_p99_ms": round(qp99, 3), "cpu": cpu_name()}
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "retrieval.csv"
    write_text_atomic(out, pl.DataFrame(rows).write_csv())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
