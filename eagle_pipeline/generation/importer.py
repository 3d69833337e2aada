"""The 'import' backend: responses generated elsewhere, matched to this dataset's prompts.

Accepted files (BackendSpec.import_paths):
  * JSONL, one record a line, either `{"sample_id"?, "source_id"?, "messages"?, "tools"?, "response": <chat completion>}`
    or a chat-completion body itself carrying those keys beside `choices` (OpenAI / OpenRouter / vLLM bodies;
    vLLM token ids are kept when present).
  * Parquet with the responses-table columns (at least sample_id or messages_json, plus the answer columns).

Matching, first that applies: `sample_id` of a pending prompt; `source_id` (the prompt file's id); the canonical JSON
of `messages` (and of `tools`, when the record gives them). Imported rows get source='import' and backend=<spec name>;
unmatched or unusable records go to the errors table; records for prompts already committed are skipped.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from eagle_pipeline.generation import failures as F
from eagle_pipeline.generation.backends import PromptItem, parse_chat_completion
from eagle_pipeline.generation.failures import RequestFailure
from eagle_pipeline.generation.spec import BackendSpec, SamplingSpec
from eagle_pipeline.prompts import canonical_json
from eagle_pipeline.storage import iter_jsonl_objects

log = logging.getLogger("eagle_pipeline.generation")


class _Index:
    def __init__(self, items: list[PromptItem], source_ids: dict[str, str]) -> None:
        self.by_sid = {it.sample_id: it for it in items}
        self.by_source: dict[str, list[PromptItem]] = {}
        self.by_messages: dict[str, list[PromptItem]] = {}
        for it in items:
            src = source_ids.get(it.sample_id)
            if src is not None:
                self.by_source.setdefault(src, []).append(it)
            self.by_messages.setdefault(it.messages_json, []).append(it)

    def match(self, rec: dict[str, Any], available: set[str]) -> PromptItem | None:
        """The prompt this record answers, preferring one still `available`; None when nothing matches."""
        sid = rec.get("sample_id")
        if isinstance(sid, str) and sid in self.by_sid:
            return self.by_sid[sid]
        candidates: list[PromptItem] = []
        src = rec.get("source_id")
        if src is not None and str(src) in self.by_source:
            candidates = self.by_source[str(src)]
        elif rec.get("messages_json") is not None or rec.get("messages") is not None:
            mj = rec.get("messages_json")
            if not isinstance(mj, str):
                mj = canonical_json(rec["messages"])
            else:
                mj = canonical_json(json.loads(mj))
            candidates = self.by_messages.get(mj, [])
            tools = rec.get("tools", rec.get("tools_json", ...))
            if tools is not ... and candidates:
                if isinstance(tools, str):
                    tools = json.loads(tools)
                tj = canonical_json(tools) if tools is not None else None
                candidates = [c for c in candidates if c.tools_json == tj]
        # Identical prompts (same messages, different source ids) are matched in order, one record each.
        for c in candidates:
            if c.sample_id in available:
                return c
        return candidates[0] if candidates else None


def _records(path: Path) -> Iterator[tuple[str, dict[str, Any] | None, str | None]]:
    """(location, record or None, problem) for every record of one file."""
    if path.suffix == ".parquet":
        table = pq.read_table(path)
        for i, rec in enumerate(table.to_pylist()):
            yield f"{path}:row {i}", rec, None
        return
    for _, where, obj, problem in iter_jsonl_objects(path):
        yield where, obj, problem


def _row_from_body(rec: dict[str, Any], item: PromptItem, spec: BackendSpec, base: dict[str, Any]) -> dict[str, Any]:
    body = (
        rec["response"]
        if "response" in rec
        else {k: v for k, v in rec.items() if k not in ("sample_id", "source_id", "messages", "tools")}
    )
    want_ids = (
        isinstance(body, dict)
        and isinstance(body.get("choices"), list)
        and bool(body["choices"])
        and isinstance(body["choices"][0], dict)
        and "token_ids" in body["choices"][0]
    )
    p = parse_chat_completion(body, 200, want_ids=want_ids, spec=spec)
    created = body.get("created") if isinstance(body, dict) else None
    at_us = (
        int(created * 1_000_000)
        if isinstance(created, (int, float)) and not isinstance(created, bool)
        else time.time_ns() // 1000
    )
    return {
        **base,
        "model": p.model or spec.model or None,
        "provider": p.provider,
        "reasoning": p.reasoning,
        "content": p.content,
        "tool_calls_json": p.tool_calls_json,
        "prompt_token_ids": p.prompt_token_ids,
        "output_token_ids": p.output_token_ids,
        "finish_reason": p.finish_reason,
        "native_finish_reason": p.native_finish_reason,
        "usage_prompt_tokens": p.usage_prompt_tokens,
        "usage_completion_tokens": p.usage_completion_tokens,
        "usage_reasoning_tokens": p.usage_reasoning_tokens,
        "cost_usd": p.cost_usd,
        "generation_id": p.generation_id,
        "latency_s": float(rec.get("latency_s") or 0.0),
        "started_at": at_us,
        "finished_at": at_us,
        "raw_response_json": json.dumps(body, ensure_ascii=False),
    }


def _row_from_table_row(rec: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """A responses-table row from another run: provenance columns are replaced, the answer and its metadata kept."""
    row = dict(rec)
    for k in ("started_at", "finished_at"):
        v = row.get(k)
        if v is not None and not isinstance(v, int):
            row[k] = int(v.timestamp() * 1_000_000)
    if row.get("started_at") is None:
        row["started_at"] = row["finished_at"] = time.time_ns() // 1000
    for k in ("sample_id", "dataset", "messages_json", "tools_json", "source", "backend"):
        row[k] = base[k]
    for k in ("endpoint", "sampling_json", "thinking", "attempts", "latency_s"):
        if row.get(k) is None:
            row[k] = base.get(k, 0.0)
    return row


def import_responses(
    *,
    dataset: str,
    all_items: list[PromptItem],
    source_ids: dict[str, str],
    pending: set[str],
    backend: BackendSpec,
    sampling: SamplingSpec,
    sink: Any,
    commit_every_rows: int,
):
    """Write rows for the `pending` prompts found in the import files; returns a GenerationSummary.

    `all_items` are all prompts of the run (committed ones too), so a record for a committed prompt is recognised and
    skipped rather than reported as unmatched.
    """
    from eagle_pipeline.generation.runner import GenerationSummary

    index = _Index(all_items, source_ids)
    available = set(pending)
    matched = 0
    sampling_json = canonical_json(sampling.to_dict())
    completed = failed = dups = 0
    errors_by_class: dict[str, int] = {}
    spend = 0.0
    ptoks = ctoks = 0

    def error(sample_id: str | None, cls: str, message: str) -> None:
        nonlocal failed
        failed += 1
        errors_by_class[cls] = errors_by_class.get(cls, 0) + 1
        sink.errors.append(
            {
                "sample_id": sample_id,
                "dataset": dataset,
                "backend": backend.name,
                "error_class": cls,
                "http_status": None,
                "message": F.truncate(message, 1000),
                "attempts": 0,
                "at": time.time_ns() // 1000,
            }
        )

    for path in (Path(p) for p in backend.import_paths):
        if not path.exists():
            raise FileNotFoundError(f"backend {backend.name!r}: import file {path} not found")
        for where, rec, problem in _records(path):
            if rec is None:
                error(None, F.IMPORT_INVALID, f"{where}: {problem}")
                continue
            item = index.match(rec, available)
            if item is None:
                error(None, F.IMPORT_UNMATCHED, f"{where}: matches no prompt of {dataset}")
                continue
            if item.sample_id not in available:
                # Committed earlier, or already imported from an earlier record: exactly once, so skip.
                dups += 1
                continue
            matched += 1
            base = {
                "sample_id": item.sample_id,
                "dataset": dataset,
                "messages_json": item.messages_json,
                "tools_json": item.tools_json,
                "source": "import",
                "backend": backend.name,
                "endpoint": str(path),
                "quantization": None,
                "sampling_json": sampling_json,
                "thinking": bool(sampling.thinking),
                "attempts": 0,  # no request was made by this pipeline
            }
            try:
                if "response" in rec or "choices" in rec or "error" in rec:
                    row = _row_from_body(rec, item, backend, base)
                elif "raw_response_json" in rec or "content" in rec:
                    row = _row_from_table_row(rec, base)
                else:
                    raise RequestFailure(
                        F.IMPORT_INVALID, "record has neither a response body nor response columns", False
                    )
            except RequestFailure as f:
                error(item.sample_id, F.IMPORT_INVALID, f"{where}: {f}")
                continue
            except (TypeError, ValueError, KeyError, AttributeError) as exc:
                error(item.sample_id, F.IMPORT_INVALID, f"{where}: {type(exc).__name__}: {exc}")
                continue
            available.discard(item.sample_id)
            sink.responses.append(row)
            completed += 1
            spend += row.get("cost_usd") or 0.0
            ptoks += row.get("usage_prompt_tokens") or 0
            ctoks += row.get("usage_completion_tokens") or 0
            if len(sink.responses) >= commit_every_rows:
                sink.commit_nowait()
    if dups:
        log.info("[%s] import: skipped %d records for prompts already committed or imported", dataset, dups)
    return GenerationSummary(
        dataset=dataset,
        total_prompts=len(all_items),
        already_done=0,
        requested=matched,
        completed=completed,
        failed=failed,
        errors_by_class=dict(sorted(errors_by_class.items())),
        spend_usd=spend,
        prompt_tokens=ptoks,
        completion_tokens=ctoks,
        stopped_reason=None,
        elapsed_s=0.0,
        backend=backend.name,
        simulated=False,
        skipped_duplicates=dups,
    )
