"""Draw docs/dpo_sql_log.png: step-DPO on SQL with SmolLM2, LearNAT's log margin (solid) against the earlier linear
margin (dashed), the AST and the value margin, beside the PPO runs, one panel a seed; the log-margin arms from
docs/data/dpo_sql_s<seed>_log/arms.csv, the rest from the numbers of docs/results/sql.md (its sections give the
commands that made them).

    PYTHONPATH=. python docs/figures/dpo_sql_log.py [out.png]
"""

import math
import sys
from pathlib import Path

import polars as pl

from pipeline.data.figures import pyplot, save_figure

DATA = Path(__file__).resolve().parents[1] / "data"
EVERY = [0, 1, 2, 3, 4, 5, 6]
# (iterations, held-out accuracy) of the runs before the log margin, and of the PPO runs; by seed
EARLIER = {
    0: {"AST margin, linear (own warm start)": (EVERY, [0.148, 0.102, 0.125, 0.148, 0.180, 0.188, 0.289]),
        "value margin, linear (own warm start)": (EVERY, [0.148, 0.125, 0.172, 0.195, 0.188, 0.117, 0.070]),
        "PPO, GRPO (own warm start)": (EVERY, [0.148, 0.133, 0.148, 0.203, 0.289, 0.250, 0.266])},
    1: {"AST margin, linear (own warm start)": (EVERY, [0.156, 0.133, 0.188, 0.180, 0.156, 0.133, 0.211]),
        "value margin, linear (own warm start)": (EVERY, [0.156, 0.148, 0.148, 0.156, 0.133, 0.148, 0.172]),
        "PPO, GRPO (same warm start)": ([0, 2, 4, 6], [0.133, 0.234, 0.234, 0.203]),
        "PPO, GiGPO (same warm start)": ([0, 2, 4, 6], [0.133, 0.141, 0.203, 0.258])},
}
STYLE = {"AST": "tab:orange", "value": "tab:blue", "GRPO": "tab:grey", "GiGPO": "tab:green"}


def colour(label: str) -> str:
    return next(c for key, c in STYLE.items() if key in label)


def log_arms(seed: int) -> dict[str, tuple[list[int], list[float]]]:
    arms = pl.read_csv(DATA / f"dpo_sql_s{seed}_log" / "arms.csv").filter(pl.col("held_out_success").is_not_null())
    start = pl.read_csv(DATA / f"dpo_sql_s{seed}_log" / "task_success_oracle.csv").filter(
        pl.col("iteration") == 0)["success"].mean()
    out = {}
    for arm, name in (("oracle", "AST margin, log (new)"), ("value", "value margin, log (new)")):
        a = arms.filter(pl.col("arm") == arm).sort("iteration")
        out[name] = ([0, *a["iteration"].to_list()], [start, *a["held_out_success"].to_list()])
    return out


def main(out: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), sharey=True)
    for ax, seed in zip(axes, (0, 1)):
        for name, (its, acc) in log_arms(seed).items():
            ax.errorbar(its, acc, yerr=[1.96 * math.sqrt(p * (1 - p) / 128) for p in acc], color=colour(name),
                        marker="o", lw=2, capsize=3, label=name)
        for name, (its, acc) in EARLIER[seed].items():
            ax.plot(its, acc, color=colour(name), ls="--" if "margin" in name else ":", marker=".", alpha=0.8,
                    label=name)
        ax.set_title(f"seed {seed}")
        ax.set_xlabel("iteration")
        ax.set_xticks(EVERY)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    axes[0].set_ylabel("held-out execution accuracy (128 episodes)")
    fig.suptitle("SmolLM2 step-DPO on SQL: LearNAT's log margin (solid, bars 1.96 SE) against the linear margin "
                 "(dashed) and PPO (dotted)")
    save_figure(fig, out)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "dpo_sql_log.png")
