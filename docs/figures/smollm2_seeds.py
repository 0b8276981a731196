"""Draw docs/smollm2_2to5_seeds.png: SmolLM2's held-out success by iteration, GRPO and GiGPO, one panel a seed and
machine, from the numbers measured in docs/results/real-models.md (each section gives the commands that made them).

    PYTHONPATH=. python docs/figures/smollm2_seeds.py [out.png]
"""

import math
import sys
from pathlib import Path

from pipeline.data.figures import pyplot, save_figure

# (title, warm-start line, {method: (held-out success by iteration on 128 episodes, last checkpoint on 384 or None)})
PANELS = [
    ("seed 0, this CPU (6 iterations)", 0.586,
     {"GRPO": ([0.562, 0.672, 0.586, 0.625, 0.664, 0.703, 0.703], 0.703),
      "GiGPO": ([0.562, 0.586, 0.578, 0.633, 0.609, 0.703, 0.703], 0.682)}),
    ("seed 1, an H100 (5 iterations)", 0.344,
     {"GRPO": ([0.344, 0.398, 0.344, 0.398, 0.477, 0.492], None),
      "GiGPO": ([0.344, 0.391, 0.406, 0.414, 0.445, 0.469], None)}),
    ("seed 1, this CPU (6 iterations)", 0.414,
     {"GRPO": ([0.414, 0.430, 0.297, 0.312, 0.391, 0.391, 0.477], 0.484),
      "GiGPO": ([0.414, 0.406, 0.352, 0.398, 0.406, 0.391, 0.469], 0.445)}),
    ("seed 2, this CPU (6 iterations)", 0.367,
     {"GRPO": ([0.367, 0.430, 0.484, 0.461, 0.453, 0.453, 0.516], 0.513),
      "GiGPO": ([0.367, 0.414, 0.492, 0.547, 0.562, 0.633, 0.695], 0.664)}),
]
COLOURS = {"GRPO": "tab:blue", "GiGPO": "tab:orange"}


def interval(p: float, n: int) -> float:
    return 1.96 * math.sqrt(p * (1 - p) / n)


def main(out: Path) -> None:
    plt = pyplot()
    cols = 2 if len(PANELS) > 3 else len(PANELS)
    rows = math.ceil(len(PANELS) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows + 0.6), sharey=True, squeeze=False)
    for ax, (title, start, curves) in zip(axes.flat, PANELS):
        ax.axhline(start, color="grey", ls=":", lw=1, label="warm start (iteration 0)")
        ax.axhline(start + 0.10, color="green", ls="--", lw=1, label="warm start + 10 points")
        for k, (name, (curve, last)) in enumerate(curves.items()):
            c = COLOURS[name]
            ax.errorbar(range(len(curve)), curve, yerr=[interval(p, 128) for p in curve], color=c, marker="o",
                        capsize=3, label=name)
            if last is not None:
                ax.errorbar([len(curve) - 1 + 0.15 * (k + 1)], [last], yerr=[interval(last, 384)], color=c,
                            marker="D", capsize=3, label=f"{name}, last checkpoint on 384 episodes")
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.set_xticks(range(7))
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(PANELS):]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("held-out success, sampled")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.suptitle("SmolLM2-135M-Instruct on Sokoban rooms of 2-5 moves, GRPO and GiGPO from the warm start "
                 "(128 episodes a point, bars 1.96 SE)")
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=9, frameon=False)
    save_figure(fig, out, tight_box=True)   # the legend below the panels


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "smollm2_2to5_seeds.png")
