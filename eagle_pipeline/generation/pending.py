"""Which prompts a run requests: the prompts table against the sample ids already committed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from eagle_pipeline.generation.backends import PromptItem
from eagle_pipeline.generation.turns import ALL_TURNS, LAST_TURN, SourceConversation, resume_turn, split_conversation


@dataclass(frozen=True)
class RequestPlan:
    """The prompts of one run: those to request, and how the others were accounted for."""

    items: list[PromptItem]  # not yet committed, in prompt-table order, each sample id once
    total: int  # distinct sample ids considered
    already_done: int  # committed by earlier runs
    duplicates: int  # prompt rows sharing a sample id with an earlier row (requested once)
    # committed rows answering these prompts (every committed turn of a conversation); set by the runner for progress
    rows_done: int = 0
    # regenerate: all_turns: each item is a conversation's first turn still to request; its conversation by id
    conversations: dict[str, SourceConversation] = field(default_factory=dict)


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


def plan_requests(
    prompts: pa.Table,
    done: set[str],
    limit: int | None = None,
    *,
    regenerate: str = LAST_TURN,
    open_conversations: dict[str, tuple[int, dict[str, Any]]] | None = None,
) -> RequestPlan:
    """The prompts still to request: each sample id once, none already committed (`done`).

    With `regenerate='all_turns'` a prompt is a conversation: its item is the first turn not yet committed (turn 0,
    or the one after the last committed turn in `open_conversations`, `store.open_conversations`).
    """
    items: list[PromptItem] = []
    conversations: dict[str, SourceConversation] = {}
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
        if regenerate == ALL_TURNS:
            src = split_conversation(item.sample_id, item.messages_json, item.tools_json)
            first = resume_turn(src, (open_conversations or {}).get(item.sample_id))
            if first is None:
                already += 1
                continue
            conversations[src.conversation_id] = src
            item = first
        items.append(item)
    return RequestPlan(items=items, total=len(seen), already_done=already, duplicates=dups, conversations=conversations)
