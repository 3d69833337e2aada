"""The merge's Arrow memory traffic is linear in the rows it merges, whatever the number of shards it writes: the
inputs are gathered into one buffer once, and each shard takes only its own rows, each row once (a `take` on a table of
many chunks concatenates every chunk first, so a take per shard would copy the whole merge once a shard); counting
each row's supervised tokens copies one block of the loss mask at a time, not all of it as int64."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle_pipeline.merge import MergeInput, MergeSettings, merge_datasets, read_merged
from eagle_pipeline.merge.arrow_ops import supervised_per_row
from eagle_pipeline.shared.arrow import make_list
from eagle_pipeline_tests.merge.conftest import EOT, token_table

ROWS, OUTPUT_TOKENS = 300, 2000


def _long_inputs(tmp_path) -> list[MergeInput]:
    inputs = []
    for d, name in enumerate("ABCD"):
        table = token_table(name, ROWS, seed=d)
        rng = np.random.default_rng(d)
        values = rng.integers(0, 500, ROWS * OUTPUT_TOKENS).astype(np.int32)
        values[OUTPUT_TOKENS - 1 :: OUTPUT_TOKENS] = EOT
        offsets = pa.array(np.arange(0, ROWS * OUTPUT_TOKENS + 1, OUTPUT_TOKENS, dtype=np.int32))
        table = table.set_column(
            table.schema.get_field_index("output_ids"),
            "output_ids",
            pa.ListArray.from_arrays(offsets, pa.array(values)),
        )
        path = tmp_path / "tokens" / f"{name}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path, row_group_size=64)  # several row groups, as a large tokens file has
        inputs.append(MergeInput(name, path))
    return inputs


def _arrow_bytes_allocated(run) -> int:
    """Bytes Arrow allocated (in total, freed or not) while `run` ran."""
    pool = pa.proxy_memory_pool(pa.default_memory_pool())
    previous = pa.default_memory_pool()
    pa.set_memory_pool(pool)
    try:
        run()
    finally:
        pa.set_memory_pool(previous)
    return pool.total_bytes_allocated()


def test_memory_traffic_does_not_grow_with_the_number_of_shards(tmp_path):
    inputs = _long_inputs(tmp_path)
    ids_bytes = 4 * len(inputs) * ROWS * OUTPUT_TOKENS  # the output ids alone: ~9.6 MB
    one = _arrow_bytes_allocated(
        lambda: merge_datasets(inputs, tmp_path / "one", MergeSettings(rows_per_shard=4 * ROWS, eval_fraction=0.0))
    )
    many = _arrow_bytes_allocated(
        lambda: merge_datasets(inputs, tmp_path / "many", MergeSettings(rows_per_shard=25, eval_fraction=0.0))
    )
    assert read_merged(tmp_path / "many").num_rows == read_merged(tmp_path / "one").num_rows == 4 * ROWS
    assert one > ids_bytes  # the measure sees the merge's buffers
    # 48 shards against 1: the same rows gathered once, plus per-shard overhead far below one copy of the ids
    assert many < one + ids_bytes, (one, many, ids_bytes)


def test_each_merged_row_is_taken_once(tmp_path, monkeypatch):
    """Rows are taken from the inputs' tokens once, by the shard that writes them. (A take of each input's selected
    rows first copied every merged row once more; with files of several row groups, twice: 27 MB more Arrow
    allocations here.)"""
    inputs = _long_inputs(tmp_path)
    taken: list[int] = []
    take = pc.take

    def counting_take(data, indices, *args, **kwargs):
        if isinstance(data, pa.Table) and "output_ids" in data.column_names:
            taken.append(len(indices))
        return take(data, indices, *args, **kwargs)

    monkeypatch.setattr(pc, "take", counting_take)
    merge_datasets(inputs, tmp_path / "merged", MergeSettings(rows_per_shard=100, eval_fraction=0.0))
    assert taken == [100] * (4 * ROWS // 100)


def test_supervised_tokens_are_counted_without_an_int64_copy_of_the_mask():
    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 6000, 3000) * (rng.random(3000) < 0.9)  # some empty rows
    lengths[7] = 2_500_000  # one row longer than a block
    lengths[-3:] = 0
    mask = rng.integers(0, 2, int(lengths.sum())).astype(np.int8)  # ~11.5M tokens
    loss_mask = make_list(lengths, mask, pa.int8())
    tracemalloc.start()
    try:
        got = supervised_per_row(loss_mask, lengths)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    starts = np.cumsum(lengths) - lengths
    assert got.tolist() == [int(mask[a : a + k].sum()) for a, k in zip(starts, lengths)]
    # An int64 copy of the whole mask is 8 bytes a token (~92 MB); a block's copy, or the one long row's (20 MB), is
    # what may be live at once.
    assert peak < 2 * mask.size, (peak, mask.size)
