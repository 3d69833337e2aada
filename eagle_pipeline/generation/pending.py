"""Which prompts a run requests: the prompts table against the sample ids already committed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa

from eagle_pipeline.generation.backends import PromptItem


@dataclass(frozen=True)
class RequestPlan:
    """The prompts of one run: those to request, and how the others were accounted for."""

    items: list[PromptItem]  # not yet committed, in prompt-table order, each sample id once
    total: int  # distinct sample ids considered
    already_done: int  # committed by earlier runs
    duplicates: int  # prompt rows sharing a sample id with an earlier row (requested once)


def _column(prompts: pa.Table, name: str) -> Sequence[str | None]:
    """A column as a list; an optional column the table lacks reads as all nulls."""
    if name in prompts.column_names:
        return prompts.column(name).to_pylist()
    return [None] * prompts.num_rows


def prompt_items(prompts: pa.Table, limit: int | None = None) -> tuple[list[PromptItem], dict[str, str]]:
    """Every prompt of the table (the first `limit`), and the prompt file's `source_id` of each sample id that has one."""
    if limit is not None:
        prompts = prompts.slice(0, limit)
    sids = prompts.column("sample_id").to_pylist()
    messages = prompts.column("messages_json").to_pylist()
    items = [PromptItem(s, m, t) for s, m, t in zip(sids, messages, _column(prompts, "tools_json"))]
    source_ids = {s: str(src) for s, src in zip(sids, _column(prompts, "source_id")) if src is not None}
    return items, source_ids


def plan_requests(prompts: pa.Table, done: set[str], limit: int | None = None) -> RequestPlan:
    """The prompts still to request: each sample id once, none already committed (`done`)."""
    items: list[PromptItem] = []
    seen: set[str] = set()
    already = dups = 0
    for item in prompt_items(prompts, limit)[0]:
        if item.sample_id in seen:
            dups += 1
            continue
        seen.add(item.sample_id)
        if item.sample_id in done:
            already += 1
            continue
        items.append(item)
    return RequestPlan(items=items, total=len(seen), already_done=already, duplicates=dups)
