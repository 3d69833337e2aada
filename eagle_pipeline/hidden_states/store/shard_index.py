"""A shard's index as its readers see it (the index is written by `shard_writer.ShardWriter`), and the sizes of a
shard's ids and masks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eagle_pipeline.hidden_states.store.format import read_index, read_index_meta

IDS_DTYPE = torch.int32
MASK_DTYPE = torch.int8
IDS_BYTES = IDS_DTYPE.itemsize  # int32 input_ids in a shard
MASK_BYTES = MASK_DTYPE.itemsize  # int8 loss_mask in a shard
# Beyond the tensors' bytes, measured with the writers (test_hs_disk_plan holds the plan within 1 % of real files):
PROJECT_SHARD_SAMPLE_BYTES = 640  # four safetensors header entries (~90 B each) + the index row (~380 B measured)
IDS_SHARD_SAMPLE_BYTES = 600  # two header entries + the index row with the trainer file's path and digest (~575 B)


def shard_indexes(hs_dir: str | Path) -> list[tuple[int, dict[str, Any], list[str]]]:
    """(shard number, index metadata, sample ids) of every shard index under `hs_dir`, in shard order."""
    out = []
    for idx_path in sorted(Path(hs_dir).glob("shard-*.index.parquet")):
        meta = read_index_meta(idx_path)
        out.append((int(meta["shard_index"]), meta, read_index(idx_path).column("sample_id").to_pylist()))
    return out


def recorded_drops(hs_dir: str | Path) -> list[dict[str, Any]]:
    """The rows the shards under `hs_dir` left out (`dropped_rows` of their indexes: `too_long_rows: drop`), in
    shard order: they have no states, so the exports leave them out too."""
    return [dict(d) for _shard, meta, _ids in shard_indexes(hs_dir) for d in meta.get("dropped_rows") or []]
