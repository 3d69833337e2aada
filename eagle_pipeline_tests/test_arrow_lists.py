"""The shared list-column helpers: slicing, chunking, nulls, dtypes, the int32 offset limit."""

import numpy as np
import pyarrow as pa
import pytest

from eagle_pipeline.shared.arrow import list_parts, list_rows, make_list, nullable_list_rows, offsets_from_lengths


def _chunked() -> pa.ChunkedArray:
    return pa.chunked_array(
        [pa.array([[1, 2], [3]], pa.list_(pa.int64())), pa.array([[], [4, 5, 6]], pa.list_(pa.int64()))]
    )


def test_rows_of_a_sliced_chunked_column():
    col = _chunked().slice(1, 3)
    rows = list_rows(col, np.int32)
    assert [r.tolist() for r in rows] == [[3], [], [4, 5, 6]]
    assert all(r.dtype == np.int32 for r in rows)
    lengths, values = list_parts(col, pa.int32())
    assert lengths.tolist() == [1, 0, 3] and values.tolist() == [3, 4, 5, 6]


def test_writable_rows_are_copies():
    col = pa.chunked_array([pa.array([[7, 8]], pa.list_(pa.int8()))])
    row = list_rows(col, np.int8, writable=True)[0]
    row[0] = 1
    assert row.flags.writeable and col.to_pylist() == [[7, 8]]


def test_null_rows_are_rejected_or_none_and_null_values_always_rejected():
    col = pa.array([[1], None, [2, 3]], pa.list_(pa.int32()))
    with pytest.raises(ValueError, match="ids has 1 null rows"):
        list_rows(col, np.int32, name="ids")
    assert [None if r is None else r.tolist() for r in nullable_list_rows(col, np.int32)] == [[1], None, [2, 3]]
    with pytest.raises(ValueError, match="holds 1 null values"):
        nullable_list_rows(pa.array([[1, None]], pa.list_(pa.int32())), np.int32)


def test_make_list_round_trips_and_refuses_past_int32_offsets():
    arr = make_list([2, 0, 1], np.array([5, 6, 7], dtype=np.int32), pa.int32())
    assert arr.to_pylist() == [[5, 6], [], [7]]
    with pytest.raises(ValueError, match="split the responses"):
        offsets_from_lengths(np.array([2**31, 1]), hint="split the responses")
