"""Small figures and tables for the asset-check dashboards (no Dagster imports).

Histograms are rendered to PNG with matplotlib's Agg backend and embedded as base64 Markdown images, which the
Dagster UI shows inline in asset metadata.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


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


def list_lengths(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return pc.list_value_length(column).to_numpy(zero_copy_only=False)


def text_lengths(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Characters per string (nulls count as 0)."""
    return pc.fill_null(pc.utf8_length(column), 0).to_numpy(zero_copy_only=False)


def value_counts(column: pa.ChunkedArray | pa.Array, null_label: str = "none") -> dict[str, int]:
    """Counts of each value (nulls under `null_label`), for JSON metadata."""
    if len(column) == 0:
        return {}
    return {str(r["values"]): int(r["counts"]) for r in pc.value_counts(pc.fill_null(column, null_label)).to_pylist()}


def dataset_overview(
    root,
    datasets: Sequence[str],
    merged_rows: Mapping[str, int] | None = None,
    responses: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[dict]:
    """One row per dataset: responses, spend, failed requests, provider split, token samples, audit verdict, merged
    (the gates behind a verdict are in the audit view, audit_overview).

    `root` is a storage.DataRoot. Reads only Parquet columns it needs and the audit reports. `responses` maps a
    dataset to its responses columns (generation.coverage.response_overview: rows answering the current prompts,
    rows answering other prompts, the ledger's spend, the provider split).
    """
    import pyarrow.parquet as pq

    from eagle_pipeline.storage import read_json

    rows = []
    for ds in datasets:
        errs = sorted(root.errors_dir(ds).glob("part-*.parquet"))
        n_errors = sum(pq.read_metadata(p).num_rows for p in errs)
        audit = read_json(root.audit_report(ds)) if root.audit_report(ds).exists() else None
        rows.append(
            {
                "dataset": ds,
                **dict((responses or {}).get(ds, {"responses": 0, "other_prompt_rows": 0, "spend_usd": 0.0})),
                "failed_requests": n_errors,
                "token_samples": pq.read_metadata(root.tokens(ds)).num_rows if root.tokens(ds).exists() else 0,
                "audit": "-" if audit is None else ("pass" if audit.get("passed") else "FAIL"),
                "merged_rows": int((merged_rows or {}).get(ds, 0)),
            }
        )
    return rows
