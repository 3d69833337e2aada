"""Reconstruction of the target's exact output ids from API text (`samples.py` builds the token-samples table on it).

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

from .profiles import ModelProfile, ProfileIds, get_profile
from .text_hash import as_int64, text_hash
from .tokenizer import TargetTokenizer


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


class OutputPlan:
    """The parts of one output in order (`Part`s) and its tool-call count, before any text is encoded."""

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


def structural_strings(pids: ProfileIds) -> dict[int, bytes]:
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


def as_profile_ids(tokenizer: TargetTokenizer, profile: ProfileIds | ModelProfile | str) -> ProfileIds:
    """`profile` resolved for `tokenizer` (a ProfileIds is returned as is)."""
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


def plan_output(
    tokenizer: TargetTokenizer,
    pids: ProfileIds,
    reasoning: str | None,
    content: str | None,
    tool_calls: Sequence[Any] | None,
    thinking: bool,
    where: str,
) -> OutputPlan:
    """The output layout of one response (profile's structural ids around its text pieces); ValueError naming
    `where` for a malformed tool call or a tokenizer without the profile's tool tokens."""
    prof = pids.profile
    reasoning = reasoning or ""
    content = content or ""
    plan = OutputPlan()
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
    pids = as_profile_ids(tokenizer, profile_ids_or_profile)
    plan = plan_output(tokenizer, pids, reasoning, content, tool_calls, thinking, "reconstruct_output")
    texts = plan.texts()
    encoded = iter(tokenizer.encode_ordinary_batch(texts))
    # literal_special looks at exactly the text that is encoded ordinarily (reasoning, content, tool ids/arguments);
    # the few separators profiles add ("\n", '{"name": "') cannot complete a special-token string.
    literal = any(map(tokenizer.contains_special_string, texts))
    text = plan_text_bytes(plan.parts, structural_strings(pids))
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
