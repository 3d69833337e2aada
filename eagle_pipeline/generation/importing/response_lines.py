"""Answers made elsewhere, one JSON record a line: the one reader of a record's chat-completion body and the one
builder of its responses row, for the import backend (`importer`: records matched to a dataset's prompts) and the
command line's `reconstruct` input (`read_response_lines`: records that name their own sample ids). A record is
`{"sample_id"?, "source_id"?, "messages"?, "tools"?, ..., "response": <chat-completion body, or its JSON text>}`, or a
chat-completion body itself carrying those keys beside `choices`. Every body is parsed by `parse_completion_body` (as
the client parses a live one) and every row built by the one row builder (`generation.store.rows.response_values`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pyarrow as pa

from eagle_pipeline.generation.backends.wire import ParsedResponse, PromptItem, parse_chat_completion
from eagle_pipeline.generation.spec import BackendSpec
from eagle_pipeline.generation.store.rows import RESPONSE_COLUMNS, RESPONSES_SCHEMA, RowProvenance, response_values
from eagle_pipeline.shared.failures import RequestFailure
from eagle_pipeline.shared.storage import iter_jsonl_objects
from eagle_pipeline.tokens.samples import RECONSTRUCTION_COLUMNS


def parse_completion_body(body: Any, spec: BackendSpec | None = None) -> ParsedResponse:
    """A chat-completion body written by an earlier run, parsed as the client parses a live one (HTTP 200); the
    token ids of a vLLM body are kept when its first choice has them. Raises RequestFailure for an unusable body."""
    choices = body.get("choices") if isinstance(body, dict) else None
    want_ids = (
        isinstance(choices, list) and bool(choices) and isinstance(choices[0], dict) and "token_ids" in choices[0]
    )
    return parse_chat_completion(body, 200, want_ids=want_ids, spec=spec)


# A bare body's keys that name its prompt, not part of the answer.
PROMPT_KEYS = ("sample_id", "source_id", "messages", "tools")


def record_body(rec: dict[str, Any]) -> dict[str, Any]:
    """The chat-completion body of one record: its `response` (an object, or that object as JSON text), or else the
    record itself less the keys that name its prompt. Raises ValueError for a `response` that is no body."""
    if "response" not in rec:
        return {k: v for k, v in rec.items() if k not in PROMPT_KEYS}
    body = rec["response"]
    if isinstance(body, str):  # the body exactly as returned, as text
        try:
            body = json.loads(body)
        except json.JSONDecodeError as exc:
            raise ValueError(f"'response' is a string but not JSON ({exc.msg})") from None
    if not isinstance(body, dict):
        raise ValueError("'response' must be the chat-completion body (an object)")
    return body


def completion_row(
    prov: RowProvenance,
    item: PromptItem,
    parsed: ParsedResponse,
    *,
    latency_s: float,
    at_us: int,
    raw_response_json: str | None,
) -> dict[str, Any]:
    """The responses row of an answer read from a file: no request was made by this pipeline (`attempts` 0), and the
    answer is dated `at_us` (started and finished)."""
    values = response_values(
        prov,
        item,
        parsed,
        latency_s=latency_s,
        attempts=0,
        started_us=at_us,
        finished_us=at_us,
        raw_response_json=raw_response_json,
    )
    return dict(zip(RESPONSE_COLUMNS, values))


class ResponseLinesError(ValueError):
    """A line of a responses file that cannot be used; the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class _Line:
    """One line's fields, validated."""

    body: dict[str, Any]
    dataset: str
    tools: list | bool | None
    thinking: bool
    messages: list | None


def _line_fields(where: str, rec: dict[str, Any], default_dataset: str) -> _Line:
    try:
        body = record_body(rec)
    except ValueError as exc:
        raise ResponseLinesError(f"{where}: {exc}") from None
    dataset = rec.get("dataset", default_dataset)
    if not isinstance(dataset, str) or not dataset:
        raise ResponseLinesError(f"{where}: 'dataset' must be a non-empty string")
    tools = rec.get("tools")
    if not (tools is None or isinstance(tools, (bool, list))):
        raise ResponseLinesError(f"{where}: 'tools' must be a list of tool definitions, true or false")
    thinking = rec.get("thinking", True)
    if not isinstance(thinking, bool):
        raise ResponseLinesError(f"{where}: 'thinking' must be true or false")
    messages = rec.get("messages")
    if messages is not None and not isinstance(messages, list):
        raise ResponseLinesError(f"{where}: 'messages' must be a list of chat messages")
    return _Line(body, dataset, tools, thinking, messages)


def _response_row(path: Path, sid: str, line: _Line, parsed: ParsedResponse) -> dict[str, Any]:
    prompt_ids = parsed.prompt_token_ids
    if prompt_ids is None and line.messages is None:
        prompt_ids = []  # no prompt given: empty prompt ids rather than a rendered empty conversation
    item = PromptItem(
        sid,
        json.dumps(line.messages if line.messages is not None else [], ensure_ascii=False),
        json.dumps(line.tools, ensure_ascii=False) if isinstance(line.tools, list) else None,
    )
    prov = RowProvenance(
        dataset=line.dataset,
        source="import",
        backend="import",
        endpoint=str(path),
        model=None,
        quantization=None,
        sampling_json="{}",  # unknown: the file gives the answer, not the request's settings
        thinking=line.thinking,
    )
    answer = dataclasses.replace(parsed, prompt_token_ids=prompt_ids)
    row = completion_row(prov, item, answer, latency_s=0.0, at_us=0, raw_response_json=None)
    row["has_tools"] = bool(line.tools)
    row["has_prompt"] = line.messages is not None or parsed.prompt_token_ids is not None
    return row


def read_response_lines(
    path: Path, default_dataset: str, skip_unusable: bool
) -> tuple[list[dict[str, Any]], list[int], int]:
    """Parse a responses JSONL file (one chat-completion body per line, as `eagle-pipeline reconstruct` takes it) into
    responses-table rows; returns (rows, line numbers, skipped). Raises ResponseLinesError naming the file and line."""

    if not path.is_file():
        raise ResponseLinesError(f"{path}: input file not found")
    rows: list[dict[str, Any]] = []
    lines: list[int] = []
    first_line: dict[str, int] = {}
    skipped = 0
    for lineno, where, rec, problem in iter_jsonl_objects(path):
        if problem or rec is None:  # rec is None exactly when the line has a problem
            raise ResponseLinesError(f"{where}: {problem}")
        sid = rec.get("sample_id")
        if not isinstance(sid, str) or not sid:
            raise ResponseLinesError(f"{where}: 'sample_id' must be a non-empty string")
        if sid in first_line:
            raise ResponseLinesError(f"{where}: duplicate sample_id {sid!r} (first on line {first_line[sid]})")
        first_line[sid] = lineno
        line = _line_fields(where, rec, default_dataset)
        try:
            parsed = parse_completion_body(line.body)
        except RequestFailure as exc:
            if skip_unusable:
                skipped += 1
                continue
            raise ResponseLinesError(
                f"{where}: unusable response ({exc}); pass --skip-unusable to skip such lines"
            ) from None
        rows.append(_response_row(path, sid, line, parsed))
        lines.append(lineno)
    return rows, lines, skipped


def responses_table(rows: list[dict[str, Any]]) -> pa.Table:
    """The columns reconstruction reads of `rows`, as an Arrow table with the responses table's types."""
    schema = pa.schema([RESPONSES_SCHEMA.field(name) for name in RECONSTRUCTION_COLUMNS])
    return pa.table({name: [r[name] for r in rows] for name in schema.names}, schema=schema)
