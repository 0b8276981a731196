"""Benchmark: step groups from exact anchors and from similarity clustering, on a run's real text anchors.

    python -m bench.similarity --run RUN/results --threshold 0.95

For every iteration's step table of the run, the group stage's exact anchor groups and GiGPO's similarity groups
(docs/credit-assignment.md, GiGPO: greedy clustering, difflib ratio ≥ threshold to a cluster's first member) are
compared: the share of singleton groups, of sizes 2-5, 6-9 and ≥ 10, and the share of turns in a non-singleton
group. It times the similarity grouping per 10^4 turns, and the plain per-pair loop (`pipeline.credit.naive`) on the
same turns, which must give the same groups. Writes similarity.csv.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import polars as pl

from pipeline.credit.grouping import build_groups, group_size_distribution, similarity_groups
from pipeline.credit.naive import similarity_groups_naive
from pipeline.data.paths import iterations_with
from pipeline.data.tables import STEPS, read_table, write_text_atomic


def same_partition(a: list[int], b: list[int]) -> bool:
    """Whether two labelings group the same rows together (ids may differ)."""
    forward, backward = {}, {}
    return all(forward.setdefault(x, y) == y and backward.setdefault(y, x) == x for x, y in zip(a, b, strict=True))


def run(run_dir: Path, threshold: float, out_dir: Path, reference_max: int = 20_000) -> pl.DataFrame:
    files = [run_dir / f"iter_{it}" / "steps.parquet" for it in iterations_with(run_dir, "steps.parquet")]
    if not files:
        raise FileNotFoundError(f"{run_dir}: no iter_*/steps.parquet; run the pipeline first")
    steps = pl.concat([read_table(f, STEPS) for f in files]).sort("episode_id", "step")
    exact = build_groups(steps)
    t0 = time.perf_counter()
    sim = similarity_groups(steps, threshold)
    seconds = time.perf_counter() - t0
    sized = exact.select("step_group").with_columns(sim.alias("sim"))
    sim_groups = pl.DataFrame({"step_group": sim}).with_columns(pl.len().over("step_group").alias("step_group_size"))
    rows = [{"grouping": "exact anchors", **group_size_distribution(exact), "seconds_per_1e4_turns": None},
            {"grouping": f"similarity >= {threshold}", **group_size_distribution(sim_groups),
             "seconds_per_1e4_turns": seconds / steps.height * 1e4}]
    sample = steps.head(reference_max)
    t0 = time.perf_counter()
    ref = similarity_groups_naive(sample.select("episode_id", "step", "task_group", "anchor").to_dicts(),
                                      threshold)
    ref_seconds = time.perf_counter() - t0
    got = similarity_groups(sample, threshold).to_list()
    keys = list(zip(sample["episode_id"].to_list(), sample["step"].to_list(), strict=True))
    if not same_partition(got, [ref[k] for k in keys]):
        raise AssertionError("similarity_groups differs from the per-pair reference")
    rows.append({"grouping": f"similarity >= {threshold}, per-pair reference", "seconds_per_1e4_turns":
                 ref_seconds / sample.height * 1e4, "step_groups": None})
    df = pl.DataFrame(rows, infer_schema_length=None)
    print(f"{steps.height} turns of {len(files)} iterations, {steps['anchor'].n_unique()} distinct anchors; "
          f"{sized['sim'].n_unique()} similarity groups")
    with pl.Config(tbl_cols=12, tbl_width_chars=180, float_precision=3):
        print(df)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "similarity.csv", df.write_csv())
    print(f"wrote {out_dir / 'similarity.csv'}")
    return df


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, default=Path("results"))
    ap.add_argument("--threshold", type=float, default=0.95)
    ap.add_argument("--out", type=Path, default=Path("results/bench"))
    ap.add_argument("--reference-max", type=int, default=20_000, help="turns the per-pair reference also groups")
    args = ap.parse_args(argv)
    run(args.run, args.threshold, args.out, args.reference_max)


if __name__ == "__main__":
    main()
