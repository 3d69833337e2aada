"""The 'import' backend: responses generated elsewhere, matched to this dataset's prompts.

Accepted files (BackendSpec.import_paths):
  * JSONL, one record a line, as `response_lines` reads it: `{"sample_id"?, "source_id"?, "messages"?, "tools"?,
    "response": <chat completion>}` or a chat-completion body itself carrying those keys beside `choices` (OpenAI /
    OpenRouter / vLLM bodies; vLLM token ids are kept when present).
  * Parquet with the responses-table columns (at least sample_id or messages_json, plus the answer columns).

Matching, first that applies: `sample_id` of a pending prompt; `source_id` (the prompt file's id); the canonical JSON
of `messages` (and of `tools`, when the record gives them). Imported rows get source='import' and backend=<spec name>;
unmatched or unusable records go to the errors table; records for prompts already committed are skipped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from eagle_pipeline.generation.backends.wire import PromptItem
from eagle_pipeline.generation.importing.response_lines import completion_row, parse_completion_body, record_body
from eagle_pipeline.generation.plan.pending import RequestPlan, prompt_items
from eagle_pipeline.generation.spec import BackendSpec, SamplingSpec
from eagle_pipeline.generation.store.identity import BackendIdentity
from eagle_pipeline.generation.store.rows import RowProvenance, error_row, now_us
from eagle_pipeline.generation.store.sink import ShardSink
from eagle_pipeline.generation.summary import GenerationSummary
from eagle_pipeline.prompts import canonical_json
from eagle_pipeline.shared import failures as F
from eagle_pipeline.shared.failures import RequestFailure
from eagle_pipeline.shared.storage import iter_jsonl_objects

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


def _row_from_body(rec: dict[str, Any], item: PromptItem, spec: BackendSpec, prov: RowProvenance) -> dict[str, Any]:
    """A responses row from a record's chat-completion body, dated when the body says it was created."""
    body = record_body(rec)
    parsed = parse_completion_body(body, spec)
    created = body.get("created")
    at_us = (
        int(created * 1_000_000) if isinstance(created, (int, float)) and not isinstance(created, bool) else now_us()
    )
    raw = json.dumps(body, ensure_ascii=False)
    return completion_row(
        prov, item, parsed, latency_s=float(rec.get("latency_s") or 0.0), at_us=at_us, raw_response_json=raw
    )


def _row_from_table_row(rec: dict[str, Any], item: PromptItem, prov: RowProvenance) -> dict[str, Any]:
    """A responses-table row from another run: provenance columns are replaced, the answer and its metadata kept."""
    row = dict(rec)
    for k in ("started_at", "finished_at"):
        v = row.get(k)
        if v is not None and not isinstance(v, int):
            row[k] = int(v.timestamp() * 1_000_000)
    if row.get("started_at") is None:
        row["started_at"] = row["finished_at"] = now_us()
    row.update(
        sample_id=item.sample_id,
        dataset=prov.dataset,
        messages_json=item.messages_json,
        tools_json=item.tools_json,
        source=prov.source,
        backend=prov.backend,
    )
    kept_unless_missing = {
        "endpoint": prov.endpoint,
        "sampling_json": prov.sampling_json,
        "thinking": prov.thinking,
        "attempts": 0,
        "latency_s": 0.0,
    }
    for k, v in kept_unless_missing.items():
        if row.get(k) is None:
            row[k] = v
    return row


class ImportRun:
    """One import run: the records of every import file, matched to the plan's prompts, into the sink.

    Every prompt of the run (committed ones too) is in the index, so a record for a committed prompt is recognised and
    skipped rather than reported as unmatched."""

    def __init__(
        self,
        *,
        dataset: str,
        plan: RequestPlan,
        backend: BackendSpec,
        sampling: SamplingSpec,
        sink: ShardSink,
        commit_every_rows: int,
    ) -> None:
        self.dataset = dataset
        self.plan = plan
        self.backend = backend
        self.sink = sink
        self.commit_every_rows = commit_every_rows
        self.index = _Index(*prompt_items(plan.prompts))
        self.available = {it.sample_id for it in plan.items}
        self.prov = RowProvenance(
            dataset=dataset,
            source="import",
            backend=backend.name,
            endpoint=None,  # set per file
            model=backend.model or None,
            quantization=None,
            sampling_json=canonical_json(sampling.to_dict()),
            thinking=bool(sampling.thinking),
            identity=BackendIdentity.of(backend).to_json(),
        )
        self.matched = self.completed = self.failed = self.dups = 0
        self.errors_by_class: dict[str, int] = {}
        self.spend = 0.0
        self.ptoks = self.ctoks = 0

    def error(self, sample_id: str | None, cls: str, message: str) -> None:
        self.failed += 1
        self.errors_by_class[cls] = self.errors_by_class.get(cls, 0) + 1
        self.sink.errors.append(
            error_row(
                sample_id=sample_id,
                dataset=self.dataset,
                backend=self.backend.name,
                error_class=cls,
                http_status=None,
                message=message,
                attempts=0,
            )
        )

    def import_file(self, path: Path) -> None:
        if not path.exists():
            raise FileNotFoundError(f"backend {self.backend.name!r}: import file {path} not found")
        prov = replace(self.prov, endpoint=str(path))
        for where, rec, problem in _records(path):
            if rec is None:
                self.error(None, F.IMPORT_INVALID, f"{where}: {problem}")
            else:
                self.import_record(where, rec, prov)

    def import_record(self, where: str, rec: dict[str, Any], prov: RowProvenance) -> None:
        item = self.index.match(rec, self.available)
        if item is None:
            self.error(None, F.IMPORT_UNMATCHED, f"{where}: matches no prompt of {self.dataset}")
            return
        if item.sample_id not in self.available:
            # Committed earlier, or already imported from an earlier record: exactly once, so skip.
            self.dups += 1
            return
        self.matched += 1
        try:
            if "response" in rec or "choices" in rec or "error" in rec:
                row = _row_from_body(rec, item, self.backend, prov)
            elif "raw_response_json" in rec or "content" in rec:
                row = _row_from_table_row(rec, item, prov)
            else:
                raise RequestFailure(F.IMPORT_INVALID, "record has neither a response body nor response columns", False)
        except RequestFailure as f:
            self.error(item.sample_id, F.IMPORT_INVALID, f"{where}: {f}")
            return
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            self.error(item.sample_id, F.IMPORT_INVALID, f"{where}: {type(exc).__name__}: {exc}")
            return
        self.available.discard(item.sample_id)
        self.sink.responses.append(row)
        self.completed += 1
        self.spend += row.get("cost_usd") or 0.0
        self.ptoks += row.get("usage_prompt_tokens") or 0
        self.ctoks += row.get("usage_completion_tokens") or 0
        if len(self.sink.responses) >= self.commit_every_rows:
            self.sink.commit_nowait()

    async def run(self) -> GenerationSummary:
        """Fill the plan's prompts from the import files; every row and error in hand is committed whatever happens."""
        try:
            for path in self.backend.import_paths:
                self.import_file(Path(path))
        finally:
            await self.sink.close()
        if self.dups:
            log.info(
                "[%s] import: skipped %d records for prompts already committed or imported", self.dataset, self.dups
            )
        return self.summary()

    def summary(self) -> GenerationSummary:
        return GenerationSummary(
            dataset=self.dataset,
            total_prompts=self.plan.total,
            already_done=self.plan.already_done,
            requested=self.matched,
            completed=self.completed,
            failed=self.failed,
            errors_by_class=dict(sorted(self.errors_by_class.items())),
            spend_usd=self.spend,
            prompt_tokens=self.ptoks,
            completion_tokens=self.ctoks,
            stopped_reason=None,
            elapsed_s=0.0,
            backend=self.backend.name,
            simulated=False,
            skipped_duplicates=self.dups + self.plan.duplicates,
        )
