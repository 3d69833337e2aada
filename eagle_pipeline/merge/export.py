"""Trainer-facing exports of the merged dataset.

* SpecForge `data.prompts_path`: JSON lines of {"input_ids": [int...], "loss_mask": [0|1...]}.
* Hugging Face / speculators: Parquet shards under train/ and eval/ readable by
  `datasets.load_dataset("parquet", data_files=...)`.
Both stream the merged shards in bounded batches and keep the merged (seeded) row order.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from eagle_pipeline.merge.arrow_ops import supervised_per_row
from eagle_pipeline.merge.manifest import MERGED_SCHEMA, ROW_GROUP_ROWS, SHARD_GLOB, shard_name
from eagle_pipeline.merge.reader import iter_merged_shards
from eagle_pipeline.shared.arrow import list_parts, make_list
from eagle_pipeline.shared.storage import (
    atomic_path,
    clean_stale_tmp,
    file_sha256,
    write_json_atomic,
    write_parquet_atomic,
)

EXPORT_BATCH_ROWS = 1024
SPLITS = ("train", "eval")
# The merged table's contract columns minus `split`, which becomes the train/ and eval/ folders.
HF_SCHEMA = pa.schema(
    [
        MERGED_SCHEMA.field(name)
        for name in (
            "sample_id",
            "dataset",
            "input_ids",
            "loss_mask",
            "n_tokens",
            "n_prompt_tokens",
            "source",
            "backend",
            "provider",
        )
    ]
)
HF_MANIFEST = "export_manifest.json"


def hf_manifest_path(out_dir: str | Path) -> Path:
    """Where `export_hf_parquet` writes its manifest: beside the data folder, never in it (`load_dataset(out_dir)`
    and speculators' tools would read a JSON file inside it as data)."""
    out_dir = Path(out_dir)
    return out_dir.parent / f"{out_dir.name}.{HF_MANIFEST}"


@dataclass
class ExportSummary:
    format: str
    rows: dict[str, int]  # split -> rows
    tokens: dict[str, int]
    supervised_tokens: dict[str, int]
    files: dict[str, list[str]] = field(default_factory=dict)  # split -> paths
    sha256: dict[str, str] = field(default_factory=dict)  # path -> sha256

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _split_filter(t: pa.Table, split: str | None) -> pa.Table:
    return t if split is None else t.filter(pc.equal(t["split"], split))


def _json_int_lists(arr: pa.Array | pa.ChunkedArray, value_type: pa.DataType) -> pa.Array:
    """Each list row rendered as comma-joined decimal text, e.g. "1,2,3" (Arrow casts, no Python ints)."""
    lengths, values = list_parts(arr, value_type)
    text = pc.cast(pa.array(values), pa.string())
    return pc.binary_join(make_list(lengths, text, pa.string()), ",")


def _string_array_bytes(arr: pa.Array) -> memoryview:
    """The concatenated UTF-8 payload of a (non-null) string array, without a copy per row."""
    arr = arr.cast(pa.large_string())
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64)[arr.offset : arr.offset + len(arr) + 1]
    return memoryview(arr.buffers()[2])[offsets[0] : offsets[-1]]


def export_specforge_jsonl(merged_dir: str | Path, out_path: str | Path, split: str | None = "train") -> ExportSummary:
    """One {"input_ids": [...], "loss_mask": [...]} object per line (SpecForge's pre-tokenized prompts format).

    Only those two keys are written: that is the whole contract SpecForge validates. Line order is merged order;
    `split=None` exports every row.
    """
    out_path = Path(out_path)
    rows = tokens = supervised = 0
    with atomic_path(out_path) as tmp, open(tmp, "wb") as fh:
        for t in iter_merged_shards(merged_dir, ["input_ids", "loss_mask", "split"], batch_rows=EXPORT_BATCH_ROWS):
            t = _split_filter(t, split)
            if t.num_rows == 0:
                continue
            lines = pc.binary_join_element_wise(
                '{"input_ids":[',
                _json_int_lists(t["input_ids"], pa.int32()),
                '],"loss_mask":[',
                _json_int_lists(t["loss_mask"], pa.int8()),
                "]}\n",
                "",
            )
            fh.write(_string_array_bytes(lines))
            _, mask = list_parts(t["loss_mask"], pa.int8())
            rows += t.num_rows
            tokens += len(mask)
            supervised += int(np.count_nonzero(mask))
    key = split or "all"
    return ExportSummary(
        format="specforge_jsonl",
        rows={key: rows},
        tokens={key: tokens},
        supervised_tokens={key: supervised},
        files={key: [str(out_path)]},
        sha256={str(out_path): file_sha256(out_path)},
    )


class _ShardSink:
    """Buffers rows of one split and writes fixed-size shards; removes shards left by a larger earlier export."""

    def __init__(self, directory: Path, rows_per_shard: int) -> None:
        self.dir = directory
        self.rows_per_shard = rows_per_shard
        self.buf: list[pa.Table] = []
        self.buffered = 0
        self.paths: list[Path] = []
        self.rows = self.tokens = self.supervised = 0
        directory.mkdir(parents=True, exist_ok=True)
        clean_stale_tmp(directory)

    def add(self, t: pa.Table) -> None:
        if t.num_rows:
            self.buf.append(t)
            self.buffered += t.num_rows
        while self.buffered >= self.rows_per_shard:
            self._flush(self.rows_per_shard)

    def _flush(self, n: int) -> None:
        allrows = pa.concat_tables(self.buf) if self.buf else HF_SCHEMA.empty_table()
        head, rest = allrows.slice(0, n), allrows.slice(n)
        self.buf = [rest] if rest.num_rows else []
        self.buffered = rest.num_rows
        path = write_parquet_atomic(
            head.combine_chunks(), self.dir / shard_name(len(self.paths)), row_group_size=ROW_GROUP_ROWS
        )
        self.paths.append(path)
        n_tok = np.asarray(head["n_tokens"], dtype=np.int64)
        self.rows += head.num_rows
        self.tokens += int(n_tok.sum())
        self.supervised += int(supervised_per_row(head["loss_mask"], n_tok).sum())  # folded turns included

    def close(self) -> None:
        if self.buffered or not self.paths:
            # An empty split still gets one (empty) shard so a data_files glob always matches.
            self._flush(max(self.buffered, 0))
        keep = {p.name for p in self.paths}
        for p in self.dir.glob(SHARD_GLOB):
            if p.name not in keep:
                p.unlink()


def export_hf_parquet(merged_dir: str | Path, out_dir: str | Path, *, rows_per_shard: int = 10_000) -> ExportSummary:
    """Parquet shards `{out_dir}/{train,eval}/part-NNNNN.parquet` (input_ids list<int32>, loss_mask list<int8>).

    Load with `datasets.load_dataset("parquet", data_files={"train": f"{out_dir}/train/*.parquet",
    "eval": f"{out_dir}/eval/*.parquet"})` or `datasets.load_dataset(str(out_dir))` (eval becomes "test"); the
    manifest is `hf_manifest_path(out_dir)`, outside the data folder.
    """
    out_dir = Path(out_dir)
    sinks = {s: _ShardSink(out_dir / s, rows_per_shard) for s in SPLITS}
    for t in iter_merged_shards(merged_dir, HF_SCHEMA.names + ["split"], batch_rows=EXPORT_BATCH_ROWS):
        for s, sink in sinks.items():
            sink.add(_split_filter(t, s).select(HF_SCHEMA.names).cast(HF_SCHEMA))
    for sink in sinks.values():
        sink.close()
    summary = ExportSummary(
        format="hf_parquet",
        rows={s: k.rows for s, k in sinks.items()},
        tokens={s: k.tokens for s, k in sinks.items()},
        supervised_tokens={s: k.supervised for s, k in sinks.items()},
        files={s: [str(p) for p in k.paths] for s, k in sinks.items()},
        sha256={str(p): file_sha256(p) for k in sinks.values() for p in k.paths},
    )
    write_json_atomic(summary.to_dict(), hf_manifest_path(out_dir))
    (out_dir / HF_MANIFEST).unlink(missing_ok=True)  # where exports before this version put it
    return summary
