"""Streaming reads of the merged table by global row range.

Global row order = the merged table's files in order (`merge.manifest.merged_shard_paths`), rows in file order. Only the Parquet footers are read to locate a
range; then only the overlapping row groups of the overlapping files are decoded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eagle_pipeline.merge.manifest import SHARD_GLOB, merged_shard_paths
from eagle_pipeline.shared.arrow import list_rows

EXTRACT_COLUMNS = ("sample_id", "dataset", "input_ids", "loss_mask", "n_tokens")


def merged_parts(merged_dir: str | Path) -> list[Path]:
    """The merged table's files (`merge.manifest.merged_shard_paths`); FileNotFoundError when there are none."""
    parts = merged_shard_paths(merged_dir)
    if not parts:
        raise FileNotFoundError(f"no {SHARD_GLOB} in {merged_dir}")
    return parts


def count_rows(merged_dir: str | Path) -> int:
    return sum(pq.ParquetFile(p).metadata.num_rows for p in merged_parts(merged_dir))


def num_shards(n_rows: int, shard_size: int) -> int:
    if shard_size <= 0:
        raise ValueError(f"shard_size must be positive, got {shard_size}")
    return -(-n_rows // shard_size)


def shard_row_range(shard_index: int, shard_size: int, n_rows: int) -> tuple[int, int]:
    """Global rows [start, stop) of extraction shard `shard_index`."""
    n = num_shards(n_rows, shard_size)
    if not 0 <= shard_index < n:
        raise IndexError(f"shard {shard_index} out of range: {n_rows} rows / {shard_size} per shard = {n} shards")
    start = shard_index * shard_size
    return start, min(start + shard_size, n_rows)


@dataclass
class MergedRows:
    """Rows [start, stop) of the merged table: ids/masks as numpy arrays (one per row). `row_index` holds each
    row's global index when some rows of the range were left out (`select`); None means start, start + 1, ..."""

    row_start: int
    sample_ids: list[str]
    datasets: list[str]
    input_ids: list[np.ndarray]
    loss_mask: list[np.ndarray]
    row_index: list[int] | None = field(default=None)
    range_stop: int | None = field(default=None)  # the range's end when `select` left rows out

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def row_stop(self) -> int:
        """The end of the range these rows come from, rows left out by `select` included (the shard's range)."""
        return self.range_stop if self.range_stop is not None else self.row_start + len(self)

    def global_row(self, i: int) -> int:
        """The merged-table row of row `i` of this selection."""
        return self.row_index[i] if self.row_index is not None else self.row_start + i

    def select(self, keep: list[int]) -> MergedRows:
        """The rows at positions `keep` (ascending), keeping their global row indices."""
        return MergedRows(
            row_start=self.row_start,
            sample_ids=[self.sample_ids[i] for i in keep],
            datasets=[self.datasets[i] for i in keep],
            input_ids=[self.input_ids[i] for i in keep],
            loss_mask=[self.loss_mask[i] for i in keep],
            row_index=[self.global_row(i) for i in keep],
            range_stop=self.row_stop,
        )

    @property
    def lengths(self) -> list[int]:
        return [len(x) for x in self.input_ids]


def read_rows(merged_dir: str | Path, start: int, stop: int) -> MergedRows:
    """Read global rows [start, stop); rows are checked for consistent n_tokens / ids / mask lengths."""
    tables: list[pa.Table] = []
    offset = 0
    for part in merged_parts(merged_dir):
        pf = pq.ParquetFile(part)
        n = pf.metadata.num_rows
        if offset + n <= start or offset >= stop:
            offset += n
            continue
        rg_offset = offset
        groups: list[int] = []
        first_row: int | None = None
        for g in range(pf.metadata.num_row_groups):
            g_rows = pf.metadata.row_group(g).num_rows
            if rg_offset + g_rows > start and rg_offset < stop:
                groups.append(g)
                first_row = rg_offset if first_row is None else first_row
            rg_offset += g_rows
        assert first_row is not None  # the file overlaps [start, stop), so one of its row groups does
        table = pf.read_row_groups(groups, columns=list(EXTRACT_COLUMNS))
        lo = max(start - first_row, 0)
        hi = min(stop - first_row, table.num_rows)
        tables.append(table.slice(lo, hi - lo))
        offset += n
    if not tables:
        raise IndexError(f"rows [{start}, {stop}) not in {merged_dir}")
    table = pa.concat_tables(tables)
    if table.num_rows != stop - start:
        raise IndexError(f"rows [{start}, {stop}) requested, {table.num_rows} found in {merged_dir}")
    # Writable copies: the extractor hands them to torch.
    ids = list_rows(table.column("input_ids"), np.int32, name="merged column input_ids", writable=True)
    masks = list_rows(table.column("loss_mask"), np.int8, name="merged column loss_mask", writable=True)
    n_tokens = table.column("n_tokens").to_numpy()
    sample_ids = table.column("sample_id").to_pylist()
    for i, (a, m, n) in enumerate(zip(ids, masks, n_tokens)):
        if len(a) != n or len(m) != n:
            raise ValueError(
                f"merged row {start + i} ({sample_ids[i]}): n_tokens={n} but len(input_ids)={len(a)}, "
                f"len(loss_mask)={len(m)}"
            )
    return MergedRows(
        row_start=start,
        sample_ids=sample_ids,
        datasets=table.column("dataset").to_pylist(),
        input_ids=ids,
        loss_mask=masks,
    )
