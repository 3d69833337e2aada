"""Arrow schemas of the responses and errors tables (docs/architecture.md), and column buffers for them."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

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
ERROR_COLUMNS: tuple[str, ...] = tuple(ERRORS_SCHEMA.names)


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


def empty_table(schema: pa.Schema) -> pa.Table:
    return schema.empty_table()
