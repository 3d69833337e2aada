"""What every engine writes the same way: the shard file's header, the shard's summary, and its index (written
last as the shard's 'done' marker)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle_pipeline.drafter_types import POST_NORM, PRE_NORM
from eagle_pipeline.hidden_states.models.layers import aux_layer_to_hf_index, final_state_hf_index
from eagle_pipeline.hidden_states.settings import SHARDS
from eagle_pipeline.hidden_states.store.fingerprint import ExtractionFingerprint
from eagle_pipeline.hidden_states.store.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    TENSOR_NAMES,
    dtype_name,
    read_index,
    read_index_meta,
    tensor_key,
    write_index,
)
from eagle_pipeline.hidden_states.store.merged import MergedRows
from eagle_pipeline.hidden_states.store.shards import FINGERPRINT_META_KEY, ShardSummary

IDS_DTYPE = torch.int32
MASK_DTYPE = torch.int8
IDS_BYTES = IDS_DTYPE.itemsize  # int32 input_ids in a shard
MASK_BYTES = MASK_DTYPE.itemsize  # int8 loss_mask in a shard
# Beyond the tensors' bytes, measured with the writers (test_hs_disk_plan holds the plan within 1 % of real files):
PROJECT_SHARD_SAMPLE_BYTES = 640  # four safetensors header entries (~90 B each) + the index row (~380 B measured)
IDS_SHARD_SAMPLE_BYTES = 600  # two header entries + the index row with the trainer file's path and digest (~575 B)


def shard_header(
    rows: MergedRows,
    *,
    shard_index: int,
    aux: Sequence[int],
    num_layers: int,
    hidden_size: int,
    dtype: torch.dtype,
    final_state: str,
    model: Mapping[str, Any],
    fingerprint: ExtractionFingerprint,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The safetensors header of shard `shard_index` (the file format, docs/hidden_states.md): layer conventions,
    dtypes, the rows it holds, the model's description and the fingerprint; `extra`: what an engine adds of its own
    (the final norm's eps, vLLM's layer ids, a trainer layout)."""
    post_norm = final_state == POST_NORM
    return {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "aux_layers": json.dumps(list(aux)),
        "aux_layers_convention": "0-based decoder-layer outputs",
        # null where the tensor is not in transformers' tuple (the last layer's raw output; a pre-norm final state)
        "hf_hidden_states_indices": json.dumps([aux_layer_to_hf_index(x, num_layers) for x in aux]),
        "hf_hidden_states_final_index": json.dumps(final_state_hf_index(num_layers, post_norm=post_norm)),
        "final_state_is_post_norm": json.dumps(post_norm),
        "final_state": final_state,
        "hidden_size": str(hidden_size),
        "dtype": dtype_name(dtype),
        "ids_dtype": dtype_name(IDS_DTYPE),
        "mask_dtype": dtype_name(MASK_DTYPE),
        "shard_index": str(shard_index),
        "row_start": str(rows.row_start),
        "row_stop": str(rows.row_stop),
        "rows": str(len(rows)),
        "tokens": str(sum(rows.lengths)),
        "model": json.dumps(dict(model), sort_keys=True),
        "fingerprint": json.dumps(fingerprint.to_dict(), sort_keys=True),
        "torch_version": torch.__version__,
        "transformers_version": transformers_version(),
        **(extra or {}),
    }


def shard_summary(
    rows: MergedRows,
    *,
    shard_index: int,
    paths: tuple[Path, Path],
    sha256: str,
    size_bytes: int,
    dtype: torch.dtype,
    final_state: str,
    fingerprint: ExtractionFingerprint,
    seconds: float,
    compute_seconds: float,
    write_wait_seconds: float,
    batches: int,
    padded_tokens: int = 0,
    nonfinite_samples: int = 0,
) -> ShardSummary:
    """The summary of a shard just written (`paths`: its file and index), as every engine reports and stores it."""
    real = int(sum(rows.lengths))
    return ShardSummary(
        shard_index=shard_index,
        row_start=rows.row_start,
        row_stop=rows.row_stop,
        rows=len(rows),
        tokens=real,
        padded_tokens=padded_tokens,
        padding_fraction=padded_tokens / max(real + padded_tokens, 1),
        batches=batches,
        seconds=seconds,
        tokens_per_s=real / seconds if seconds > 0 else float("inf"),
        path=str(paths[0]),
        index_path=str(paths[1]),
        sha256=sha256,
        size_bytes=size_bytes,
        dtype=dtype_name(dtype),
        aux_layers=list(fingerprint.aux_layers),
        final_state_is_post_norm=final_state == POST_NORM,
        n_nonfinite_samples=nonfinite_samples,
        compute_seconds=compute_seconds,
        write_wait_seconds=write_wait_seconds,
        fingerprint=fingerprint.to_dict(),
    )


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


def shard_indexes(hs_dir: str | Path) -> list[tuple[int, dict[str, Any], list[str]]]:
    """(shard number, index metadata, sample ids) of every shard index under `hs_dir`, in shard order."""
    out = []
    for idx_path in sorted(Path(hs_dir).glob("shard-*.index.parquet")):
        meta = read_index_meta(idx_path)
        out.append((int(meta["shard_index"]), meta, read_index(idx_path).column("sample_id").to_pylist()))
    return out


def recorded_layout(meta: Mapping[str, Any]) -> str:
    """The layout a shard's index metadata records its states in (`settings.LAYOUT_NAMES`)."""
    return str(meta.get("layout", SHARDS))


def shard_final_state(meta: Mapping[str, Any]) -> str:
    """The final-state convention a shard's index metadata records ('pre_norm' | 'post_norm')."""
    if "final_state" in meta:
        return str(meta["final_state"])
    return POST_NORM if meta.get("final_state_is_post_norm", True) else PRE_NORM


def recorded_drops(hs_dir: str | Path) -> list[dict[str, Any]]:
    """The rows the shards under `hs_dir` left out (`dropped_rows` of their indexes: `too_long_rows: drop`), in
    shard order: they have no states, so the exports leave them out too."""
    return [dict(d) for _shard, meta, _ids in shard_indexes(hs_dir) for d in meta.get("dropped_rows") or []]
