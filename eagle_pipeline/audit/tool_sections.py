"""The `tool_sections_valid` gate: a state machine over the special ids of each row that holds tool ids.

Kimi's grammar is `section_begin (call_begin ID arg_begin ARGS call_end)+ section_end`, once, after `</think>`,
directly before the end of turn; profiles without section tokens (Qwen3) write `call_begin {"name", "arguments"}
call_end` blocks separated by whitespace. The gate loops in Python over the tool rows only (it decodes ids and parses
JSON arguments); see docs/audit.md.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

import numpy as np

from eagle_pipeline.audit.context import (
    ARG_BEGIN,
    CALL_BEGIN,
    CALL_END,
    EOT,
    SECTION_BEGIN,
    SECTION_END,
    THINK_CLOSE,
    TOOL_CODES,
    AuditContext,
)
from eagle_pipeline.audit.gates import Outcome

_ID_PLAIN = re.compile(r"^\S+$")
_ID_FUNCTIONS = re.compile(r"^functions\.\S+:\d+$")


def tool_call_id_ok(text: str) -> bool:
    """The id rule: non-empty, no whitespace; ids in Kimi's `functions.` namespace must be `functions.NAME:INDEX`."""
    if not _ID_PLAIN.match(text):
        return False
    return not text.startswith("functions.") or bool(_ID_FUNCTIONS.match(text))


class _ToolProblem(Exception):
    def __init__(self, kind: str, pos: int) -> None:
        super().__init__(kind)
        self.kind, self.pos = kind, pos


def _decode_text(ctx: AuditContext, ids: np.ndarray) -> str | None:
    try:
        return ctx.tokenizer.decode_bytes(ids).decode("utf-8")
    except (UnicodeDecodeError, KeyError, OverflowError):
        # Invalid UTF-8, or an id the tokenizer cannot decode (ids_in_vocab reports those): not a valid field.
        return None


def _check_gap(ctx: AuditContext, ids: Any, has_sections: bool, lo: int, hi: int, kind: str) -> None:
    # Inside a section nothing may stand between the structural ids; a profile without sections may put
    # whitespace between calls (Qwen writes newlines there).
    if hi > lo and (has_sections or (_decode_text(ctx, ids[lo:hi]) or "x").strip()):
        raise _ToolProblem(kind, lo)


def _check_call(ctx: AuditContext, ids: Any, begin: int, arg: int | None, end: int) -> None:
    """One call between `begin` and `end`: its id (before the argument marker `arg`, when the profile has one) and
    a JSON object as its arguments."""
    if arg is not None:
        text = _decode_text(ctx, ids[begin + 1 : arg])
        if text is None or not tool_call_id_ok(text):
            raise _ToolProblem("bad_id", begin + 1)
        body_lo = arg + 1
    else:
        body_lo = begin + 1
    text = _decode_text(ctx, ids[body_lo:end])
    try:
        parsed = json.loads(text) if text is not None else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise _ToolProblem("bad_arguments", body_lo)
    if arg is None and not isinstance(parsed.get("name"), str):
        # Without an argument marker the body is the whole call, {"name": ..., "arguments": ...} (Qwen3).
        raise _ToolProblem("bad_arguments", body_lo)


def _check_tool_row(ctx: AuditContext, row: int, complete: bool, think_close_pos: int, expected_calls: int) -> int:
    """Walk the special ids of one row; raise _ToolProblem at the first violation. Returns the number of calls."""
    ids = ctx.row_ids(row)
    a, b = ctx.ev_row_offsets[row], ctx.ev_row_offsets[row + 1]
    codes = ctx.ev_code[a:b].tolist()
    positions = (ctx.ev_pos[a:b] - ctx.offsets[row]).tolist()
    has_sections = ctx.classes.ids.get(SECTION_BEGIN) is not None and ctx.classes.ids.get(SECTION_END) is not None
    has_arg = ctx.classes.ids.get(ARG_BEGIN) is not None

    def check_gap(lo: int, hi: int, kind: str = "stray_tokens") -> None:
        _check_gap(ctx, ids, has_sections, lo, hi, kind)

    def check_call(begin: int, arg: int | None, end: int) -> None:
        _check_call(ctx, ids, begin, arg, end)

    state, calls, sections = "out", 0, 0
    last = -1  # position of the previous structural id in the current tool region
    call_begin = arg_pos = -1
    for code, p in zip(codes, positions):
        if state == "out":
            opens = SECTION_BEGIN if has_sections else CALL_BEGIN
            if code == opens:
                if sections and has_sections:
                    raise _ToolProblem("multiple_sections", p)
                if think_close_pos >= 0 and p < think_close_pos:
                    raise _ToolProblem("before_think_close", p)
                sections += 1
                if has_sections:
                    state, last = "section", p
                else:
                    state, call_begin = ("id" if has_arg else "args"), p
            elif code in TOOL_CODES:
                raise _ToolProblem("unbalanced", p)
        elif state == "section":
            check_gap(last + 1, p)
            if code == CALL_BEGIN:
                state, call_begin = ("id" if has_arg else "args"), p
            elif code == SECTION_END:
                if calls == 0:
                    raise _ToolProblem("empty_section", p)
                state, last = "after", p
            else:
                raise _ToolProblem("unbalanced", p)
        elif state == "id":
            if code != ARG_BEGIN:
                raise _ToolProblem("unbalanced", p)
            state, arg_pos = "args", p
        elif state == "args":
            if code != CALL_END:
                raise _ToolProblem("unbalanced", p)
            check_call(call_begin, arg_pos if has_arg else None, p)
            calls += 1
            state, last = ("section" if has_sections else "after"), p
        elif state == "after":
            if code == EOT:
                check_gap(last + 1, p, "not_at_end")
                state = "done"
            elif code == CALL_BEGIN and not has_sections:
                check_gap(last + 1, p)
                state, call_begin = ("id" if has_arg else "args"), p
            elif code in TOOL_CODES:
                raise _ToolProblem("multiple_sections" if code == SECTION_BEGIN else "unbalanced", p)
            else:
                raise _ToolProblem("not_at_end", p)
        elif code in TOOL_CODES:  # state == "done"
            raise _ToolProblem("unbalanced", p)
    if complete:
        if state in ("section", "id", "args"):
            raise _ToolProblem("unbalanced", len(ids) - 1)
        if state == "after":
            raise _ToolProblem("not_at_end", len(ids) - 1)
        if expected_calls >= 0 and calls != expected_calls:
            raise _ToolProblem("count_mismatch", len(ids) - 1)
    return calls


def gate_tool_sections_valid(ctx: AuditContext, settings: Any) -> Outcome:
    is_tool = np.isin(ctx.ev_code, TOOL_CODES)
    has_tool_ids = np.bincount(ctx.ev_row[is_tool], minlength=ctx.n) > 0
    expected = ctx.n_tool_calls
    checked = has_tool_ids | (expected > 0 if expected is not None else False)
    fail = np.zeros(ctx.n, dtype=bool)
    pos = np.full(ctx.n, -1, dtype=np.int64)
    reasons: dict[int, str] = {}
    kinds: Counter[str] = Counter()
    complete, thinking = ctx.complete, ctx.thinking
    tc_first = ctx.first_pos(THINK_CLOSE) if ctx.classes.ids.get(THINK_CLOSE) is not None else np.full(ctx.n, -1)
    calls_total = 0
    for row in np.flatnonzero(checked).tolist():
        try:
            calls_total += _check_tool_row(
                ctx,
                row,
                bool(complete[row]),
                int(tc_first[row]) if thinking[row] else -1,
                int(expected[row]) if expected is not None else -1,
            )
        except _ToolProblem as problem:
            fail[row], pos[row] = True, problem.pos
            kinds[problem.kind] += 1
            if len(reasons) < settings.max_examples:
                reasons[row] = problem.kind
    details = {"problems": dict(kinds.most_common()), "well_formed_calls": calls_total}
    return Outcome(checked, fail, pos, details, reasons)
