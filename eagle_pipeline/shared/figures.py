"""Small figures for the assets' and checks' metadata (no Dagster imports).

Histograms are rendered to PNG with matplotlib's Agg backend and embedded as base64 Markdown images, which the
Dagster UI shows inline in asset metadata.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence

import numpy as np


def histogram_png(
    series: Mapping[str, Sequence[float] | np.ndarray], *, title: str, xlabel: str, bins: int = 30
) -> bytes:
    """One overlaid histogram per named series, as PNG bytes (small: ~6x3 in at 80 dpi)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3), dpi=80)
    try:
        values = [np.asarray(v, dtype=float) for v in series.values()]
        non_empty = [v for v in values if v.size]
        if non_empty:
            lo = min(float(v.min()) for v in non_empty)
            hi = max(float(v.max()) for v in non_empty)
            edges = np.linspace(lo, hi if hi > lo else lo + 1, bins + 1)
            for name, v in zip(series.keys(), values):
                if v.size:
                    ax.hist(v, bins=edges.tolist(), alpha=0.55, label=f"{name} (n={v.size}, median={np.median(v):.0f})")
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel("rows", fontsize=8)
        ax.tick_params(labelsize=7)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()
    finally:
        plt.close(fig)


def markdown_image(png: bytes, alt: str) -> str:
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"


def histogram_markdown(series: Mapping[str, Sequence[float] | np.ndarray], *, title: str, xlabel: str) -> str:
    """A histogram as a Markdown image, for `MetadataValue.md`."""
    return markdown_image(histogram_png(series, title=title, xlabel=xlabel), title)
