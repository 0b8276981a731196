"""The project's figures: matplotlib without a display, laid out and saved atomically as PNG (the report stage
and the benchmarks draw with these)."""

from __future__ import annotations

import base64
import io
from pathlib import Path

from pipeline.data.tables import atomic_file


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed). Imported on demand: stages that draw nothing
    do not pay its start-up."""
    import matplotlib  # start-up cost: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # start-up cost: matplotlib

    return plt


def save_figure(fig, path: str | Path, tight_box: bool = False) -> None:
    """Lay out `fig`, write it to `path` as PNG (whole or not at all), and close it. `tight_box` crops the PNG to
    what is drawn, so that a figure legend placed outside the axes (below them, say) is kept in the picture."""
    fig.tight_layout()
    with atomic_file(path, suffix=".png") as tmp:
        fig.savefig(tmp, bbox_inches="tight" if tight_box else None)
    pyplot().close(fig)


def figure_base64(fig) -> str:
    """`fig` as a base64 PNG (for an HTML page that carries its pictures), closed afterwards."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    pyplot().close(fig)
    return base64.b64encode(buf.getvalue()).decode()
