"""Which prompts a run requests: the prompts table against the sample ids already committed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from eagle_pipeline.generation.backends.wire import PromptItem
from eagle_pipeline.generation.plan.turns import (
    ALL_TURNS,
    LAST_TURN,
    SourceConversation,
    resume_turn,
    split_conversation,
)
from eagle_pipeline.generation.store.coverage import current_row_count
from eagle_pipeline.generation.store.shards import CommittedState


@dataclass(frozen=True)
class RequestPlan:
    """The prompts of one run: those to request, and how the others were accounted for."""

    prompts: pa.Table  # the run's prompts: the first `limit` rows of the prompts table (committed ones too)
    items: list[PromptItem]  # not yet committed, in prompt-table order, each sample id once
    total: int  # distinct sample ids considered
    already_done: int  # committed by earlier runs
    duplicates: int  # prompt rows sharing a sample id with an earlier row (requested once)
    rows_done: int  # committed rows answering these prompts (every committed turn of a conversation), for progress
    # regenerate: all_turns: each item is a conversation's first turn still to request; its conversation by id
    conversations: dict[str, SourceConversation] = field(default_factory=dict)


def _column(prompts: pa.Table, name: str) -> Sequence[str | None]:
    """A column as a list; an optional column the table lacks reads as all nulls."""
    if name in prompts.column_names:
        return prompts.column(name).to_pylist()
    return [None] * prompts.num_rows


def prompt_items(prompts: pa.Table) -> tuple[list[PromptItem], dict[str, str]]:
    """Every prompt of the table, and the prompt file's `source_id` of each sample id that has one."""
    sids = prompts.column("sample_id").to_pylist()
    messages = prompts.column("messages_json").to_pylist()
    items = [PromptItem(s, m, t) for s, m, t in zip(sids, messages, _column(prompts, "tools_json"))]
    source_ids = {s: str(src) for s, src in zip(sids, _column(prompts, "source_id")) if src is not None}
    return items, source_ids


def plan_requests(
    prompts: pa.Table,
    committed: CommittedState,
    limit: int | None = None,
    *,
    regenerate: str = LAST_TURN,
) -> RequestPlan:
    """The run's prompts (the first `limit` of `prompts`; all: None) and those still to request: each sample id once,
    none already answered by the `committed` rows, which also give `rows_done`.

    With `regenerate='all_turns'` a prompt is a conversation: its item is the first turn not yet committed (turn 0,
    or the one after the last committed turn, `CommittedState.open_conversations`). A conversation of `prompts` with
    a missing turn raises, within the `limit` or not.
    """
    done = committed.answered
    open_conversations = (
        committed.open_conversations(set(prompts.column("sample_id").to_pylist()) - done)
        if regenerate == ALL_TURNS
        else {}
    )
    if limit is not None:
        prompts = prompts.slice(0, limit)
    items: list[PromptItem] = []
    conversations: dict[str, SourceConversation] = {}
    seen: set[str] = set()
    already = dups = 0
    for item in prompt_items(prompts)[0]:
        if item.sample_id in seen:
            dups += 1
            continue
        seen.add(item.sample_id)
        if item.sample_id in done:
            already += 1
            continue
        if regenerate == ALL_TURNS:
            src = split_conversation(item.sample_id, item.messages_json, item.tools_json)
            first = resume_turn(src, open_conversations.get(item.sample_id))
            if first is None:
                already += 1
                continue
            conversations[src.conversation_id] = src
            item = first
        items.append(item)
    return RequestPlan(
        prompts=prompts,
        items=items,
        total=len(seen),
        already_done=already,
        duplicates=dups,
        rows_done=current_row_count(committed.rows, seen),
        conversations=conversations,
    )
