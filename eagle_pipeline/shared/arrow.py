"""Arrow columns as numpy: list columns (token ids, loss masks), one module for every stage that reads or builds
them; and the counts asset metadata shows (list and text lengths, value counts).

Everything works on offsets and flat value buffers (numpy views of Arrow memory); no per-row Python except where a
caller asks for per-row views. Null lists and null values are rejected unless a function says otherwise: a null
token list means a broken upstream row, and silently treating it as empty would hide that.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

INT32_MAX = np.iinfo(np.int32).max


def as_array(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One contiguous array (a ChunkedArray is combined; a plain array is returned as is)."""
    if isinstance(arr, pa.ChunkedArray):
        return arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    return arr


def list_parts(arr: pa.Array | pa.ChunkedArray, value_type: pa.DataType) -> tuple[np.ndarray, np.ndarray]:
    """(lengths int64, flat values) of a list array, honouring slicing; values cast to `value_type`."""
    a = as_array(arr)
    if a.null_count:
        raise ValueError(f"list column has {a.null_count} null rows")
    offsets = np.asarray(a.offsets, dtype=np.int64)
    values = a.values.slice(offsets[0], offsets[-1] - offsets[0])
    if values.null_count:
        raise ValueError(f"list column has {values.null_count} null values")
    if values.type != value_type:
        values = pc.cast(values, value_type)
    return np.diff(offsets), values.to_numpy(zero_copy_only=False)


def offsets_from_lengths(lengths: np.ndarray, hint: str = "use smaller shards") -> np.ndarray:
    """int32 Arrow offsets for the given row lengths (raises past the int32 list limit, with `hint` on what to do)."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > INT32_MAX:
        raise ValueError(f"{offsets[-1]} values exceed one list<> array's int32 offsets; {hint}")
    return offsets.astype(np.int32)


def make_list(
    lengths: npt.ArrayLike, values: np.ndarray, value_type: pa.DataType, hint: str = "use smaller shards"
) -> pa.ListArray:
    """A list array from row lengths and the concatenation of all rows' values."""
    offsets = offsets_from_lengths(np.asarray(lengths, dtype=np.int64), hint)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type))


def _row_views(
    arr: pa.Array | pa.ChunkedArray, dtype: npt.DTypeLike, *, name: str, null_rows: bool, writable: bool
) -> list[np.ndarray | None]:
    a = as_array(arr)
    if a.null_count and not null_rows:
        raise ValueError(f"{name} has {a.null_count} null rows")
    offsets = np.asarray(a.offsets, dtype=np.int64)
    # `.values` is the whole child, whatever the array's slice; keep only the part these rows cover.
    values = a.values.slice(offsets[0], offsets[-1] - offsets[0])
    if values.null_count:
        raise ValueError(f"{name} holds {values.null_count} null values inside its lists")
    flat = values.to_numpy(zero_copy_only=False)
    flat = np.array(flat, dtype=dtype) if writable else flat.astype(dtype, copy=False)
    offsets -= offsets[0]
    if not a.null_count:
        return [flat[offsets[i] : offsets[i + 1]] for i in range(len(a))]
    valid = a.is_valid().to_numpy(zero_copy_only=False)
    return [flat[offsets[i] : offsets[i + 1]] if valid[i] else None for i in range(len(a))]


def list_rows(
    arr: pa.Array | pa.ChunkedArray, dtype: npt.DTypeLike, *, name: str = "list column", writable: bool = False
) -> list[np.ndarray]:
    """Per-row numpy views of a list column over one flat buffer of `dtype` (null rows rejected).

    `writable`: the buffer is a fresh copy (e.g. for `torch.from_numpy`); otherwise it may be Arrow's read-only memory.
    """
    return _row_views(arr, dtype, name=name, null_rows=False, writable=writable)  # type: ignore[return-value]


def nullable_list_rows(
    arr: pa.Array | pa.ChunkedArray, dtype: npt.DTypeLike, *, name: str = "list column"
) -> list[np.ndarray | None]:
    """Per-row numpy views of a list column over one flat buffer of `dtype`, None for null rows."""
    return _row_views(arr, dtype, name=name, null_rows=True, writable=False)


def list_lengths(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Values per list (a null list gives NaN)."""
    return pc.list_value_length(column).to_numpy(zero_copy_only=False)


def text_lengths(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Characters per string (nulls count as 0)."""
    return pc.fill_null(pc.utf8_length(column), 0).to_numpy(zero_copy_only=False)


def value_counts(column: pa.ChunkedArray | pa.Array, null_label: str = "none") -> dict[str, int]:
    """Counts of each value (nulls under `null_label`), for JSON metadata."""
    if len(column) == 0:
        return {}
    return {str(r["values"]): int(r["counts"]) for r in pc.value_counts(pc.fill_null(column, null_label)).to_pylist()}
