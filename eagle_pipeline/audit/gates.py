"""Gate implementations. Each takes the shared AuditContext and the settings, and returns which rows it checked and
which failed (an `Outcome`). The catalogue that names them, with their defaults, is `spec.GATES`.

All gates here but one are pure numpy over the event list (see context.py) or, for `text_agreement`, over the flat id
buffer; `round_trip` loops over rows to decode and re-encode. `tool_sections_valid`, which walks each tool row
through a state machine, is in tool_sections.py.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eagle_pipeline.audit.context import (
    EOT,
    FOREIGN,
    OUT_OF_RANGE,
    RESERVED,
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CODES,
    AuditContext,
)
from eagle_pipeline.tokens.text_hash import TokenHashTable, ids_text_hashes, token_hash_table


@dataclass
class Outcome:
    """checked/fail: bool per row; pos: position within the row to excerpt (-1: the row's last token)."""

    checked: np.ndarray
    fail: np.ndarray
    pos: np.ndarray
    details: dict[str, Any] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)  # row -> what exactly is wrong, for examples
    passed: bool | None = None  # set by gates whose pass/fail is not "no failing row" (billing)
    source_extra: dict[str, dict[str, Any]] = field(default_factory=dict)
    # row -> excerpt, for gates about something other than the output (the prompt, say)
    excerpts: dict[int, str] = field(default_factory=dict)


def _last(ctx: AuditContext) -> np.ndarray:
    return np.maximum(ctx.lengths - 1, 0)


def _require(ctx: AuditContext, code: int, what: str) -> int:
    i = ctx.classes.ids.get(code)
    if i is None:
        raise ValueError(f"the model profile defines no {what} id, which this gate needs")
    return i


def gate_ids_in_vocab(ctx: AuditContext, settings: Any) -> Outcome:
    bad = np.isin(ctx.ev_code, (RESERVED, FOREIGN, OUT_OF_RANGE))
    pos = ctx.first_pos_where(bad)
    fail = pos >= 0
    kinds = {"out_of_range": OUT_OF_RANGE, "reserved_or_unassigned": RESERVED, "non_output_special": FOREIGN}
    details = {k: int(np.count_nonzero(ctx.ev_code == c)) for k, c in kinds.items()}
    details["vocab_size"] = ctx.classes.vocab_size
    return Outcome(np.ones(ctx.n, dtype=bool), fail, pos, details)


def gate_ends_with_eot(ctx: AuditContext, settings: Any) -> Outcome:
    eot = _require(ctx, EOT, "end-of-turn")
    lengths = ctx.lengths
    last = np.full(ctx.n, -1, dtype=np.int64)
    nonempty = lengths > 0
    last[nonempty] = ctx.values[ctx.offsets[1:][nonempty] - 1]
    checked = ctx.complete
    fail = checked & (last != eot)
    return Outcome(checked, fail, _last(ctx), {"empty_outputs": int(np.count_nonzero(checked & ~nonempty))})


def gate_single_eot(ctx: AuditContext, settings: Any) -> Outcome:
    _require(ctx, EOT, "end-of-turn")
    cnt = ctx.count(EOT)
    complete = ctx.complete
    fail = (complete & (cnt != 1)) | (~complete & (cnt > 1))
    pos = np.where(cnt > 0, ctx.first_pos(EOT), _last(ctx))
    details = {
        "rows_without_eot": int(np.count_nonzero(complete & (cnt == 0))),
        "rows_with_several": int(np.count_nonzero(cnt > 1)),
    }
    return Outcome(np.ones(ctx.n, dtype=bool), fail, pos, details)


def gate_single_think_close(ctx: AuditContext, settings: Any) -> Outcome:
    _require(ctx, THINK_CLOSE, "think-close")
    cnt = ctx.count(THINK_CLOSE)
    think, complete = ctx.thinking, ctx.complete
    fail = (think & complete & (cnt != 1)) | (think & ~complete & (cnt > 1)) | (~think & (cnt > 0))
    pos = np.where(cnt > 1, ctx.last_pos(THINK_CLOSE), np.where(cnt == 1, ctx.first_pos(THINK_CLOSE), 0))
    details = {
        "thinking_rows_without": int(np.count_nonzero(think & complete & (cnt == 0))),
        "rows_with_several": int(np.count_nonzero(cnt > 1)),
        "non_thinking_rows_with": int(np.count_nonzero(~think & (cnt > 0))),
    }
    return Outcome(np.ones(ctx.n, dtype=bool), fail, pos, details)


def gate_think_close_before_eot(ctx: AuditContext, settings: Any) -> Outcome:
    _require(ctx, THINK_CLOSE, "think-close")
    _require(ctx, EOT, "end-of-turn")
    last_tc, first_eot = ctx.last_pos(THINK_CLOSE), ctx.first_pos(EOT)
    checked = (last_tc >= 0) & (first_eot >= 0)
    fail = checked & (last_tc > first_eot)
    return Outcome(checked, fail, first_eot)


def _model_opens_think(ctx: AuditContext) -> bool:
    """True for profiles whose generation prompt does not end with <think>, so the model writes it (Qwen3)."""
    profile = getattr(ctx.profile_ids, "profile", None)
    return not getattr(profile, "generation_prompt_ends_with_think_open", True)


def gate_no_think_open(ctx: AuditContext, settings: Any) -> Outcome:
    ones = np.ones(ctx.n, dtype=bool)
    if ctx.classes.ids.get(THINK_OPEN) is None:
        # A profile without a think block has nothing to leak.
        return Outcome(ones, np.zeros(ctx.n, dtype=bool), np.zeros(ctx.n, dtype=np.int64))
    first, cnt = ctx.first_pos(THINK_OPEN), ctx.count(THINK_OPEN)
    if not _model_opens_think(ctx):
        return Outcome(ones, cnt > 0, first)
    # The model opens the block itself: thinking rows hold exactly one <think>, as their first id; others none.
    think = ctx.thinking & (ctx.lengths > 0)
    fail = (think & ((cnt != 1) | (first != 0))) | (~ctx.thinking & (cnt > 0))
    pos = np.where(cnt > 0, np.where(first == 0, ctx.last_pos(THINK_OPEN), first), 0)
    return Outcome(ones, fail, pos, {"model_opens_think": True})


def gate_reasoning_nonempty(ctx: AuditContext, settings: Any) -> Outcome:
    _require(ctx, THINK_CLOSE, "think-close")
    first = ctx.first_pos(THINK_CLOSE)
    checked = ctx.thinking & (first >= 0)
    start = np.zeros(ctx.n, dtype=np.int64)
    if _model_opens_think(ctx) and ctx.classes.ids.get(THINK_OPEN) is not None:
        start = np.where(ctx.first_pos(THINK_OPEN) == 0, 1, 0)
    span = first - start
    fail = checked & (span <= 0)
    # Profiles that wrap reasoning in fixed text (Qwen3: "\n" ... "\n") are empty when the span is only that text.
    profile = getattr(ctx.profile_ids, "profile", None)
    wrapper = getattr(profile, "reasoning_prefix", "") + getattr(profile, "reasoning_suffix", "")
    if wrapper:
        k = len(ctx.tokenizer.encode_ordinary(wrapper))
        for row in np.flatnonzero(checked & (span > 0) & (span <= k)).tolist():
            a = int(ctx.offsets[row] + start[row])
            if ctx.tokenizer.decode_bytes(ctx.values[a : a + int(span[row])]) == wrapper.encode():
                fail[row] = True
    return Outcome(checked, fail, np.maximum(first, 0))


def gate_tool_tokens_declared(ctx: AuditContext, settings: Any) -> Outcome:
    is_tool = np.isin(ctx.ev_code, TOOL_CODES)
    has_tool_ids = np.bincount(ctx.ev_row[is_tool], minlength=ctx.n) > 0
    checked = ~ctx.has_tools
    return Outcome(checked, checked & has_tool_ids, ctx.first_pos_where(is_tool))


def gate_not_truncated(ctx: AuditContext, settings: Any) -> Outcome:
    fail = ~ctx.complete
    rows = np.flatnonzero(fail)
    # Only the failing rows' reasons are materialised: a clean million-row table costs nothing here.
    reasons = ctx.finish_reasons(rows)
    counts = Counter("null" if r is None else r for r in reasons)
    return Outcome(
        np.ones(ctx.n, dtype=bool),
        fail,
        _last(ctx),
        {"finish_reasons": dict(counts.most_common())},
        reasons={int(i): f"finish_reason={r!r}" for i, r in zip(rows[: settings.max_examples], reasons)},
    )


def _spread(diff: np.ndarray, sel: np.ndarray) -> dict[str, Any]:
    """Min, median and max of the per-row differences of the selected rows ({} when none is selected)."""
    d = diff[sel]
    if d.size == 0:
        return {}
    return {"difference_min": int(d.min()), "difference_median": float(np.median(d)), "difference_max": int(d.max())}


def gate_billing_agreement(ctx: AuditContext, settings: Any) -> Outcome:
    usage, valid = ctx.usage
    lengths = ctx.lengths.astype(np.int64)
    signed = usage - lengths  # > 0: the provider counted more tokens than our ids hold
    diff = np.abs(signed)
    tol = np.maximum(float(settings.billing_row_abs_tolerance), settings.billing_row_rel_tolerance * usage)
    checked = valid
    fail = checked & (diff > tol)

    def rel(sum_len: int, sum_usage: int) -> float | None:
        if sum_usage == 0:
            return 0.0 if sum_len == 0 else None  # None: undefined (JSON null), treated as failing
        return abs(sum_len - sum_usage) / sum_usage

    sum_len, sum_usage = int(lengths[checked].sum()), int(usage[checked].sum())
    agg = rel(sum_len, sum_usage)
    passed = agg is not None and agg <= settings.billing_aggregate_bound
    codes, keys = ctx.sources
    src_len = np.bincount(codes[checked], weights=lengths[checked], minlength=len(keys))
    src_use = np.bincount(codes[checked], weights=usage[checked], minlength=len(keys))
    source_extra = {
        key: {
            "sum_output_tokens": int(src_len[k]),
            "sum_usage_tokens": int(src_use[k]),
            "aggregate_relative_error": rel(int(src_len[k]), int(src_use[k])),
            # A median of exactly +1 or -1 is one token per row: a counting convention or a token we lose.
            **_spread(signed, checked & (codes == k)),
        }
        for k, key in enumerate(keys)
    }
    reasons = {
        int(i): f"len(output_ids)={int(lengths[i])} usage_completion_tokens={int(usage[i])}"
        for i in np.flatnonzero(fail)[: settings.max_examples]
    }
    details = {
        "aggregate_relative_error": agg,
        "aggregate_bound": settings.billing_aggregate_bound,
        "sum_output_tokens": sum_len,
        "sum_usage_tokens": sum_usage,
        "rows_without_usage": int(np.count_nonzero(~valid)),
        **_spread(signed, checked),
        "row_tolerance": f"max({settings.billing_row_abs_tolerance}, {settings.billing_row_rel_tolerance} * usage)",
    }
    return Outcome(checked, fail, _last(ctx), details, reasons, passed, source_extra)


def gate_prompt_agreement(ctx: AuditContext, settings: Any) -> Outcome:
    """The prompt the target answered against the one rendered here, two ways.

    Rows whose prompt ids came from the server (vLLM's `prompt_token_ids`): those ids against the project's render
    of the same messages (the chat template with the target's tokenizer); a failure names the first differing
    position and both tokens there. Rows with a provider's prompt count: len(prompt_ids) against
    usage_prompt_tokens, per source the spread of the difference, which tells a constant offset (a provider's
    injected system prompt) from drift on some prompts (tool declarations rendered differently). For rows of the
    first kind the count is the server's count of its own ids, so only the render comparison can fail there."""
    n = ctx.n
    checked, fail = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    pos = np.zeros(n, dtype=np.int64)
    codes, keys = ctx.sources
    details: dict[str, Any] = {}
    source_extra: dict[str, dict[str, Any]] = {key: {} for key in keys}
    reasons: dict[int, str] = {}
    excerpts: dict[int, str] = {}
    found = ctx.prompt_usage
    if found is None:
        details["usage_prompt_tokens_column"] = "absent"
    else:
        lengths, usage, counted = found
        diff = usage - lengths  # > 0: the provider counted a longer prompt than ours
        count_fail = counted & (np.abs(diff) > settings.prompt_row_abs_tolerance)
        checked |= counted
        fail |= count_fail
        for k, key in enumerate(keys):
            source_extra[key].update(_spread(diff, counted & (codes == k)))
        details.update(
            usage_prompt_tokens_column="present",
            row_tolerance=settings.prompt_row_abs_tolerance,
            rows_without_prompt_usage=int(np.count_nonzero(~counted)),
            **_spread(diff, counted),
        )
        # The prompt's head is where an injected system prompt or the tool declarations would show.
        head = settings.excerpt_tokens
        for i in np.flatnonzero(count_fail)[: settings.max_examples].tolist():
            reasons[i] = (
                f"len(prompt_ids)={int(lengths[i])} usage_prompt_tokens={int(usage[i])} (difference {int(diff[i]):+d})"
            )
            excerpts[i] = "prompt: " + ctx.render(ctx.prompt_ids(i)[:head]) + ("…" if lengths[i] > head else "")
    rendered = ctx.prompt_render
    if rendered is None:
        details["render_compared_rows"] = 0
    else:
        compared, first = rendered
        render_fail = compared & (first >= 0)
        checked |= compared
        fail |= render_fail
        pos = np.where(render_fail, first, pos)
        details["render_compared_rows"] = int(np.count_nonzero(compared))
        details["render_differing_rows"] = int(np.count_nonzero(render_fail))
        for k, key in enumerate(keys):
            mine = codes == k
            source_extra[key]["render_compared"] = int(np.count_nonzero(compared & mine))
            source_extra[key]["render_differing"] = int(np.count_nonzero(render_fail & mine))
        for i in np.flatnonzero(render_fail)[: settings.max_examples].tolist():
            reasons[i], excerpts[i] = _render_difference(ctx, i, int(first[i]), settings.excerpt_tokens)
    return Outcome(checked, fail, pos, details, reasons, source_extra=source_extra, excerpts=excerpts)


def _render_difference(ctx: AuditContext, row: int, at: int, width: int) -> tuple[str, str]:
    """What a row's render difference says (position, both tokens, both lengths) and both prompts around it."""
    served, ours = ctx.prompt_ids(row), ctx.rendered_prompt_ids(row)

    def token(ids: list[int]) -> str:
        return f"{ctx.render(ids[at : at + 1])!r} (id {ids[at]})" if at < len(ids) else "the end of the prompt"

    if not ours:
        reason = "the project's chat template cannot render this row's messages (the reconstruction logged why)"
        return reason, f"server: {ctx.window(served, 0, width)}"
    reason = (
        f"prompt_ids differ from the project's render at position {at}: the server has {token(served)}, "
        f"the project {token(ours)} ({len(served)} vs {len(ours)} ids)"
    )
    return reason, f"server: {ctx.window(served, at, width)} | project: {ctx.window(ours, at, width)}"


# ---- round trip ------------------------------------------------------------------------------------------------

_ROUND_TRIP_BATCH_TOKENS = 1 << 20


def gate_round_trip(ctx: AuditContext, settings: Any) -> Outcome:
    """Split each row at its non-ordinary ids; every span must decode to valid UTF-8 and re-encode to itself.

    The last span of an incomplete row is skipped: a generation cut by max_tokens may end inside a character.
    """
    tok = ctx.tokenizer
    n = ctx.n
    checked = ctx.lengths > 0
    fail = np.zeros(n, dtype=bool)
    pos = np.full(n, -1, dtype=np.int64)
    reasons: dict[int, str] = {}
    kinds: Counter[str] = Counter()
    complete = ctx.complete
    ev_off, ev_pos, offs, vals = ctx.ev_row_offsets, ctx.ev_pos, ctx.offsets, ctx.values
    pending: list[tuple[int, int, np.ndarray, str]] = []  # (row, span start in row, ids (a view), text)
    pending_tokens = 0

    def mark(row: int, p: int, kind: str) -> None:
        if not fail[row]:
            fail[row], pos[row] = True, p
            kinds[kind] += 1
            if len(reasons) < settings.max_examples:
                reasons[row] = kind

    def flush() -> None:
        nonlocal pending_tokens
        if not pending:
            return
        encoded = ctx.encode_ordinary_arrays([t for _, _, _, t in pending])
        for (row, start, ids, _), again in zip(pending, encoded):
            if again.size != ids.size or not np.array_equal(again, ids):
                k = min(ids.size, again.size)
                differ = np.flatnonzero(ids[:k] != again[:k])
                mark(row, start + (int(differ[0]) if differ.size else k), "non_canonical")
        pending.clear()
        pending_tokens = 0

    for row in np.flatnonzero(checked).tolist():
        a, b = int(offs[row]), int(offs[row + 1])
        cuts = (ev_pos[ev_off[row] : ev_off[row + 1]] - a).tolist()
        start = 0
        for end in [*cuts, b - a]:
            if end > start and not (end == b - a and not complete[row]):
                span = vals[a + start : a + end]
                try:
                    text = tok.decode_bytes(span).decode("utf-8")
                except UnicodeDecodeError as exc:
                    # Locate the offending token: the first whose cumulative bytes cover the bad byte.
                    mark(row, start + _token_at_byte(tok, span.tolist(), exc.start), "invalid_utf8")
                    break
                pending.append((row, start, span, text))
                pending_tokens += span.size
            start = end + 1
        if pending_tokens >= _ROUND_TRIP_BATCH_TOKENS:
            flush()
    flush()
    origin = ctx.origin
    details = {
        "problems": dict(kinds.most_common()),
        "failing_reconstructed": int(np.count_nonzero(fail & (origin == 0))),
        "failing_returned": int(np.count_nonzero(fail & (origin == 1))),
    }
    return Outcome(checked, fail, pos, details, reasons)


# ---- text agreement ----------------------------------------------------------------------------------------------


def gate_text_agreement(ctx: AuditContext, settings: Any) -> Outcome:
    """Rows with an `output_text_hash` must decode (decode_bytes, specials as their strings) to bytes with that hash.
    The hash was computed from the source text when the row was built, so this compares the ids with the text they
    claim to encode. It is recomputed from the ids without decoding (tokens/text_hash.py): a few numpy passes over
    the flat buffer. Rows without a hash (returned ids, older files) are not checked."""
    n = ctx.n
    pos = np.zeros(n, dtype=np.int64)  # a hash does not say where the bytes differ: excerpt the row's start
    found = ctx.text_digests
    if found is None:
        details: dict[str, Any] = {"problems": {}, "digest_column": "absent", "rows_without_digest": n}
        return Outcome(np.zeros(n, dtype=bool), np.zeros(n, dtype=bool), pos, details)
    checked, want = found
    table = token_hash_table(ctx.tokenizer)
    vals, offs = ctx.values, ctx.offsets
    bad = _rows_with_undecodable_ids(ctx, table)
    if bad.any():
        vals = np.clip(vals, 0, table.vocab_size - 1)  # those rows fail anyway; the others hash as they are
    got = ids_text_hashes(vals, offs, table)
    undecodable = checked & bad
    mismatch = checked & ~bad & (got != want)
    reasons: dict[int, str] = {}
    for row in np.flatnonzero(undecodable | mismatch)[: settings.max_examples].tolist():
        reasons[row] = (
            "output_ids do not decode (an id outside the vocabulary)"
            if undecodable[row]
            else "output_ids decode to bytes whose text_hash differs from output_text_hash"
        )
    origin = ctx.origin
    problems = {"undecodable": int(undecodable.sum()), "digest_mismatch": int(mismatch.sum())}
    details = {
        "problems": {k: v for k, v in problems.items() if v},
        "digest_column": "present",
        "rows_without_digest": int(n - checked.sum()),
        "rows_without_digest_reconstructed": int(np.count_nonzero(~checked & (origin == 0))),
    }
    return Outcome(checked, undecodable | mismatch, pos, details, reasons)


def _rows_with_undecodable_ids(ctx: AuditContext, table: TokenHashTable) -> np.ndarray:
    """Rows holding an id outside the vocabulary or one the tokenizer cannot decode."""
    bad = np.zeros(ctx.n, dtype=bool)
    if table.decodable[: ctx.classes.threshold].all():
        # Every ordinary id decodes, so only the (few) non-ordinary ids need a look.
        ids = ctx.values[ctx.ev_pos].astype(np.int64)
        ok = (ids >= 0) & (ids < table.vocab_size)
        ok[ok] = table.decodable[ids[ok]]
        bad[ctx.ev_row[~ok]] = True
        return bad
    ids = ctx.values.astype(np.int64)
    ok = (ids >= 0) & (ids < table.vocab_size)
    ok[ok] = table.decodable[ids[ok]]
    starts = ctx.offsets[:-1]
    nonempty = ctx.lengths > 0
    if nonempty.any():
        bad[nonempty] = np.logical_or.reduceat(~ok, starts[nonempty])
    return bad


def _token_at_byte(tok: Any, span: list[int], byte: int) -> int:
    total = 0
    for k, t in enumerate(span):
        total += len(tok.decode_bytes([t]))
        if total > byte:
            return k
    return max(len(span) - 1, 0)
