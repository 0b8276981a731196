"""Benchmark: does an update follow its advantages? Per turn of one iteration's rollouts, the change in the
response's log-prob from the checkpoint that sampled it to the checkpoint the update wrote, against the turn's
advantage.

    python -m bench.update_fit --run results/smollm2-sokoban --iteration 1

The update raises `Σ_t A_t log π(a_t|s_t)` over its turns; what it does to each turn is another matter: its steps
also move every other state's log-probs (through the shared weights and, with Adam, by about the learning rate per
weight whatever the gradient's size). This measures the result on the update's own turns, at temperature 1:
`dlogp = log π_new(response) − log π_old(response)` (sums over the response tokens; `log π_old` recomputed from
iteration it-1's checkpoint). Printed and written to `OUT/update_fit_<it>.json`: the mean `dlogp` of the turns with a
positive, negative and zero advantage, the share of nonzero-advantage turns whose `dlogp` has the advantage's sign,
their Spearman correlation, and per action (the environment's parsed action) the sum of the advantages and the mean
`dlogp`; the per-turn rows go to `update_fit_<it>.parquet`. A lagged run (`loop.off_policy_lag: 1`) samples with an
older checkpoint than the update starts from: there `log π_old` here is the update's starting point.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import polars as pl

from pipeline.data import paths
from pipeline.data.tables import ADVANTAGES, STEPS, atomic_file, check_same_turns, read_table, write_text_atomic
from pipeline.model.policy import load_policy
from pipeline.model.ppo import sequence_logprobs


def turn_logprobs(checkpoint: Path, turns: pl.DataFrame, batch_size: int) -> list[float]:
    model, tok = load_policy(checkpoint)
    lp = sequence_logprobs(model, turns["prompt_ids"].to_list(), turns["response_ids"].to_list(), tok.pad_token_id,
                           batch_size)
    return [float(x.sum()) for x in lp]


def summary(turns: pl.DataFrame) -> dict:
    """`turns` has `advantage`, `dlogp` and `action`: the figures the module docstring names."""
    def mean(df):
        return float(df["dlogp"].mean()) if df.height else float("nan")

    pos, neg = turns.filter(pl.col("advantage") > 0), turns.filter(pl.col("advantage") < 0)
    signed = turns.filter(pl.col("advantage") != 0)
    agree = ((signed["advantage"] > 0) == (signed["dlogp"] > 0)).mean() if signed.height else float("nan")
    rho = signed.select(pl.corr("advantage", "dlogp", method="spearman")).item() if signed.height > 1 else None
    actions = (turns.group_by("action").agg(pl.len().alias("turns"), pl.col("advantage").sum().alias("advantage_sum"),
                                            pl.col("dlogp").mean().alias("dlogp_mean"))
               .sort("action", nulls_last=True))
    return {"turns": turns.height, "positive": pos.height, "negative": neg.height,
            "zero": turns.height - pos.height - neg.height,
            "dlogp_mean_positive": mean(pos), "dlogp_mean_negative": mean(neg),
            "dlogp_mean_zero": mean(turns.filter(pl.col("advantage") == 0)),
            "sign_agreement": float(agree), "spearman": float("nan") if rho is None else float(rho),
            "by_action": actions.to_dicts()}


def run(run_dir: Path, it: int, out: Path, batch_size: int = 16) -> dict:
    results = run_dir / "results" if (run_dir / "results").is_dir() else run_dir
    where = {k: results / paths.fill(v, it).removeprefix(paths.RESULTS + "/")
             for k, v in (("steps", paths.STEPS), ("advantages", paths.ADVANTAGES), ("old", paths.PREV_CHECKPOINT),
                          ("new", paths.CHECKPOINT))}
    for k, p in where.items():
        if not p.exists():
            raise FileNotFoundError(f"{p}: missing ({k}); run iteration {it}'s update first")
    steps, adv = read_table(where["steps"], STEPS), read_table(where["advantages"], ADVANTAGES)
    check_same_turns(steps, where["steps"], adv, where["advantages"], "advantages")   # as the update does
    turns = (steps.join(adv, on=["episode_id", "step"])
             .filter(pl.col("response_ids").list.len() > 0).sort("episode_id", "step"))
    old = turn_logprobs(where["old"], turns, batch_size)
    new = turn_logprobs(where["new"], turns, batch_size)
    turns = turns.with_columns(pl.Series("dlogp", [b - a for a, b in zip(old, new, strict=True)]))
    result = {"iteration": it, **summary(turns)}
    out.mkdir(parents=True, exist_ok=True)
    with atomic_file(out / f"update_fit_{it}.parquet") as tmp:
        turns.select("episode_id", "step", "action", "advantage", "dlogp").write_parquet(tmp)
    write_text_atomic(out / f"update_fit_{it}.json", json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="the run's folder (run.dir, or the one holding results/)")
    ap.add_argument("--iteration", type=int, required=True, help="the update to measure (1..N)")
    ap.add_argument("--out", type=Path, default=Path("results/bench"))
    ap.add_argument("--batch-size", type=int, default=16)
    a = ap.parse_args(argv)
    if a.iteration < 1:
        ap.error("--iteration: the first update is iteration 1")
    r = run(a.run, a.iteration, a.out, a.batch_size)
    print(f"iteration {r['iteration']}: {r['turns']} turns; mean dlogp: A>0 {r['dlogp_mean_positive']:+.4f} "
          f"({r['positive']}), A<0 {r['dlogp_mean_negative']:+.4f} ({r['negative']}), A=0 {r['dlogp_mean_zero']:+.4f} "
          f"({r['zero']}); sign agreement {r['sign_agreement']:.3f}; Spearman {r['spearman']:.3f}")
    for row in r["by_action"]:
        print(f"  {row['action']!s:>12}: {row['turns']:4d} turns, advantage sum {row['advantage_sum']:+8.3f}, "
              f"mean dlogp {row['dlogp_mean']:+.4f}")


if __name__ == "__main__":
    main()
