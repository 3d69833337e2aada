"""Numpy views of a token-samples table, built once per audit and shared by every gate.

The per-token work is one pass over the flat `output_ids` buffer that keeps only the positions of ids at or above
the lowest special id (or outside the vocabulary). Special ids are rare, so every gate then works on that short
"event" list and on per-row arrays; nothing loops over tokens in Python.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from eagle_pipeline.tokens.tokenizer import EncodingMemo

# Token classes: the codes of the lookup table that classifies event ids.
ORDINARY = 0
THINK_OPEN = 1
THINK_CLOSE = 2
EOT = 3
SECTION_BEGIN = 4
SECTION_END = 5
CALL_BEGIN = 6
CALL_END = 7
ARG_BEGIN = 8
STRUCTURAL = 9  # another id of the profile's structural set: legal in outputs
FOREIGN = 10  # a named special id that never belongs in a model output ([PAD], <|im_user|>, ...)
RESERVED = 11  # a reserved / unnamed special slot
OUT_OF_RANGE = 12  # id < 0 or id >= vocab_size

TOOL_CODES = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_END, ARG_BEGIN)
# text_hash (int64 bit pattern) of the bytes a row's output ids must decode to, recorded by the reconstruction
# (null: unknown).
TEXT_DIGEST_COLUMN = "output_text_hash"
# Rows whose prompt ids came from the server: where they first differ from the project's render (-1: nowhere; null:
# not compared), and that render where it differs (tokens/samples.RENDER_FIELDS).
RENDER_DIFF_COLUMN = "prompt_render_diff"
RENDERED_PROMPT_COLUMN = "rendered_prompt_ids"
ORIGINS = ("reconstructed", "returned")

# Finish reasons of a generation that ended on its own; anything else (length, error, abort, content_filter,
# null, unknown) means the output may be cut short.
COMPLETE_FINISH_REASONS = frozenset({"stop", "tool_calls", "function_call", "eos", "end_turn"})

_RESERVED_NAME = re.compile(r"^<\|reserved(_special)?_token_\d+\|>$")

# 16M tokens per block keeps the temporary mask at 16 MB, so the scan stays cache- and memory-friendly.
_SCAN_BLOCK = 1 << 24

_PROFILE_FIELDS = (
    ("think_open_id", THINK_OPEN),
    ("think_close_id", THINK_CLOSE),
    ("eot_id", EOT),
    ("tool_section_begin_id", SECTION_BEGIN),
    ("tool_section_end_id", SECTION_END),
    ("tool_call_begin_id", CALL_BEGIN),
    ("tool_call_end_id", CALL_END),
    ("tool_arg_begin_id", ARG_BEGIN),
)


class AuditInputError(ValueError):
    """The table handed to the audit does not follow the token-samples contract."""


def _opt_id(profile_ids: Any, attr: str) -> int | None:
    value = getattr(profile_ids, attr, None)
    return None if value is None else int(value)


@dataclass(frozen=True)
class TokenClasses:
    """How each id of one tokenizer + profile is classified, and the threshold below which every id is ordinary."""

    lut: np.ndarray  # int8 code per id in [0, vocab_size)
    threshold: int  # every id in [0, threshold) is ordinary
    vocab_size: int
    names: dict[int, str]  # special id -> its string, for excerpts
    ids: dict[int, int | None]  # code -> profile id (THINK_OPEN..ARG_BEGIN)


def build_token_classes(tokenizer: Any, profile_ids: Any) -> TokenClasses:
    vocab_size = int(tokenizer.vocab_size)
    specials: dict[str, int] = {str(k): int(v) for k, v in dict(tokenizer.special_tokens).items()}
    names = {v: k for k, v in specials.items()}
    lut = np.zeros(vocab_size, dtype=np.int8)
    ids: dict[int, int | None] = {}
    profile_set: set[int] = set()
    for attr, code in _PROFILE_FIELDS:
        found = ids[code] = _opt_id(profile_ids, attr)
        if found is not None:
            profile_set.add(found)
    structural = {int(x) for x in (getattr(profile_ids, "structural_ids", None) or ())}
    low = min([*specials.values(), *profile_set, *structural, vocab_size])
    # Ids between the lowest special and vocab_size that have no name are unassigned slots: as bad as reserved.
    lut[low:] = RESERVED
    for name, i in specials.items():
        if 0 <= i < vocab_size:
            lut[i] = RESERVED if _RESERVED_NAME.match(name) else FOREIGN
    for i in structural:
        if 0 <= i < vocab_size:
            lut[i] = STRUCTURAL
    for _attr, code in _PROFILE_FIELDS:
        pid = ids[code]
        if pid is not None and 0 <= pid < vocab_size:
            lut[pid] = code
    return TokenClasses(lut=lut, threshold=low, vocab_size=vocab_size, names=names, ids=ids)


def _column(table: pa.Table, name: str) -> pa.Array:
    if name not in table.column_names:
        raise AuditInputError(f"token-samples table has no column {name!r} (columns: {', '.join(table.column_names)})")
    col = table.column(name)
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _bool_column(table: pa.Table, name: str) -> np.ndarray:
    col = _column(table, name)
    if col.null_count:
        raise AuditInputError(f"column {name!r} has {col.null_count} null value(s); the contract says it is never null")
    return np.asarray(col.to_numpy(zero_copy_only=False), dtype=bool)


class AuditContext:
    """Everything the gates need from one table, computed lazily and at most once."""

    def __init__(self, table: pa.Table, tokenizer: Any, profile_ids: Any, memo: EncodingMemo | None = None) -> None:
        self.table = table
        self.tokenizer = tokenizer
        self.profile_ids = profile_ids
        self.memo = memo
        self.n = table.num_rows
        self.classes = build_token_classes(tokenizer, profile_ids)

    # -- token buffers ------------------------------------------------------------------------------------------
    @cached_property
    def _flat(self) -> tuple[np.ndarray, np.ndarray]:
        arr = _column(self.table, "output_ids")
        if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
            raise AuditInputError(f"column 'output_ids' must be a list of integers, got {arr.type}")
        if not pa.types.is_integer(arr.type.value_type):
            raise AuditInputError(f"column 'output_ids' must hold integers, got {arr.type}")
        if arr.null_count:
            # A null output is treated as empty: the completion gates then flag it.
            arr = pc.fill_null(arr, pa.scalar([], arr.type))
        offs = np.asarray(arr.offsets, dtype=np.int64)
        values = arr.values
        if values.null_count:
            raise AuditInputError(f"column 'output_ids' holds {values.null_count} null id(s) inside its lists")
        # `.values` ignores the array's slice offset; rebase so offsets index a buffer of exactly these rows.
        start, stop = int(offs[0]), int(offs[-1])
        vals = values.slice(start, stop - start).to_numpy(zero_copy_only=False)
        if vals.dtype != np.int32 and vals.dtype != np.int64:
            vals = vals.astype(np.int64)
        return offs - start, vals

    @property
    def offsets(self) -> np.ndarray:
        return self._flat[0]

    @property
    def values(self) -> np.ndarray:
        return self._flat[1]

    @cached_property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1]) if self.n else 0

    @cached_property
    def _events(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pos, code, row) of every non-ordinary token, in buffer order."""
        vals = self.values
        # Viewing signed ids as unsigned maps negatives to huge values, so one compare catches both ends.
        unsigned: np.ndarray = vals.view(np.uint32 if vals.dtype == np.int32 else np.uint64)
        thr = self.classes.threshold
        found = []
        for start in range(0, unsigned.size, _SCAN_BLOCK):
            hit = np.flatnonzero(unsigned[start : start + _SCAN_BLOCK] >= thr)
            if hit.size:
                found.append(hit + start)
        pos = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        tok = vals[pos].astype(np.int64)
        in_range = (tok >= 0) & (tok < self.classes.vocab_size)
        code = np.full(tok.shape, OUT_OF_RANGE, dtype=np.int8)
        code[in_range] = self.classes.lut[tok[in_range]]
        keep = code != ORDINARY
        pos, code = pos[keep], code[keep]
        row = np.searchsorted(self.offsets, pos, side="right") - 1
        return pos, code, row

    @property
    def ev_pos(self) -> np.ndarray:
        return self._events[0]

    @property
    def ev_code(self) -> np.ndarray:
        return self._events[1]

    @property
    def ev_row(self) -> np.ndarray:
        return self._events[2]

    @cached_property
    def ev_row_offsets(self) -> np.ndarray:
        """Events of row i are ev_*[ev_row_offsets[i]:ev_row_offsets[i+1]]."""
        return np.searchsorted(self.ev_row, np.arange(self.n + 1), side="left")

    def count(self, code: int) -> np.ndarray:
        return np.bincount(self.ev_row[self.ev_code == code], minlength=self.n)

    def first_pos(self, code: int) -> np.ndarray:
        """Position (within its row) of the first `code` token of each row; -1 where the row has none."""
        return self._extreme_pos(code, first=True)

    def last_pos(self, code: int) -> np.ndarray:
        return self._extreme_pos(code, first=False)

    def first_pos_where(self, sel: np.ndarray) -> np.ndarray:
        """Position (within its row) of the first selected event of each row; -1 where none is selected."""
        return self._extreme_pos(sel, first=True)

    def _extreme_pos(self, code: int | np.ndarray, *, first: bool) -> np.ndarray:
        out = np.full(self.n, -1, dtype=np.int64)
        sel = self.ev_code == code if isinstance(code, int) else code
        rows, pos = self.ev_row[sel], self.ev_pos[sel]
        if rows.size:
            # Events are sorted by buffer position, hence by row: the first/last of each run of equal rows.
            if first:
                edge = np.concatenate(([True], rows[1:] != rows[:-1]))
            else:
                edge = np.concatenate((rows[1:] != rows[:-1], [True]))
            out[rows[edge]] = pos[edge] - self.offsets[rows[edge]]
        return out

    # -- per-row columns ----------------------------------------------------------------------------------------
    @cached_property
    def thinking(self) -> np.ndarray:
        return _bool_column(self.table, "thinking")

    @cached_property
    def has_tools(self) -> np.ndarray:
        return _bool_column(self.table, "dataset_has_tools")

    def finish_reasons(self, rows: np.ndarray) -> list[str | None]:
        return _column(self.table, "finish_reason").take(pa.array(np.asarray(rows, dtype=np.int64))).to_pylist()

    @cached_property
    def complete(self) -> np.ndarray:
        """Rows whose generation ended on its own (see COMPLETE_FINISH_REASONS)."""
        col = _column(self.table, "finish_reason")
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type) or pa.types.is_null(col.type)):
            raise AuditInputError(f"column 'finish_reason' must be a string column, got {col.type}")
        if pa.types.is_null(col.type):
            return np.zeros(self.n, dtype=bool)
        ok = pc.is_in(col, value_set=pa.array(sorted(COMPLETE_FINISH_REASONS)))
        return np.asarray(pc.fill_null(ok, False).to_numpy(zero_copy_only=False), dtype=bool)

    @cached_property
    def origin(self) -> np.ndarray:
        """0 for 'reconstructed', 1 for 'returned'."""
        col = _column(self.table, "ids_origin")
        if col.null_count:
            raise AuditInputError(f"column 'ids_origin' has {col.null_count} null value(s)")
        codes = pc.index_in(col, value_set=pa.array(ORIGINS))
        if codes.null_count:
            bad = sorted({v for v in col.filter(pc.is_null(codes)).to_pylist()})
            raise AuditInputError(f"column 'ids_origin' holds {bad}; allowed: {list(ORIGINS)}")
        return np.asarray(codes.to_numpy(zero_copy_only=False), dtype=np.int8)

    @cached_property
    def usage(self) -> tuple[np.ndarray, np.ndarray]:
        """(usage_completion_tokens as int64 with 0 for null, valid mask)."""
        col = _column(self.table, "usage_completion_tokens")
        valid = np.asarray(pc.is_valid(col).to_numpy(zero_copy_only=False), dtype=bool)
        vals = np.asarray(pc.fill_null(col, 0).to_numpy(zero_copy_only=False), dtype=np.int64)
        return vals, valid

    @cached_property
    def prompt_usage(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(len(prompt_ids), usage_prompt_tokens with 0 for null, checkable mask) or None without those columns.

        Checkable: the provider reported a prompt count and the row has prompt ids (an empty list means the prompt
        is unknown, e.g. a CLI line without messages)."""
        if "usage_prompt_tokens" not in self.table.column_names or "prompt_ids" not in self.table.column_names:
            return None
        ids = _column(self.table, "prompt_ids")
        if not (pa.types.is_list(ids.type) or pa.types.is_large_list(ids.type)):
            raise AuditInputError(f"column 'prompt_ids' must be a list of integers, got {ids.type}")
        lengths = np.asarray(pc.fill_null(pc.list_value_length(ids), 0).to_numpy(zero_copy_only=False), dtype=np.int64)
        col = _column(self.table, "usage_prompt_tokens")
        if pa.types.is_null(col.type):
            return lengths, np.zeros(self.n, dtype=np.int64), np.zeros(self.n, dtype=bool)
        if not pa.types.is_integer(col.type):
            raise AuditInputError(f"column 'usage_prompt_tokens' must hold integers, got {col.type}")
        valid = np.asarray(pc.is_valid(col).to_numpy(zero_copy_only=False), dtype=bool)
        usage = np.asarray(pc.fill_null(col, 0).to_numpy(zero_copy_only=False), dtype=np.int64)
        return lengths, usage, valid & (lengths > 0)

    @cached_property
    def prompt_render(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(compared mask, first position where the server's prompt ids differ from the project's render, -1 where
        they agree) or None without the column (no row's prompt ids came from a server, or an older file)."""
        if RENDER_DIFF_COLUMN not in self.table.column_names:
            return None
        col = _column(self.table, RENDER_DIFF_COLUMN)
        if pa.types.is_null(col.type):
            return np.zeros(self.n, dtype=bool), np.full(self.n, -1, dtype=np.int64)
        if not pa.types.is_integer(col.type):
            raise AuditInputError(f"column {RENDER_DIFF_COLUMN!r} must hold integers, got {col.type}")
        compared = np.asarray(pc.is_valid(col).to_numpy(zero_copy_only=False), dtype=bool)
        return compared, np.asarray(pc.fill_null(col, -1).to_numpy(zero_copy_only=False), dtype=np.int64)

    @cached_property
    def text_digests(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(valid mask, `output_text_hash` as uint64 with 0 for null) or None without that column (older files)."""
        if TEXT_DIGEST_COLUMN not in self.table.column_names:
            return None
        col = _column(self.table, TEXT_DIGEST_COLUMN)
        if pa.types.is_null(col.type):
            return np.zeros(self.n, dtype=bool), np.zeros(self.n, dtype=np.uint64)
        if col.type != pa.int64():
            raise AuditInputError(
                f"column {TEXT_DIGEST_COLUMN!r} must be int64 (the hash's bit pattern), got {col.type}"
            )
        valid = np.asarray(pc.is_valid(col).to_numpy(zero_copy_only=False), dtype=bool)
        hashes = np.asarray(pc.fill_null(col, 0).to_numpy(zero_copy_only=False), dtype=np.int64).view(np.uint64)
        return valid, hashes

    @cached_property
    def n_tool_calls(self) -> np.ndarray | None:
        if "n_tool_calls" not in self.table.column_names:
            return None
        col = _column(self.table, "n_tool_calls")
        return np.asarray(pc.fill_null(col, -1).to_numpy(zero_copy_only=False), dtype=np.int64)

    @cached_property
    def sources(self) -> tuple[np.ndarray, list[str]]:
        """Per-row code of 'backend/provider' and the list of keys; '-' stands for a missing value."""
        parts = []
        for name in ("backend", "provider"):
            if name in self.table.column_names:
                col = _column(self.table, name).cast(pa.string())
                parts.append(pc.fill_null(col, "-"))
            else:
                parts.append(pa.array(["-"] * self.n, pa.string()))
        joined = pc.binary_join_element_wise(parts[0], parts[1], "/")
        enc = joined.dictionary_encode()
        return np.asarray(enc.indices.to_numpy(zero_copy_only=False), dtype=np.int64), enc.dictionary.to_pylist()

    def sample_ids(self, rows: np.ndarray) -> list[str]:
        if "sample_id" not in self.table.column_names:
            return [f"row:{int(r)}" for r in rows]
        col = self.table.column("sample_id")
        return [str(x) for x in col.take(pa.array(np.asarray(rows, dtype=np.int64))).to_pylist()]

    def encode_ordinary_arrays(self, texts: list[str]) -> list[np.ndarray]:
        """The tokenizer's ordinary encoding of `texts`; a text the memo holds (reconstruction encoded it in this
        step) is taken from there, which is the same ids (see EncodingMemo)."""
        if self.memo is None:
            return self.tokenizer.encode_ordinary_arrays(texts)
        return self.memo.encode_ordinary_arrays(self.tokenizer, texts)

    # -- decoding -------------------------------------------------------------------------------------------------
    def prompt_ids(self, row: int) -> list[int]:
        return _column(self.table, "prompt_ids")[row].as_py() or []

    def rendered_prompt_ids(self, row: int) -> list[int]:
        """The project's render of a row's prompt where it differs from the server's ([] when not stored)."""
        if RENDERED_PROMPT_COLUMN not in self.table.column_names:
            return []
        return _column(self.table, RENDERED_PROMPT_COLUMN)[row].as_py() or []

    def row_ids(self, row: int) -> np.ndarray:
        return self.values[self.offsets[row] : self.offsets[row + 1]]

    def render(self, ids: np.ndarray | list[int]) -> str:
        """Human-readable text of ids: special ids by name, out-of-vocabulary ids as <?id>, invalid UTF-8 replaced."""
        out: list[str] = []
        run: list[int] = []
        lut, vocab = self.classes.lut, self.classes.vocab_size

        def flush() -> None:
            if run:
                out.append(self.tokenizer.decode_bytes(run).decode("utf-8", errors="replace"))
                run.clear()

        for t in (int(x) for x in ids):
            if 0 <= t < vocab and lut[t] == ORDINARY:
                run.append(t)
                continue
            flush()
            out.append(self.classes.names.get(t, f"<?{t}>"))
        flush()
        return "".join(out)

    def excerpt(self, row: int, pos: int, width: int) -> str:
        """A short decoded window of `row` around position `pos`, the token at `pos` marked with ⟦ ⟧."""
        ids = self.row_ids(row)
        if ids.size == 0:
            return "(empty output)"
        return self.window(ids, min(int(pos), ids.size - 1), width)

    def window(self, ids: np.ndarray | list[int], pos: int, width: int) -> str:
        """A decoded window of `ids` around position `pos` (clamped to them), the token at `pos` marked with ⟦ ⟧;
        a position at the end marks an empty ⟦⟧."""
        ids = np.asarray(ids)
        pos = min(max(int(pos), 0), ids.size)
        half = max(width // 2, 1)
        lo, hi = max(pos - half, 0), min(pos + half + 1, ids.size)
        text = (
            ("…" if lo > 0 else "")
            + self.render(ids[lo:pos])
            + "⟦"
            + self.render(ids[pos : pos + 1])
            + "⟧"
            + self.render(ids[pos + 1 : hi])
            + ("…" if hi < ids.size else "")
        )
        return text
