"""Vectorised list-array arithmetic shared by merge, checks, vocab and exports (the generic list-column helpers are
in `eagle_pipeline.shared.arrow`).

Everything here works on offsets and flat value buffers (numpy views of Arrow memory); no per-row Python.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa

from eagle_pipeline.shared.arrow import list_parts, make_list


def concat_prompt_output(
    prompt_ids: pa.Array | pa.ChunkedArray, output_ids: pa.Array | pa.ChunkedArray
) -> tuple[pa.ListArray, pa.ListArray, np.ndarray, np.ndarray]:
    """Row-wise prompt ++ output and its loss mask (0 on prompt, 1 on output).

    Returns (input_ids list<int32>, loss_mask list<int8>, n_prompt int64[], n_tokens int64[]).
    The mask is built first by repeating a 0,1,0,1... pattern with the interleaved prompt/output lengths;
    that same mask then routes the prompt values and output values into their slots, so no per-row loop
    and no position arithmetic arrays of token size are needed.
    """
    plen, pv = list_parts(prompt_ids, pa.int32())
    olen, ov = list_parts(output_ids, pa.int32())
    if len(plen) != len(olen):
        raise ValueError("prompt_ids and output_ids differ in row count")
    n = len(plen)
    seg = np.empty(2 * n, dtype=np.int64)
    seg[0::2] = plen
    seg[1::2] = olen
    mask = np.repeat(np.tile(np.array([0, 1], dtype=np.int8), n), seg)
    is_output = mask.view(np.bool_)
    ids = np.empty(len(mask), dtype=np.int32)
    ids[~is_output] = pv
    ids[is_output] = ov
    n_tokens = plen + olen
    return make_list(n_tokens, ids, pa.int32()), make_list(n_tokens, mask, pa.int8()), plen, n_tokens


# Tokens summed per block: the block's int64 copy of the mask stays at 8 MB (of the whole mask it was 8x its bytes:
# 840 MB for a 105M-token merge, the merge's largest cost in the seed rehearsal).
_SUM_BLOCK_TOKENS = 1 << 20


def supervised_per_row(loss_mask: pa.Array | pa.ChunkedArray, n_tokens: np.ndarray) -> np.ndarray:
    """Supervised tokens of each row: the 1s of its loss mask (int64 per row, `n_tokens` its row lengths)."""
    _, values = list_parts(loss_mask, pa.int8())
    lengths = np.asarray(n_tokens, dtype=np.int64)
    out = np.zeros(len(lengths), dtype=np.int64)
    if not len(values):
        return out
    ends = np.cumsum(lengths)
    starts = ends - lengths
    r, n = 0, len(lengths)
    while r < n:
        stop = max(int(np.searchsorted(ends, starts[r] + _SUM_BLOCK_TOKENS, side="right")), r + 1)
        a, b = int(starts[r]), int(ends[stop - 1])
        nonempty = lengths[r:stop] > 0
        if b > a:
            # Each nonempty row's sum runs to the next nonempty row's start: the empty rows between hold nothing.
            out[r:stop][nonempty] = np.add.reduceat(values[a:b].astype(np.int64), starts[r:stop][nonempty] - a)
        r = stop
    return out


def row_of_position(lengths: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Row index of each flat value position, given row lengths."""
    ends = np.cumsum(lengths)
    return np.searchsorted(ends, positions, side="right")


def hash_u64(values: pa.Array | pa.ChunkedArray | list[str], salt: str) -> np.ndarray:
    """Seeded 64-bit hash of each string (blake2b keyed by `salt`): stable across runs, platforms and row order.

    Per-id Python, but over sample ids (one per row, tens of thousands), never over tokens.
    """
    items = values.to_pylist() if isinstance(values, (pa.Array, pa.ChunkedArray)) else values
    key = hashlib.sha256(salt.encode()).digest()[:32]
    out = np.empty(len(items), dtype=np.uint64)
    for i, s in enumerate(items):
        out[i] = int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8, key=key).digest(), "little")
    return out


def unit_interval(h: np.ndarray) -> np.ndarray:
    """Map uint64 hashes to [0, 1) using the top 53 bits (exact in float64)."""
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
