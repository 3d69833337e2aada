"""The index of a shard, written last as its 'done' marker (every engine writes it the same way)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .format import FORMAT_NAME, FORMAT_VERSION, TENSOR_NAMES, tensor_key, write_index
from .merged import MergedRows
from .shards import FINGERPRINT_META_KEY, ShardSummary


def write_shard_index(
    idx_path: Path,
    rows: MergedRows,
    summary: ShardSummary,
    nonfinite: np.ndarray,
    *,
    hidden: int,
    model: dict[str, Any],
    extra: Mapping[str, Any] | None = None,
) -> None:
    """The index, written last: the shard's 'done' marker, with the file's hash and the fingerprint (and `extra`:
    what an engine records of its own, the final-state convention, the recorded head's hash and, in a trainer
    layout, its files)."""
    index_meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "safetensors_file": Path(summary.path).name,
        "sha256": summary.sha256,
        "size_bytes": summary.size_bytes,
        "shard_index": summary.shard_index,
        "row_start": summary.row_start,
        "row_stop": summary.row_stop,
        "aux_layers": summary.aux_layers,
        "hidden_size": hidden,
        "dtype": summary.dtype,
        "final_state_is_post_norm": summary.final_state_is_post_norm,
        "model": model,
        FINGERPRINT_META_KEY: summary.fingerprint,
        "summary": summary.to_dict(),
        **(extra or {}),
    }
    write_index(
        idx_path,
        {
            "sample_id": rows.sample_ids,
            "dataset": rows.datasets,
            "row_index": [rows.global_row(i) for i in range(len(rows))],
            "n_tokens": rows.lengths,
            "n_supervised": [int((m != 0).sum()) for m in rows.loss_mask],
            "n_nonfinite": nonfinite.tolist(),
            "keys": [[tensor_key(sid, k) for k in TENSOR_NAMES] for sid in rows.sample_ids],
        },
        index_meta,
    )


def transformers_version() -> str:
    try:
        import transformers

        return transformers.__version__
    except Exception:
        return "unknown"
