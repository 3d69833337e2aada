"""Reconstruction of the target's exact output ids from API text, and the token-samples table.

APIs such as OpenRouter return text (reasoning, content, tool calls) but no ids. The target emitted, after a prompt
ending in the generation prompt: `reasoning </think> content [tool-call section] <|im_end|>` (Kimi-K2.5 layout; see
ModelProfile for others). Structural tokens become their special ids; every piece of text is encoded with
`encode_ordinary`, so a special-token string the model *typed* (e.g. a literal "<|im_end|>" in an answer about chat
templates) stays ordinary tokens and the row is flagged `literal_special`.

Each reconstructed row also records `output_text_hash`: the 64-bit `text_hash` of the exact bytes its output ids must
decode to, computed from the source text pieces and the structural tokens' strings (never from the ids). The audit's
`text_agreement` gate recomputes it from the ids, so any id that changes the decoded text is caught.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ..arrow_lists import make_list, nullable_list_rows
from ..prompts import normalized_prompt_key
from .profiles import ModelProfile, ProfileIds, get_profile
from .render import render_prompt
from .text_hash import as_int64, text_hash
from .tokenizer import TargetTokenizer

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

IDS_RECONSTRUCTED = "reconstructed"
IDS_RETURNED = "returned"


@dataclass
class Reconstruction:
    """Reconstructed output ids, whether the text held a literal special-token string, the tool-call count, and
    `text_bytes`: the bytes `ids` must decode to, taken from the text (`plan_text_bytes`)."""

    ids: list[int]
    literal_special: bool
    n_tool_calls: int
    text_bytes: bytes = b""

    @property
    def text_hash(self) -> int:
        """What the row's `output_text_hash` holds: text_hash of `text_bytes`, as int64 (computed when asked)."""
        return as_int64(text_hash(self.text_bytes))


# A plan is a list of parts: str = text to encode ordinarily, int = a structural special id. Adjacent texts are
# joined before encoding, because the target's tokenizer saw them as one run of text between two special tokens.
Part = str | int


class _Plan:
    __slots__ = ("n_tool_calls", "parts")

    def __init__(self) -> None:
        self.parts: list[Part] = []
        self.n_tool_calls = 0

    def texts(self) -> list[str]:
        return [p for p in self.parts if isinstance(p, str)]

    def text(self, s: str) -> None:
        if not s:
            return
        if self.parts and isinstance(self.parts[-1], str):
            self.parts[-1] += s
        else:
            self.parts.append(s)

    def special(self, i: int) -> None:
        self.parts.append(i)


_resolved: weakref.WeakKeyDictionary[TargetTokenizer, dict[ModelProfile, ProfileIds]] = weakref.WeakKeyDictionary()


def _special_strings(pids: ProfileIds) -> dict[int, bytes]:
    """Structural id -> the UTF-8 of its token string, taken from the profile (not from the tokenizer's decoder)."""
    prof = pids.profile
    pairs = (
        (pids.think_open_id, prof.think_open),
        (pids.think_close_id, prof.think_close),
        (pids.eot_id, prof.eot),
        (pids.tool_section_begin_id, prof.tool_section_begin),
        (pids.tool_section_end_id, prof.tool_section_end),
        (pids.tool_call_begin_id, prof.tool_call_begin),
        (pids.tool_call_end_id, prof.tool_call_end),
        (pids.tool_arg_begin_id, prof.tool_arg_begin),
    )
    return {int(i): s.encode("utf-8") for i, s in pairs if i is not None and s is not None}


def _text_bytes(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        # Lone surrogates: encode_ordinary replaces them with U+FFFD (as tiktoken does), so the ids decode to that.
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8")


def plan_text_bytes(parts: Sequence[Part], special_strings: Mapping[int, bytes]) -> bytes:
    """The bytes a plan's ids must decode to: the UTF-8 of each text piece and each structural token's string, in
    order. Taken from the text, independently of how (or whether correctly) it was encoded; `text_hash` of them is
    what a reconstructed row records."""
    return b"".join(_text_bytes(p) if isinstance(p, str) else special_strings[p] for p in parts)


def _as_profile_ids(tokenizer: TargetTokenizer, profile: ProfileIds | ModelProfile | str) -> ProfileIds:
    if isinstance(profile, ProfileIds):
        return profile
    prof = get_profile(profile)
    # Resolved once per tokenizer: reconstruct_output is called per sample by the generation code.
    per_tok = _resolved.setdefault(tokenizer, {})
    ids = per_tok.get(prof)
    if ids is None:
        ids = per_tok[prof] = prof.resolve(tokenizer)
    return ids


def _tool_call_fields(call: Any, index: int, where: str) -> tuple[str, str, str]:
    """(id, name, arguments text) of one OpenAI-style tool call; a missing id becomes `functions.{name}:{index}`."""
    if not isinstance(call, Mapping):
        raise ValueError(f"{where}: tool_calls[{index}] is not an object")
    nested = call.get("function")
    fn: Mapping[str, Any] = nested if isinstance(nested, Mapping) else call
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: tool_calls[{index}] has no function name")
    args = fn.get("arguments", "")
    if args is None:
        args = ""
    # The chat templates print string arguments verbatim and anything else through tojson (ensure_ascii=False).
    args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    call_id = call.get("id")
    if not isinstance(call_id, str) or not call_id:
        call_id = f"functions.{name}:{index}"
    return call_id, name, args_text


def _plan_output(
    tokenizer: TargetTokenizer,
    pids: ProfileIds,
    reasoning: str | None,
    content: str | None,
    tool_calls: Sequence[Any] | None,
    thinking: bool,
    where: str,
) -> _Plan:
    prof = pids.profile
    reasoning = reasoning or ""
    content = content or ""
    plan = _Plan()
    if thinking:
        if not prof.generation_prompt_ends_with_think_open:
            plan.special(pids.think_open_id)
        plan.text(prof.reasoning_prefix + reasoning + prof.reasoning_suffix)
        plan.special(pids.think_close_id)
        plan.text(prof.content_prefix + content)
    else:
        plan.text(content)

    calls = [_tool_call_fields(c, i, where) for i, c in enumerate(tool_calls or ())]
    if calls:
        plan.n_tool_calls = len(calls)
        if prof.tool_format == "kimi":
            needed = (
                pids.tool_section_begin_id,
                pids.tool_section_end_id,
                pids.tool_call_begin_id,
                pids.tool_arg_begin_id,
                pids.tool_call_end_id,
            )
            if any(v is None for v in needed):
                raise ValueError(
                    f"{where}: tokenizer {tokenizer.name!r} lacks the Kimi tool-call tokens of profile {prof.name!r}"
                )
            plan.special(pids.tool_section_begin_id)  # type: ignore[arg-type]
            for call_id, _name, args in calls:
                plan.special(pids.tool_call_begin_id)  # type: ignore[arg-type]
                plan.text(call_id)
                plan.special(pids.tool_arg_begin_id)  # type: ignore[arg-type]
                plan.text(args)
                plan.special(pids.tool_call_end_id)  # type: ignore[arg-type]
            plan.special(pids.tool_section_end_id)  # type: ignore[arg-type]
        else:
            # qwen3: `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` after the content, with "\n" before
            # every call except a first one that follows empty content.
            if pids.tool_call_begin_id is None or pids.tool_call_end_id is None:
                raise ValueError(
                    f"{where}: tokenizer {tokenizer.name!r} lacks the tool-call tokens of profile {prof.name!r}"
                )
            for i, (_cid, name, args) in enumerate(calls):
                if i > 0 or content:
                    plan.text("\n")
                plan.special(pids.tool_call_begin_id)
                plan.text('\n{"name": "' + name + '", "arguments": ' + args + "}\n")
                plan.special(pids.tool_call_end_id)
    plan.special(pids.eot_id)
    return plan


def _assemble(parts: list[Part], encoded: Any) -> list[int]:
    ids: list[int] = []
    for p in parts:
        if isinstance(p, str):
            ids.extend(next(encoded))
        else:
            ids.append(p)
    return ids


def reconstruct_output(
    tokenizer: TargetTokenizer,
    profile_ids_or_profile: ProfileIds | ModelProfile | str,
    *,
    reasoning: str | None,
    content: str | None,
    tool_calls: Sequence[Mapping[str, Any]] | None,
    thinking: bool = True,
) -> Reconstruction:
    """Rebuild the ids the target emitted: reasoning `</think>` content [tool-call section] `<|im_end|>` (Kimi layout;
    thinking=False: content [tool calls] eot). All text is encoded as ordinary text."""
    pids = _as_profile_ids(tokenizer, profile_ids_or_profile)
    plan = _plan_output(tokenizer, pids, reasoning, content, tool_calls, thinking, "reconstruct_output")
    texts = plan.texts()
    encoded = iter(tokenizer.encode_ordinary_batch(texts))
    # literal_special looks at exactly the text that is encoded ordinarily (reasoning, content, tool ids/arguments);
    # the few separators profiles add ("\n", '{"name": "') cannot complete a special-token string.
    literal = any(map(tokenizer.contains_special_string, texts))
    text = plan_text_bytes(plan.parts, _special_strings(pids))
    return Reconstruction(_assemble(plan.parts, encoded), literal, plan.n_tool_calls, text)


def ids_contain_literal_special(tokenizer: TargetTokenizer, ids: Sequence[int] | np.ndarray) -> bool:
    """True when the ordinary (non-special) runs of `ids` decode to text containing a special-token string."""
    arr = np.asarray(ids, dtype=np.int64)
    if arr.size == 0:
        return False
    cuts = np.flatnonzero(tokenizer.is_special_id(arr))
    start = 0
    for stop in [*cuts.tolist(), arr.size]:
        if stop > start and tokenizer.contains_special_string(tokenizer.decode(arr[start:stop])):
            return True
        start = stop + 1
    return False


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
)


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
) -> pa.Table:
    """The token-samples table (TOKEN_SAMPLES_SCHEMA) for a responses table.

    Rows with `output_token_ids` keep the server's ids (ids_origin='returned'); the others are reconstructed from
    their text ('reconstructed') and get `output_text_hash`, the hash of the bytes their ids must decode to,
    computed from that text. Returned rows get null there: the server's text fields are not the exact decoding of
    its ids (see docs/tokens.md). prompt_ids are the returned `prompt_token_ids` when present, else the prompt is
    rendered from messages_json/tools_json with the row's thinking flag (each distinct prompt once). All texts are
    encoded in one batch. Raises ValueError naming the sample_id and field of a malformed row.
    """
    missing = [c for c in _REQUIRED_COLUMNS if c not in responses.column_names]
    if missing:
        raise ValueError(f"responses table lacks column(s) {missing}")
    pids = _as_profile_ids(tokenizer, profile)
    n = responses.num_rows
    col: dict[str, list[Any]] = {}
    for name in _REQUIRED_COLUMNS + _OPTIONAL_COLUMNS:
        if name in ("prompt_token_ids", "output_token_ids"):
            continue
        col[name] = responses.column(name).to_pylist() if name in responses.column_names else [None] * n
    returned_prompt = _list_rows(responses, "prompt_token_ids")
    returned_output = _list_rows(responses, "output_token_ids")

    thinking = [True if t is None else bool(t) for t in col["thinking"]]
    prompt_cache: dict[tuple[str, str | None, bool], np.ndarray] = {}
    key_cache: dict[str, tuple[str, list[Any]]] = {}  # messages_json -> (prompt key, parsed messages)
    prompt_ids: list[np.ndarray] = []
    prompt_keys: list[str] = []
    plans: list[_Plan | None] = []
    texts: list[str] = []
    digests: list[int | None] = []
    special_strings = _special_strings(pids)

    for i in range(n):
        sid = col["sample_id"][i]
        mj, tj = col["messages_json"][i], col["tools_json"][i]
        if mj not in key_cache:
            parsed = _parse_json(mj, sid, "messages_json")
            if not isinstance(parsed, list):
                raise ValueError(f"sample {sid}: field messages_json must be a JSON list of messages")
            key_cache[mj] = (normalized_prompt_key(parsed), parsed)
        key, messages = key_cache[mj]
        prompt_keys.append(key)

        given_prompt = returned_prompt[i]
        if given_prompt is not None:
            prompt_ids.append(given_prompt)
        else:
            pkey = (mj, tj, thinking[i])
            if pkey not in prompt_cache:
                tools = _parse_json(tj, sid, "tools_json")
                try:
                    rendered = render_prompt(tokenizer, messages, tools, thinking=thinking[i])
                except Exception as exc:
                    raise ValueError(f"sample {sid}: cannot render messages_json/tools_json: {exc}") from exc
                prompt_cache[pkey] = np.asarray(tokenizer.encode_with_specials(rendered), dtype=np.int32)
            prompt_ids.append(prompt_cache[pkey])

        if returned_output[i] is not None:
            plans.append(None)
            digests.append(None)
            continue
        calls = _parse_json(col["tool_calls_json"][i], sid, "tool_calls_json")
        if calls is not None and not isinstance(calls, list):
            raise ValueError(f"sample {sid}: field tool_calls_json must be a JSON list")
        plan = _plan_output(
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

    # One batch for every text of every row (literal-special scan included, in the same worker threads); ids stay in
    # numpy arrays up to the Arrow column, so no Python int is made per token.
    arrays, flags = tokenizer.encode_ordinary_arrays_flagged(texts)
    encoded, flag_iter = iter(arrays), iter(flags)
    single: dict[int, np.ndarray] = {}
    out_pieces: list[np.ndarray] = []
    out_lens: list[int] = []
    origin: list[str] = []
    literal: list[bool] = []
    n_calls: list[int] = []
    for i, maybe_plan in enumerate(plans):
        if maybe_plan is None:
            ids = returned_output[i]
            assert ids is not None  # rows without a plan are exactly those with returned ids
            out_pieces.append(ids)
            out_lens.append(len(ids))
            origin.append(IDS_RETURNED)
            literal.append(ids_contain_literal_special(tokenizer, ids))
            n_calls.append(_count_returned_calls(pids, ids, col["tool_calls_json"][i], col["sample_id"][i]))
            continue
        plan = maybe_plan
        length = 0
        row_literal = False
        for part in plan.parts:
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
        n_calls.append(plan.n_tool_calls)

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
    return pa.table(data, schema=TOKEN_SAMPLES_SCHEMA)


def _list_rows(table: pa.Table, name: str) -> list[np.ndarray | None]:
    """Per-row numpy views of a list<int> column (None for null rows, all None if the column is absent)."""
    if name not in table.column_names:
        return [None] * table.num_rows
    return nullable_list_rows(table.column(name), np.int32, name=f"column {name}")


def _list_array(pieces: list[np.ndarray], lengths: list[int]) -> pa.Array:
    """A list<int32> Arrow array from row lengths and the concatenation of all row pieces."""
    values = np.concatenate(pieces).astype(np.int32, copy=False) if pieces else np.zeros(0, dtype=np.int32)
    return make_list(lengths, values, pa.int32(), hint="split the responses")


def _count_returned_calls(
    pids: ProfileIds, ids: Sequence[int] | np.ndarray, tool_calls_json: str | None, sid: str
) -> int:
    # Count the tool-call markers the model actually emitted; fall back to the parsed list for formats without them.
    if pids.tool_call_begin_id is not None:
        return int(np.count_nonzero(np.asarray(ids, dtype=np.int64) == pids.tool_call_begin_id))
    calls = _parse_json(tool_calls_json, sid, "tool_calls_json")
    return len(calls) if isinstance(calls, list) else 0
