"""A 64-bit text hash that can be computed from the text and, without decoding, from token ids.

`text_hash(data) = sum(R[data[i]] * B**i) mod 2**64`, with R a fixed table of 256 odd 64-bit values and B a fixed odd
multiplier. It is additive over concatenation, `hash(a + b) = hash(a) + B**len(a) * hash(b)`, so a token's bytes can be
hashed once per vocabulary and a row of ids hashed with a few numpy passes (`ids_text_hashes`). The reconstruction
records the hash of the source text; the `text_agreement` audit gate recomputes it from the ids.

Not cryptographic: it detects accidental corruption (an id off by one, a shifted vocabulary, rows mixed up), where two
different texts collide with probability about 2**-64, not a forger.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from typing import Any

import numpy as np

B = 0x9E3779B97F4A7C15  # odd, so B**n is invertible mod 2**64
# Derived from sha256 so the table never depends on a random generator's version.
R = np.array(
    [int.from_bytes(hashlib.sha256(b"eagle-text-hash:%d" % i).digest()[:8], "little") | 1 for i in range(256)],
    dtype=np.uint64,
)
_B64 = np.uint64(B)
# Rows are hashed in groups of about this many tokens: the working arrays stay in cache, which doubles the speed.
_CHUNK_TOKENS = 1 << 16

_powers = np.ones(1, dtype=np.uint64)  # B**0 .. B**(n-1), grown on demand
_powers_lock = threading.Lock()


def _power_table(n: int) -> np.ndarray:
    global _powers
    if _powers.size < n:
        with _powers_lock:
            if _powers.size < n:
                size = max(n, 2 * _powers.size)
                grown = np.empty(size, dtype=np.uint64)
                grown[0] = 1
                with np.errstate(over="ignore"):
                    grown[1:] = np.multiply.accumulate(np.full(size - 1, _B64, dtype=np.uint64))
                _powers = grown
    return _powers[:n]


def text_hash(data: bytes) -> int:
    """The hash of `data` as a Python int in [0, 2**64)."""
    b = np.frombuffer(data, dtype=np.uint8)
    with np.errstate(over="ignore"):
        return int(np.dot(R[b], _power_table(b.size)))


def as_int64(h: int) -> int:
    """The hash's bit pattern as a signed int64 (how Parquet stores it)."""
    return h - (1 << 64) if h >= 1 << 63 else h


class TokenHashTable:
    """Per id, the text_hash of the token's bytes (specials as their strings) and B**len, side by side in `pairs`
    (one lookup fetches one cache line); built once per tokenizer.

    `decodable[i]` is False for ids the tokenizer cannot decode (they hash as empty text)."""

    def __init__(self, tokenizer: Any) -> None:
        vocab = int(tokenizer.vocab_size)
        pieces: list[bytes] = []
        decodable = np.ones(vocab, dtype=bool)
        for i in range(vocab):
            try:
                pieces.append(tokenizer.decode_bytes([i]))
            except Exception:  # an unassigned slot: such ids cannot be the text, ids_in_vocab names them
                pieces.append(b"")
                decodable[i] = False
        lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=vocab)
        flat = np.frombuffer(b"".join(pieces), dtype=np.uint8)
        starts = np.cumsum(lengths) - lengths
        owner = np.repeat(np.arange(vocab), lengths)
        powers = _power_table(int(lengths.max(initial=0)) + 1)
        self.pairs = np.zeros((vocab, 2), dtype=np.uint64)  # (hash of the token's bytes, B**len)
        self.pairs[:, 1] = powers[lengths]
        nonempty = lengths > 0
        if flat.size:
            with np.errstate(over="ignore"):
                weighted = R[flat] * powers[np.arange(flat.size) - starts[owner]]  # as text_hash, per token
                self.pairs[nonempty, 0] = np.add.reduceat(weighted, starts[nonempty])
        self.decodable = decodable
        self.vocab_size = vocab


_tables: weakref.WeakKeyDictionary[Any, TokenHashTable] = weakref.WeakKeyDictionary()
_tables_lock = threading.Lock()


def token_hash_table(tokenizer: Any) -> TokenHashTable:
    """The (cached) TokenHashTable of `tokenizer`."""
    with _tables_lock:
        table = _tables.get(tokenizer)
        if table is None:
            table = _tables[tokenizer] = TokenHashTable(tokenizer)
        return table


def _inverse(a: np.ndarray) -> np.ndarray:
    # Newton's iteration for the inverse of odd numbers mod 2**64: each step doubles the correct low bits (3 -> 96).
    x = a.copy()
    with np.errstate(over="ignore"):
        for _ in range(5):
            x *= np.uint64(2) - a * x
    return x


def _hash_rows(values: np.ndarray, offsets: np.ndarray, table: TokenHashTable) -> np.ndarray:
    with np.errstate(over="ignore"):
        both = np.take(table.pairs, values, axis=0)
        h = both[:, 0]
        running = np.multiply.accumulate(both[:, 1])  # B**(bytes up to and including token k)
        h[1:] *= running[:-1]  # each token's hash shifted by the bytes before it
        starts = offsets[:-1]
        sums = np.zeros(starts.size, dtype=np.uint64)  # an empty row hashes as empty text: 0
        nonempty = offsets[1:] > starts
        if nonempty.any():
            sums[nonempty] = np.add.reduceat(h, starts[nonempty])
        before = np.ones(starts.size, dtype=np.uint64)
        inner = starts > 0
        before[inner] = running[starts[inner] - 1]
        return sums * _inverse(before)  # rebase each row to its own first byte


def ids_text_hashes(values: np.ndarray, offsets: np.ndarray, table: TokenHashTable) -> np.ndarray:
    """text_hash(decode_bytes(row)) for every row of a flat id buffer (offsets: row i is values[offsets[i]:offsets[i+1]]).

    Every id must be in [0, table.vocab_size). Works in groups of rows of about _CHUNK_TOKENS tokens."""
    offsets = np.asarray(offsets, dtype=np.int64)
    n = offsets.size - 1
    out = np.zeros(max(n, 0), dtype=np.uint64)
    r = 0
    while r < n:
        stop = int(np.searchsorted(offsets, offsets[r] + _CHUNK_TOKENS, side="right")) - 1
        stop = min(max(stop, r + 1), n)
        a, b = int(offsets[r]), int(offsets[stop])
        out[r:stop] = _hash_rows(values[a:b], offsets[r : stop + 1] - a, table)
        r = stop
    return out


def text_hash_int64(data: bytes | str) -> int:
    """text_hash of `data` (str: its UTF-8) as the int64 stored in `output_text_hash`."""
    return as_int64(text_hash(data.encode("utf-8") if isinstance(data, str) else data))
