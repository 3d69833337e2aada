"""The token-samples table: `reconstruct_table` turns a responses table into exact target ids per row.

Each row's prompt is rendered through the target's chat template (or taken as the server returned it) and its output
rebuilt from the API text as `reconstruct.py` lays it out (or taken as returned); all texts of all rows are encoded in
one batch. See docs/tokens.md and the table contract in docs/architecture.md.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ..prompts import normalized_prompt_key
from ..shared.arrow import make_list, nullable_list_rows, offsets_from_lengths
from .profiles import ModelProfile, ProfileIds
from .reconstruct import (
    OutputPlan,
    as_profile_ids,
    ids_contain_literal_special,
    plan_output,
    plan_text_bytes,
    structural_strings,
)
from .render import render_prompt
from .text_hash import as_int64, text_hash
from .tokenizer import EncodingMemo, TargetTokenizer

logger = logging.getLogger(__name__)

TOKEN_SAMPLES_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("source", pa.string()),
        ("backend", pa.string()),
        ("provider", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("output_ids", pa.list_(pa.int32())),
        ("ids_origin", pa.string()),
        ("finish_reason", pa.string()),
        ("usage_completion_tokens", pa.int64()),
        # The provider's count of the prompt it saw (null: not reported); prompt_agreement compares it to prompt_ids.
        ("usage_prompt_tokens", pa.int64()),
        ("thinking", pa.bool_()),
        ("dataset_has_tools", pa.bool_()),
        ("n_tool_calls", pa.int32()),
        ("literal_special", pa.bool_()),
        ("prompt_key", pa.string()),
        # text_hash of the bytes output_ids must decode to (tokenizer.decode_bytes), computed from the source text,
        # not from the ids, as the int64 bit pattern; null where the pipeline does not know that text exactly
        # (returned ids).
        ("output_text_hash", pa.int64()),
    ]
)
# Appended to the table only when it holds turns of regenerated conversations (`regenerate: all_turns`), so every
# other token-samples table keeps TOKEN_SAMPLES_SCHEMA exactly: the merge keeps a conversation in one split and,
# with `loss_on: all_turns`, folds its turns (docs/merge.md).
TURN_FIELDS = (pa.field("conversation_id", pa.string()), pa.field("turn_index", pa.int32()))
# Appended only when some row's prompt ids came from the server (vLLM's `prompt_token_ids`, or the ids an SGLang run
# sent), so the prompt_agreement gate can compare them with the project's render of the same messages:
# `prompt_render_diff` is -1 where they are equal, else the first position where they differ (the shorter length when
# one is a prefix of the other), null on rows whose prompt ids are the project's render; `rendered_prompt_ids` holds
# the project's render on the rows where it differs (null elsewhere; empty where the project cannot render it).
RENDER_FIELDS = (pa.field("prompt_render_diff", pa.int32()), pa.field("rendered_prompt_ids", pa.list_(pa.int32())))

IDS_RECONSTRUCTED = "reconstructed"
IDS_RETURNED = "returned"


_REQUIRED_COLUMNS = ("sample_id", "dataset", "source", "backend", "messages_json")
_OPTIONAL_COLUMNS = (
    "provider",
    "tools_json",
    "reasoning",
    "content",
    "tool_calls_json",
    "prompt_token_ids",
    "output_token_ids",
    "finish_reason",
    "usage_completion_tokens",
    "usage_prompt_tokens",
    "thinking",
    "conversation_id",
    "turn_index",
)
# Every responses column reconstruction reads (callers building a responses table select these).
RECONSTRUCTION_COLUMNS = _REQUIRED_COLUMNS + _OPTIONAL_COLUMNS


def _parse_json(text: str | None, sample_id: str, field: str) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"sample {sample_id}: field {field} is not valid JSON ({exc})") from exc


def reconstruct_table(
    responses: pa.Table,
    tokenizer: TargetTokenizer,
    profile: ProfileIds | ModelProfile | str,
    *,
    dataset_has_tools: bool,
    memo: EncodingMemo | None = None,
) -> pa.Table:
    """The token-samples table (TOKEN_SAMPLES_SCHEMA, plus TURN_FIELDS when it holds turns of regenerated
    conversations, plus RENDER_FIELDS when some prompt ids came from the server) for a responses table.

    Rows with `output_token_ids` keep the server's ids (ids_origin='returned'); the others are reconstructed from
    their text ('reconstructed') and get `output_text_hash`, the hash of the bytes their ids must decode to,
    computed from that text. Returned rows get null there: the server's text fields are not the exact decoding of
    its ids (see docs/tokens.md). prompt_ids are the returned `prompt_token_ids` when present, else the prompt is
    rendered from messages_json/tools_json with the row's thinking flag (each distinct prompt once). Returned prompt
    ids are compared with that render too (RENDER_FIELDS). All texts are encoded in one batch; with `memo`, each
    output text and its ids are remembered there (the audit of this table then re-encodes none of them). Raises
    ValueError naming the sample_id and field of a malformed row.
    """
    missing = [c for c in _REQUIRED_COLUMNS if c not in responses.column_names]
    if missing:
        raise ValueError(f"responses table lacks column(s) {missing}")
    pids = as_profile_ids(tokenizer, profile)
    n = responses.num_rows
    col: dict[str, list[Any]] = {}
    for name in _REQUIRED_COLUMNS + _OPTIONAL_COLUMNS:
        if name in ("prompt_token_ids", "output_token_ids"):
            continue
        col[name] = responses.column(name).to_pylist() if name in responses.column_names else [None] * n
    returned_prompt = _list_rows(responses, "prompt_token_ids")
    returned_output = _list_rows(responses, "output_token_ids")

    thinking = [True if t is None else bool(t) for t in col["thinking"]]
    prompt_ids, prompt_keys, render_diff, render_ids = _prompt_columns(tokenizer, col, thinking, returned_prompt)
    plans, texts, digests = _output_plans(tokenizer, pids, col, thinking, returned_output)
    out_pieces, out_lens, origin, literal, n_calls = _output_columns(
        tokenizer, pids, col, plans, texts, returned_output, memo
    )

    data = {
        "sample_id": col["sample_id"],
        "dataset": col["dataset"],
        "source": col["source"],
        "backend": col["backend"],
        "provider": col["provider"],
        "prompt_ids": _list_array(prompt_ids, [len(a) for a in prompt_ids]),
        "output_ids": _list_array(out_pieces, out_lens),
        "ids_origin": origin,
        "finish_reason": col["finish_reason"],
        "usage_completion_tokens": col["usage_completion_tokens"],
        "usage_prompt_tokens": col["usage_prompt_tokens"],
        "thinking": thinking,
        "dataset_has_tools": [bool(dataset_has_tools)] * n,
        "n_tool_calls": n_calls,
        "literal_special": literal,
        "prompt_key": prompt_keys,
        "output_text_hash": digests,
    }
    table = pa.table(data, schema=TOKEN_SAMPLES_SCHEMA)
    if any(c is not None for c in col["conversation_id"]):
        for f in TURN_FIELDS:
            table = table.append_column(f, pa.array(col[f.name], f.type))
    if any(d is not None for d in render_diff):
        diff_field, ids_field = RENDER_FIELDS
        table = table.append_column(diff_field, pa.array(render_diff, diff_field.type))
        table = table.append_column(ids_field, _nullable_list_array(render_ids))
    return table


def _prompt_columns(
    tokenizer: TargetTokenizer, col: dict[str, list[Any]], thinking: list[bool], returned: list[np.ndarray | None]
) -> tuple[list[np.ndarray], list[str], list[int | None], list[np.ndarray | None]]:
    """Per row: the prompt ids (the server's, else the project's render of messages/tools, each distinct prompt
    rendered once), the prompt key, and for server ids the first position where the render differs (-1: equal;
    None: not compared) with the render where it differs (RENDER_FIELDS)."""
    prompt_cache: dict[tuple[str, str | None, bool], np.ndarray] = {}
    key_cache: dict[str, tuple[str, list[Any]]] = {}  # messages_json -> (prompt key, parsed messages)
    prompt_ids: list[np.ndarray] = []
    prompt_keys: list[str] = []
    render_diff: list[int | None] = []
    render_ids: list[np.ndarray | None] = []

    def render(sid: str, mj: str, tj: str | None, messages: list[Any], think: bool) -> np.ndarray:
        pkey = (mj, tj, think)
        if pkey not in prompt_cache:
            tools = _parse_json(tj, sid, "tools_json")
            try:
                rendered = render_prompt(tokenizer, messages, tools, thinking=think)
            except Exception as exc:
                raise ValueError(f"sample {sid}: cannot render messages_json/tools_json: {exc}") from exc
            prompt_cache[pkey] = np.asarray(tokenizer.encode_with_specials(rendered), dtype=np.int32)
        return prompt_cache[pkey]

    for i, sid in enumerate(col["sample_id"]):
        mj, tj = col["messages_json"][i], col["tools_json"][i]
        if mj not in key_cache:
            parsed = _parse_json(mj, sid, "messages_json")
            if not isinstance(parsed, list):
                raise ValueError(f"sample {sid}: field messages_json must be a JSON list of messages")
            key_cache[mj] = (normalized_prompt_key(parsed), parsed)
        key, messages = key_cache[mj]
        prompt_keys.append(key)
        given_prompt = returned[i]
        diff: int | None = None
        ours: np.ndarray | None = None
        if given_prompt is None:
            prompt_ids.append(render(sid, mj, tj, messages, thinking[i]))
        else:
            prompt_ids.append(given_prompt)
            # Compared with the project's render, unless the row names no prompt (empty ids, a CLI line without
            # messages).
            if len(given_prompt) and messages:
                try:
                    ours = render(sid, mj, tj, messages, thinking[i])
                except ValueError as exc:
                    # The server's ids stand; that the project cannot render this prompt is a difference (an
                    # empty render) for the gate to report, not a reason to refuse the dataset.
                    logger.warning("%s; prompt_agreement reports it", exc)
                    ours = np.zeros(0, dtype=np.int32)
                diff = first_difference(given_prompt, ours)
        render_diff.append(diff)
        render_ids.append(ours if diff is not None and diff >= 0 else None)
    return prompt_ids, prompt_keys, render_diff, render_ids


def _output_plans(
    tokenizer: TargetTokenizer,
    pids: ProfileIds,
    col: dict[str, list[Any]],
    thinking: list[bool],
    returned: list[np.ndarray | None],
) -> tuple[list[OutputPlan | None], list[str], list[int | None]]:
    """Per row without server ids: the plan of its output (texts and structural ids) and its output_text_hash; the
    texts of every plan in order, to encode in one batch. Rows with server ids get None for both."""
    plans: list[OutputPlan | None] = []
    texts: list[str] = []
    digests: list[int | None] = []
    special_strings = structural_strings(pids)
    for i, sid in enumerate(col["sample_id"]):
        if returned[i] is not None:
            plans.append(None)
            digests.append(None)
            continue
        calls = _parse_json(col["tool_calls_json"][i], sid, "tool_calls_json")
        if calls is not None and not isinstance(calls, list):
            raise ValueError(f"sample {sid}: field tool_calls_json must be a JSON list")
        plan = plan_output(
            tokenizer,
            pids,
            col["reasoning"][i],
            col["content"][i],
            calls,
            thinking[i],
            f"sample {sid}: tool_calls_json",
        )
        plans.append(plan)
        texts.extend(plan.texts())
        digests.append(as_int64(text_hash(plan_text_bytes(plan.parts, special_strings))))
    return plans, texts, digests


def _output_columns(
    tokenizer: TargetTokenizer,
    pids: ProfileIds,
    col: dict[str, list[Any]],
    plans: list[OutputPlan | None],
    texts: list[str],
    returned: list[np.ndarray | None],
    memo: EncodingMemo | None,
) -> tuple[list[np.ndarray], list[int], list[str], list[bool], list[int]]:
    """Each row's output ids as pieces and length, origin, literal-special flag and tool-call count.

    One batch for every text of every row (literal-special scan included, in the same worker threads); ids stay in
    numpy arrays up to the Arrow column, so no Python int is made per token."""
    arrays, flags = tokenizer.encode_ordinary_arrays_flagged(texts)
    if memo is not None:
        memo.remember(texts, arrays)
    encoded, flag_iter = iter(arrays), iter(flags)
    single: dict[int, np.ndarray] = {}
    out_pieces: list[np.ndarray] = []
    out_lens: list[int] = []
    origin: list[str] = []
    literal: list[bool] = []
    n_calls: list[int] = []
    for i, maybe_plan in enumerate(plans):
        if maybe_plan is None:
            ids = returned[i]
            assert ids is not None  # rows without a plan are exactly those with returned ids
            out_pieces.append(ids)
            out_lens.append(len(ids))
            origin.append(IDS_RETURNED)
            literal.append(ids_contain_literal_special(tokenizer, ids))
            n_calls.append(_count_returned_calls(pids, ids, col["tool_calls_json"][i], col["sample_id"][i]))
            continue
        length = 0
        row_literal = False
        for part in maybe_plan.parts:
            if isinstance(part, str):
                arr = next(encoded)
                row_literal |= next(flag_iter)
            else:
                one = single.get(part)
                if one is None:
                    one = single[part] = np.array([part], dtype=np.int32)
                arr = one
            out_pieces.append(arr)
            length += len(arr)
        out_lens.append(length)
        origin.append(IDS_RECONSTRUCTED)
        literal.append(row_literal)
        n_calls.append(maybe_plan.n_tool_calls)
    return out_pieces, out_lens, origin, literal, n_calls


def first_difference(a: np.ndarray, b: np.ndarray) -> int:
    """The first position where two id sequences differ (the shorter length when one is a prefix of the other), or
    -1 when they are equal."""
    k = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:k]) != np.asarray(b[:k]))
    if differ.size:
        return int(differ[0])
    return -1 if len(a) == len(b) else k


def _list_rows(table: pa.Table, name: str) -> list[np.ndarray | None]:
    """Per-row numpy views of a list<int> column (None for null rows, all None if the column is absent)."""
    if name not in table.column_names:
        return [None] * table.num_rows
    return nullable_list_rows(table.column(name), np.int32, name=f"column {name}")


def _list_array(pieces: list[np.ndarray], lengths: list[int]) -> pa.Array:
    """A list<int32> Arrow array from row lengths and the concatenation of all row pieces."""
    values = np.concatenate(pieces).astype(np.int32, copy=False) if pieces else np.zeros(0, dtype=np.int32)
    return make_list(lengths, values, pa.int32(), hint="split the responses")


def _nullable_list_array(pieces: list[np.ndarray | None]) -> pa.Array:
    """A list<int32> Arrow array with a null row where `pieces` holds None."""
    present = [p for p in pieces if p is not None]
    array = _list_array(present, [len(p) for p in present])
    lengths = [0 if p is None else len(p) for p in pieces]
    offsets = pa.array(offsets_from_lengths(np.asarray(lengths, dtype=np.int64), "split the responses"))
    return pa.ListArray.from_arrays(offsets, array.values, mask=pa.array([p is None for p in pieces]))


def _count_returned_calls(
    pids: ProfileIds, ids: Sequence[int] | np.ndarray, tool_calls_json: str | None, sid: str
) -> int:
    # Count the tool-call markers the model actually emitted; fall back to the parsed list for formats without them.
    if pids.tool_call_begin_id is not None:
        return int(np.count_nonzero(np.asarray(ids, dtype=np.int64) == pids.tool_call_begin_id))
    calls = _parse_json(tool_calls_json, sid, "tool_calls_json")
    return len(calls) if isinstance(calls, list) else 0
