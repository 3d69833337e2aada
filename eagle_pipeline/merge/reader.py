"""Reading the merged table: the committed shards the manifest lists, shard by shard or whole, optionally one split."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .core import MERGED_SCHEMA
from .manifest import merged_shard_paths


def iter_merged_shards(
    out_dir: str | Path, columns: list[str] | None = None, *, batch_rows: int | None = None
) -> Iterator[pa.Table]:
    """Yield the merged data shard by shard (or in batches of about `batch_rows` rows), in merged order."""
    for path in merged_shard_paths(out_dir):
        if batch_rows is None:
            yield pq.read_table(path, columns=columns)
        else:
            pf = pq.ParquetFile(path)
            for batch in pf.iter_batches(batch_size=batch_rows, columns=columns):
                yield pa.Table.from_batches([batch])


def read_merged(out_dir: str | Path, columns: list[str] | None = None, *, split: str | None = None) -> pa.Table:
    """The whole merged table (optionally one split). Use `iter_merged_shards` when it may not fit in memory."""
    wanted = list(columns) if columns is not None else list(MERGED_SCHEMA.names)
    read_cols = wanted if split is None or "split" in wanted else wanted + ["split"]
    tables = []
    for t in iter_merged_shards(out_dir, read_cols):
        if split is not None:
            t = t.filter(pc.equal(t["split"], split))
        tables.append(t.select(wanted))
    if not tables:
        return pa.schema([MERGED_SCHEMA.field(c) for c in wanted]).empty_table()
    return pa.concat_tables(tables)
