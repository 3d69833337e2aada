"""Rows of the responses and errors tables: their Arrow schemas (docs/architecture.md), the one builder of each row
kind, and the column buffers rows are collected in before a commit.

Every producer of a responses row (the live runner, the importer, the CLI's `reconstruct`) goes through
`response_values`, and every producer of an errors row through `error_row`, so a column added to a schema is
filled in one place.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from eagle_pipeline.generation.backends.wire import ParsedResponse, PromptItem
from eagle_pipeline.shared.failures import truncate

_TS = pa.timestamp("us", tz="UTC")

RESPONSES_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("messages_json", pa.string()),
        ("tools_json", pa.string()),
        ("source", pa.string()),
        ("backend", pa.string()),
        ("endpoint", pa.string()),
        ("model", pa.string()),
        ("provider", pa.string()),
        ("quantization", pa.string()),
        ("reasoning", pa.string()),
        ("content", pa.string()),
        ("tool_calls_json", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("output_token_ids", pa.list_(pa.int32())),
        ("finish_reason", pa.string()),
        ("native_finish_reason", pa.string()),
        ("usage_prompt_tokens", pa.int64()),
        ("usage_completion_tokens", pa.int64()),
        ("usage_reasoning_tokens", pa.int64()),
        ("cost_usd", pa.float64()),
        ("generation_id", pa.string()),
        ("sampling_json", pa.string()),
        ("thinking", pa.bool_()),
        ("latency_s", pa.float64()),
        ("attempts", pa.int32()),
        ("started_at", _TS),
        ("finished_at", _TS),
        ("raw_response_json", pa.string()),
        ("stream_chunks", pa.int32()),
        ("stream_keepalives", pa.int32()),
        # Regenerated conversations (`regenerate: all_turns`); null for a `last_turn` row and in older shards.
        ("conversation_id", pa.string()),
        ("turn_index", pa.int32()),
        ("conversation_end", pa.string()),
        # What served the row (generation/store/identity.py): a row counts for a dataset only while this matches its
        # backend.
        ("backend_identity", pa.string()),
    ]
)

ERRORS_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("backend", pa.string()),
        ("error_class", pa.string()),
        ("http_status", pa.int32()),
        ("message", pa.string()),
        ("attempts", pa.int32()),
        ("at", _TS),
    ]
)

RESPONSE_COLUMNS: tuple[str, ...] = tuple(RESPONSES_SCHEMA.names)

# Longest error message stored; a whole HTML error page would bloat the errors table.
MAX_ERROR_MESSAGE = 1000


def now_us() -> int:
    """Wall clock in integer microseconds since the epoch (what the timestamp columns hold)."""
    return time.time_ns() // 1000


@dataclass(frozen=True)
class RowProvenance:
    """The columns of a responses row that a run fixes for all its rows (where the rows come from, under what settings).

    `model` is the fallback when a response names no served model.
    """

    dataset: str
    source: str
    backend: str
    endpoint: str | None
    model: str | None
    quantization: str | None
    sampling_json: str
    thinking: bool
    identity: str | None = None  # `BackendIdentity.to_json()`; None: rows outside a dataset's store (CLI files)


def response_values(
    prov: RowProvenance,
    item: PromptItem,
    p: ParsedResponse,
    *,
    latency_s: float,
    attempts: int,
    started_us: int,
    finished_us: int,
    raw_response_json: str | None,
    conversation_end: str | None = None,
) -> tuple[Any, ...]:
    """The one `ParsedResponse -> responses row` builder: the row's values in RESPONSES_SCHEMA order.

    A turn of a regenerated conversation carries its conversation and turn index (from `item`) and, on the
    conversation's last generated turn, why it ended (`conversation_end`, generation/plan/turns.py).

    A tuple rather than a dict: the live runner builds thousands per second (`ColumnBuffer.append_values`); callers
    that want a mapping use `dict(zip(RESPONSE_COLUMNS, values))`.
    """
    return (
        item.sample_id,
        prov.dataset,
        item.messages_json,
        item.tools_json,
        prov.source,
        prov.backend,
        prov.endpoint,
        p.model or prov.model,
        p.provider,
        prov.quantization,
        p.reasoning,
        p.content,
        p.tool_calls_json,
        p.prompt_token_ids,
        p.output_token_ids,
        p.finish_reason,
        p.native_finish_reason,
        p.usage_prompt_tokens,
        p.usage_completion_tokens,
        p.usage_reasoning_tokens,
        p.cost_usd,
        p.generation_id,
        prov.sampling_json,
        prov.thinking,
        latency_s,
        attempts,
        started_us,
        finished_us,
        raw_response_json,
        p.stream_chunks,
        p.stream_keepalives,
        item.conversation_id,
        item.turn_index,
        conversation_end,
        prov.identity,
    )


def error_row(
    *,
    sample_id: str | None,
    dataset: str,
    backend: str,
    error_class: str,
    http_status: int | None,
    message: str,
    attempts: int,
    redact: Callable[[str | None], str | None] | None = None,
) -> dict[str, Any]:
    """The one builder of an errors-table row; the message is truncated, then passed through `redact` if given."""
    text: str | None = truncate(message, MAX_ERROR_MESSAGE)
    return {
        "sample_id": sample_id,
        "dataset": dataset,
        "backend": backend,
        "error_class": error_class,
        "http_status": http_status,
        "message": redact(text) if redact is not None else text,
        "attempts": attempts,
        "at": now_us(),
    }


class ColumnBuffer:
    """Rows accumulated column-wise (cheap appends; one Arrow conversion per commit).

    Timestamp columns hold integer microseconds since the epoch, which Arrow takes directly.
    """

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        self._names = schema.names
        self.cols: dict[str, list[Any]] = {n: [] for n in self._names}
        self._lists = [self.cols[n] for n in self._names]
        self.sample_ids: list[str] = self.cols["sample_id"]

    def __len__(self) -> int:
        return len(self.sample_ids)

    def append(self, row: dict[str, Any]) -> None:
        cols = self.cols
        for n in self._names:
            cols[n].append(row.get(n))

    def append_values(self, values: tuple[Any, ...]) -> None:
        """Append one row given as values in schema order (the hot path: no per-row dict)."""
        for col, v in zip(self._lists, values):
            col.append(v)

    def take(self) -> pa.Table | None:
        """Return the buffered rows as a table and start a fresh buffer (None when empty)."""
        if not self.sample_ids:
            return None
        table = pa.table(self.cols, schema=self.schema)
        self.cols = {n: [] for n in self._names}
        self._lists = [self.cols[n] for n in self._names]
        self.sample_ids = self.cols["sample_id"]
        return table
