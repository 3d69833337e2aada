"""Mutation testing of the audit gates.

1,200 valid rows are reconstructed with the real Kimi tokenizer (and, separately, the demo tokenizer): every gate
must pass them all. Then each corruption class is injected into a subset of rows, and the gate meant to catch it
must flag exactly those rows, while every other gate stays silent on untouched rows and only the listed gates
(which legitimately see the same damage) may also fire on the mutated ones.

Reconstructed rows carry `output_text_hash` (the digest of their source text), so `text_agreement` also fires on
every mutation that changes the bytes their ids decode to; returned rows carry none and are left to the others.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from eagle_pipeline.audit import GATE_NAMES, AuditSettings, run_audit, run_gate
from eagle_pipeline.tokens.text_hash import text_hash_int64

from .corpus import build_clean_table, mutate
from .helpers import assert_caught, pick_rows


@pytest.fixture(params=["kimi", "demo"], scope="module")
def env(request):
    """(tokenizer, profile ids, clean table) for the real Kimi tokenizer and for the demo tokenizer."""
    if request.param == "kimi":
        return (
            request.getfixturevalue("kimi_tok"),
            request.getfixturevalue("kimi_ids"),
            request.getfixturevalue("kimi_clean"),
        )
    tok, ids = request.getfixturevalue("demo_tok"), request.getfixturevalue("demo_ids")
    return tok, ids, build_clean_table(tok, ids, 1200, seed=7)


TEXT = "text_agreement"


def _lowest_special(tok) -> int:
    return min(tok.special_tokens.values())


def _reconstructed(r) -> bool:
    return r["ids_origin"] == "reconstructed"


def _returned(r) -> bool:
    return r["ids_origin"] == "returned"


def test_clean_rows_pass_every_gate(env):
    tok, ids, table = env
    assert table.num_rows >= 1000
    report = run_audit(table, tok, ids)
    for r in report.results:
        assert r.failing == 0, f"false positive in {r.name}: {r.examples}"
        assert r.passed and not r.blocking
        assert r.checked > 0, f"{r.name} checked nothing: the corpus does not exercise it"
    assert report.passed and report.blocking_failed == []
    assert report.filter_mask.all() and report.excluded_counts == {}
    # The corpus really covers what the gates distinguish.
    rows = table.to_pylist()
    assert any(r["literal_special"] for r in rows)
    assert any(r["n_tool_calls"] > 1 for r in rows)
    assert any(not r["thinking"] for r in rows)
    assert {r["ids_origin"] for r in rows} == {"reconstructed", "returned"}
    assert report.result("tool_sections_valid").details["well_formed_calls"] == sum(r["n_tool_calls"] for r in rows)
    assert report.result("round_trip").checked == table.num_rows
    # Every reconstructed row carries its text digest and agrees with it, literal special strings included.
    text = report.result(TEXT)
    assert text.checked == sum(_reconstructed(r) for r in rows) and set(text.by_origin) == {"reconstructed"}
    assert any(r["literal_special"] and _reconstructed(r) for r in rows)
    assert text.details["rows_without_digest_reconstructed"] == 0
    assert report.result("billing_agreement").details["aggregate_relative_error"] < 0.005
    json.dumps(report.to_dict())


def test_dropped_think_close(env):
    tok, ids, table = env
    rows = pick_rows(table, 60, lambda r: r["thinking"])
    bad = mutate(table, rows, lambda o, r: [x for x in o if x != ids.think_close_id])
    # Joining reasoning and content into one span may re-tokenize differently at the seam.
    report = assert_caught(bad, rows, tok, ids, "single_think_close", allowed={"round_trip", TEXT})
    assert "single_think_close" in report.blocking_failed
    assert report.result("single_think_close").details["thinking_rows_without"] == 60


def test_doubled_think_close(env):
    tok, ids, table = env

    def double(o, r):
        k = o.index(ids.think_close_id)
        return o[: k + 1] + [ids.think_close_id] + o[k + 1 :]

    rows = pick_rows(table, 60, lambda r: r["thinking"])
    report = assert_caught(mutate(table, rows, double), rows, tok, ids, "single_think_close", allowed={TEXT})
    example = report.result("single_think_close").examples[0]
    assert "</think>⟦</think>⟧" in example["excerpt"]


def test_think_close_with_thinking_off(env):
    tok, ids, table = env
    rows = pick_rows(table, 30, lambda r: not r["thinking"])
    bad = mutate(table, rows, lambda o, r: [ids.think_close_id] + o)
    assert_caught(bad, rows, tok, ids, "single_think_close", allowed={TEXT})


def test_dropped_eot(env):
    tok, ids, table = env
    rows = pick_rows(table, 60)
    bad = mutate(table, rows, lambda o, r: o[:-1])
    report = assert_caught(bad, rows, tok, ids, "ends_with_eot", allowed={"single_eot", "tool_sections_valid", TEXT})
    assert report.result("single_eot").failing == 60  # a complete row without eot also has zero of them
    assert set(report.blocking_failed) >= {"ends_with_eot", "single_eot"}


def test_doubled_eot(env):
    tok, ids, table = env
    rows = pick_rows(table, 60)
    report = assert_caught(
        mutate(table, rows, lambda o, r: o + [ids.eot_id]), rows, tok, ids, "single_eot", allowed={TEXT}
    )
    assert report.result("single_eot").details["rows_with_several"] == 60


def test_leaked_think_open(env):
    tok, ids, table = env
    rows = pick_rows(table, 60)
    bad = mutate(table, rows, lambda o, r: [ids.think_open_id] + o)
    report = assert_caught(bad, rows, tok, ids, "no_think_open", allowed={TEXT})
    assert report.result("no_think_open").examples[0]["excerpt"].startswith("⟦<think>⟧")


def test_empty_reasoning(env):
    tok, ids, table = env
    rows = pick_rows(table, 60, lambda r: r["thinking"])
    bad = mutate(table, rows, lambda o, r: o[o.index(ids.think_close_id) :])
    report = assert_caught(bad, rows, tok, ids, "reasoning_nonempty", allowed={"billing_agreement", TEXT})
    res = report.result("reasoning_nonempty")
    assert (
        res.action == "filter"
        and not res.blocking
        and res.excluded == 60
        and report.passed == (not report.result("billing_agreement").blocking)
    )


def test_eot_before_think_close(env):
    tok, ids, table = env

    def swap(o, r):
        k = o.index(ids.think_close_id)
        o[k], o[-1] = o[-1], o[k]
        return o

    rows = pick_rows(table, 60, lambda r: r["thinking"] and r["n_tool_calls"] == 0)
    assert_caught(mutate(table, rows, swap), rows, tok, ids, "think_close_before_eot", allowed={"ends_with_eot", TEXT})


def test_cut_tail(env):
    tok, ids, table = env
    rng = random.Random(3)
    rows = pick_rows(table, 60, lambda r: len(r["output_ids"]) > 12)
    bad = mutate(table, rows, lambda o, r: o[: -rng.randint(2, 10)])
    # What else fires depends on what the cut removed: </think>, a tool section's end, part of a BPE run, tokens billed.
    assert_caught(
        bad,
        rows,
        tok,
        ids,
        "ends_with_eot",
        allowed={
            "single_eot",
            "single_think_close",
            "tool_sections_valid",
            "round_trip",
            "billing_agreement",
            TEXT,
        },
    )


def test_non_canonical_split_is_always_caught(env):
    """Replacing one multi-character token by the encodings of its characters is valid text but non-canonical BPE."""
    tok, ids, table = env
    low = _lowest_special(tok)
    rng = random.Random(4)

    def split(o, r):
        cand = []
        for k, x in enumerate(o):
            if x < low:
                try:
                    text = tok.decode_bytes([x]).decode("utf-8")
                except UnicodeDecodeError:
                    continue
                if len(text) >= 2:
                    cand.append((k, text))
        k, text = rng.choice(cand)
        pieces = [i for ch in text for i in tok.encode_ordinary(ch)]
        return o[:k] + pieces + o[k + 1 :]

    rows = pick_rows(table, 80, lambda r: r["n_tool_calls"] == 0)
    # The split ids decode to the same bytes: text_agreement (not allowed here) rightly stays silent.
    report = assert_caught(mutate(table, rows, split), rows, tok, ids, "round_trip", allowed={"billing_agreement"})
    rt = report.result("round_trip")
    assert rt.details["problems"] == {"non_canonical": 80}
    # Reconstructed rows block; a server's own returned ids only warn by default.
    origins = table.column("ids_origin").to_pylist()
    n_rec = sum(origins[r] == "reconstructed" for r in rows)
    assert rt.by_origin["reconstructed"]["failing"] == n_rec and rt.by_origin["returned"]["action"] == "warn"
    assert rt.excluded == n_rec and rt.blocking


def _off_by_one_ordinary(tok, seed):
    low = _lowest_special(tok)
    rng = random.Random(seed)

    def one(o, r):
        k = rng.choice([k for k, x in enumerate(o) if 0 < x < low - 1])
        o[k] += rng.choice([-1, 1])
        return o

    return one


def test_off_by_one_ordinary_id_is_always_caught(env):
    """One ordinary id moved by ±1 lands on another ordinary token, usually canonical too, so round_trip sees only
    a fraction; the decoded bytes always change, so text_agreement catches every reconstructed row."""
    tok, ids, table = env
    rows = pick_rows(table, 300, _reconstructed)
    bad = mutate(table, rows, _off_by_one_ordinary(tok, 5))
    report = assert_caught(bad, rows, tok, ids, TEXT, allowed={"round_trip", "tool_sections_valid"})
    res = report.result(TEXT)
    assert res.failing == len(rows) and res.details["problems"] == {"digest_mismatch": len(rows)}
    assert res.blocking and res.excluded == len(rows) and TEXT in report.blocking_failed
    assert res.examples[0]["problem"].startswith("output_ids decode to")
    # round_trip alone: the rate docs/audit.md quotes (about 15%), far from every row.
    assert 0.05 * len(rows) <= report.result("round_trip").failing < 0.5 * len(rows)


def test_off_by_one_special_id_is_always_caught(env):
    """A structural id (</think>, <|im_end|>, a tool marker) moved by ±1 becomes another token with another string."""
    tok, ids, table = env
    low = _lowest_special(tok)
    rng = random.Random(9)

    def one(o, r):
        k = rng.choice([k for k, x in enumerate(o) if x >= low])
        o[k] += rng.choice([-1, 1])
        return o

    rows = pick_rows(table, 300, _reconstructed)
    # Which structural gate also fires depends on the neighbour the id landed on.
    others = set(GATE_NAMES) - {TEXT, "billing_agreement", "not_truncated"}
    report = assert_caught(mutate(table, rows, one), rows, tok, ids, TEXT, allowed=others)
    assert report.result(TEXT).details["problems"] == {"digest_mismatch": len(rows)}


def test_off_by_one_on_returned_ids_is_not_text_checked(env):
    """Returned rows carry no text digest: text_agreement does not check them (round_trip still warns on some)."""
    tok, ids, table = env
    rows = pick_rows(table, 100, _returned)
    bad = mutate(table, rows, _off_by_one_ordinary(tok, 6))
    res = run_gate(TEXT, bad, tok, ids)
    assert res.failing == 0 and "returned" not in res.by_origin
    assert res.checked == sum(_reconstructed(r) for r in table.to_pylist())


def test_whole_row_shifted_by_one(env):
    tok, ids, table = env
    low = _lowest_special(tok)
    rows = pick_rows(table, 300)
    shifted = mutate(table, rows, lambda o, r: [x + 1 if x < low - 1 else x for x in o])
    report = assert_caught(shifted, rows, tok, ids, "round_trip", exact=False, allowed={"tool_sections_valid", TEXT})
    assert report.result("round_trip").failing >= 0.95 * len(rows)
    origins = np.array(table.column("ids_origin").to_pylist())
    assert report.result(TEXT).row_fail[rows].tolist() == (origins[rows] == "reconstructed").tolist()


@pytest.mark.parametrize("kind", ["past_vocab", "far_past_vocab", "negative", "reserved", "pad", "im_user"])
def test_id_not_in_vocab(env, kind):
    tok, ids, table = env
    bad_id = {
        "past_vocab": tok.vocab_size,
        "far_past_vocab": 2**31 - 1,
        "negative": -1,
        "reserved": next(v for k, v in tok.special_tokens.items() if "reserved" in k),
        "pad": tok.special_tokens["[PAD]"],
        "im_user": tok.special_tokens["<|im_user|>"],
    }[kind]
    low = _lowest_special(tok)
    rng = random.Random(6)

    def replace(o, r):
        o[rng.choice([k for k, x in enumerate(o) if x < low])] = bad_id
        return o

    rows = pick_rows(table, 40)
    # The bad id splits an ordinary run in two; each half may not be canonical alone, or may break tool JSON.
    report = assert_caught(
        mutate(table, rows, replace),
        rows,
        tok,
        ids,
        "ids_in_vocab",
        allowed={"round_trip", "tool_sections_valid", TEXT},
    )
    details = report.result("ids_in_vocab").details
    key = {
        "past_vocab": "out_of_range",
        "far_past_vocab": "out_of_range",
        "negative": "out_of_range",
        "reserved": "reserved_or_unassigned",
        "pad": "non_output_special",
        "im_user": "non_output_special",
    }[kind]
    assert details[key] == 40
    example = report.result("ids_in_vocab").examples[0]["excerpt"]
    assert ("⟦<?" in example) if key == "out_of_range" else ("⟦<|" in example or "⟦[PAD]⟧" in example)


def test_billing_mismatch(env):
    tok, ids, table = env
    rows = pick_rows(table, 600, lambda r: r["usage_completion_tokens"] is not None)
    lengths = {r: len(o) for r, o in enumerate(table.column("output_ids").to_pylist())}
    bad = mutate(table, rows, lambda o, r: o, usage_completion_tokens=lambda u, r: round(lengths[r] * 1.1))
    report = assert_caught(bad, rows, tok, ids, "billing_agreement", exact=False)
    res = report.result("billing_agreement")
    assert not res.passed and res.blocking and "billing_agreement" in report.blocking_failed
    assert res.details["aggregate_relative_error"] > 0.03
    # Per-row verdicts follow the documented tolerance, max(2, 1% of usage).
    expected = [r for r in rows if abs(lengths[r] - round(lengths[r] * 1.1)) > max(2, 0.01 * round(lengths[r] * 1.1))]
    assert np.flatnonzero(res.row_fail).tolist() == expected
    # The split by backend/provider shows where the disagreement lives.
    assert all(v["aggregate_relative_error"] > 0.01 for v in res.by_source.values())


def test_billing_small_disagreement_passes_in_aggregate_but_lists_rows(env):
    tok, ids, table = env
    rows = pick_rows(table, 3, lambda r: r["usage_completion_tokens"] is not None and len(r["output_ids"]) > 50)
    bad = mutate(table, rows, lambda o, r: o, usage_completion_tokens=lambda u, r: u + 40)
    report = assert_caught(bad, rows, tok, ids, "billing_agreement")
    res = report.result("billing_agreement")
    assert res.passed and not res.blocking and report.passed
    assert res.failing == 3 and res.excluded == 3 and not report.filter_mask[rows].any()


def test_billing_split_by_source(env):
    tok, ids, table = env
    rows = pick_rows(table, 200, lambda r: r["backend"] == "vllm" and r["usage_completion_tokens"] is not None)
    bad = mutate(table, rows, lambda o, r: o, usage_completion_tokens=lambda u, r: u * 2 + 10)
    res = run_gate("billing_agreement", bad, tok, ids)
    assert res.by_source["vllm/-"]["aggregate_relative_error"] > 0.1
    for key, entry in res.by_source.items():
        if key.startswith("openrouter/"):
            assert entry["failing"] == 0 and entry["aggregate_relative_error"] < 0.005


def test_billing_shows_a_systematic_one_token_offset_per_source(env):
    """One token per row is within every tolerance, yet systematic: a provider that also counts a token our ids
    lack (say, a newline it stripped from the text). The per-source median makes it visible."""
    tok, ids, table = env
    rows = [
        i
        for i, r in enumerate(table.to_pylist())
        if r["usage_completion_tokens"] is not None and r["provider"] == "Moonshot"
    ]
    lengths = [len(o) for o in table.column("output_ids").to_pylist()]
    bad = mutate(table, rows, lambda o, r: o, usage_completion_tokens=lambda u, r: lengths[r] + 1)
    res = run_gate("billing_agreement", bad, tok, ids, AuditSettings(billing_aggregate_bound=0.05))
    assert res.passed and res.failing == 0
    assert res.by_source["openrouter/Moonshot"]["difference_median"] == 1.0
    assert res.by_source["openrouter/Together"]["difference_median"] == 0.0
    assert res.by_source["openrouter/Together"]["difference_min"] >= -1  # the corpus's own +-1 noise


def test_prompt_mismatch_from_an_injected_system_prompt(env):
    """A provider that prepends its own system prompt bills a longer prompt than the one we rendered; the gate
    names the rows, warns without blocking or excluding, and the split by source shows a constant offset."""
    tok, ids, table = env
    rows = [
        i
        for i, r in enumerate(table.to_pylist())
        if r["usage_prompt_tokens"] is not None and r["provider"] == "Together"
    ]
    assert len(rows) > 50
    bad = mutate(table, rows, lambda o, r: o, usage_prompt_tokens=lambda u, r: u + 37)
    report = assert_caught(bad, rows, tok, ids, "prompt_agreement")
    res = report.result("prompt_agreement")
    assert res.failing == len(rows) and not res.passed and not res.blocking and res.excluded == 0 and report.passed
    assert res.by_source["openrouter/Together"]["difference_median"] == 37.0
    assert res.by_source["openrouter/Moonshot"]["difference_max"] == 0
    assert "usage_prompt_tokens" in res.examples[0]["problem"] and "+37" in res.examples[0]["problem"]
    # The example shows the head of the prompt, not of the output.
    assert res.examples[0]["excerpt"].startswith("prompt: <|im_")


def test_prompt_mismatch_from_json_instead_of_typescript_tools(env):
    """Prompts rendered with the tools as compact JSON (what a template without Moonshot's tool declarations gives)
    disagree with a provider that rendered the TypeScript declarations: only the tool dataset's rows."""
    from eagle_pipeline.tokens import render_prompt_ids

    from .corpus import TOOLS

    tok, ids, table = env
    rows = pick_rows(table, 40, lambda r: r["dataset_has_tools"] and r["usage_prompt_tokens"] is not None)
    text_of = {r: tok.decode(p) for r, p in enumerate(table.column("prompt_ids").to_pylist())}

    def as_json(prompt, r):
        user = text_of[r].split("<|im_user|>user<|im_middle|>", 1)[1].split("<|im_end|>", 1)[0]
        thinking = text_of[r].endswith("<think>")
        return render_prompt_ids(tok, [{"role": "user", "content": user}], TOOLS, thinking=thinking, tools_ts_str=None)

    bad = mutate(table, rows, lambda o, r: o, prompt_ids=as_json)
    report = assert_caught(bad, rows, tok, ids, "prompt_agreement")
    assert report.result("prompt_agreement").details["difference_min"] != 0


def test_prompt_agreement_tolerance_and_unknown_prompts(env):
    tok, ids, table = env
    rows = pick_rows(table, 30, lambda r: r["usage_prompt_tokens"] is not None)
    bad = mutate(table, rows, lambda o, r: o, usage_prompt_tokens=lambda u, r: u - 1)
    assert run_gate("prompt_agreement", bad, tok, ids).failing == 30
    assert run_gate("prompt_agreement", bad, tok, ids, AuditSettings(prompt_row_abs_tolerance=1)).failing == 0
    # Rows without prompt ids (a prompt the pipeline does not know) are not checked.
    unknown = mutate(bad, rows, lambda o, r: o, prompt_ids=lambda p, r: [])
    res = run_gate("prompt_agreement", unknown, tok, ids)
    assert res.failing == 0 and res.checked == run_gate("prompt_agreement", table, tok, ids).checked - 30
    # Files written before the column existed: the gate says so and checks nothing.
    old = table.drop_columns(["usage_prompt_tokens"])
    res = run_gate("prompt_agreement", old, tok, ids)
    assert res.checked == 0 and res.details["usage_prompt_tokens_column"] == "absent"


@pytest.mark.parametrize(
    "kind",
    [
        "drop_section_end",
        "drop_call_end",
        "bad_json",
        "args_not_object",
        "id_with_space",
        "empty_id",
        "id_without_index",
        "two_sections",
        "section_inside_reasoning",
        "count_mismatch",
        "text_after_section",
    ],
)
def test_malformed_tool_section(env, kind):
    tok, ids, table = env
    expected_problem = {
        "drop_section_end": "unbalanced",
        "drop_call_end": "unbalanced",
        "bad_json": "bad_arguments",
        "args_not_object": "bad_arguments",
        "id_with_space": "bad_id",
        "empty_id": "bad_id",
        "id_without_index": "bad_id",
        "two_sections": "multiple_sections",
        "section_inside_reasoning": "before_think_close",
        "count_mismatch": "count_mismatch",
        "text_after_section": "not_at_end",
    }[kind]

    def replace_span(o, lo_marker, hi_marker, text):
        a = o.index(lo_marker) + 1
        b = o.index(hi_marker, a)
        return o[:a] + tok.encode_ordinary(text) + o[b:]

    def fn(o, r):
        if kind == "drop_section_end":
            o.remove(ids.tool_section_end_id)
        elif kind == "drop_call_end":
            o.remove(ids.tool_call_end_id)
        elif kind == "bad_json":
            o = replace_span(o, ids.tool_arg_begin_id, ids.tool_call_end_id, '{"query": "unterminated')
        elif kind == "args_not_object":
            o = replace_span(o, ids.tool_arg_begin_id, ids.tool_call_end_id, "[1, 2]")
        elif kind == "id_with_space":
            o = replace_span(o, ids.tool_call_begin_id, ids.tool_arg_begin_id, "functions.get weather:0")
        elif kind == "empty_id":
            o = replace_span(o, ids.tool_call_begin_id, ids.tool_arg_begin_id, "")
        elif kind == "id_without_index":
            o = replace_span(o, ids.tool_call_begin_id, ids.tool_arg_begin_id, "functions.get_weather")
        elif kind == "two_sections":
            a, b = o.index(ids.tool_section_begin_id), o.index(ids.tool_section_end_id)
            o = o[: b + 1] + o[a : b + 1] + o[b + 1 :]
        elif kind == "section_inside_reasoning":
            a, b = o.index(ids.tool_section_begin_id), o.index(ids.tool_section_end_id)
            section = o[a : b + 1]
            rest = o[:a] + o[b + 1 :]
            o = section + rest
        elif kind == "text_after_section":
            o = o[:-1] + tok.encode_ordinary(" trailing") + o[-1:]
        return o

    pred = (
        (lambda r: r["n_tool_calls"] > 0 and r["thinking"])
        if kind == "section_inside_reasoning"
        else (lambda r: r["n_tool_calls"] > 0)
    )
    rows = pick_rows(table, 30, pred)
    extra = {"n_tool_calls": lambda v, r: v + 1} if kind == "count_mismatch" else {}
    bad = mutate(table, rows, fn if kind != "count_mismatch" else (lambda o, r: o), **extra)
    # count_mismatch leaves the ids alone, so text_agreement stays silent there.
    allowed = {"billing_agreement"} | (set() if kind == "count_mismatch" else {TEXT})
    report = assert_caught(bad, rows, tok, ids, "tool_sections_valid", allowed=allowed)
    res = report.result("tool_sections_valid")
    assert res.details["problems"] == {expected_problem: 30}
    assert res.examples[0]["problem"] == expected_problem
    # A malformed call is a property of the sample: filtered, not blocking, by default.
    assert res.action == "filter" and not res.blocking and res.excluded == 30


def test_tool_tokens_in_dataset_without_tools(env):
    tok, ids, table = env
    rows = pick_rows(table, 40, lambda r: r["n_tool_calls"] > 0)
    bad = mutate(table, rows, lambda o, r: o, dataset_has_tools=lambda v, r: False)
    report = assert_caught(bad, rows, tok, ids, "tool_tokens_declared")
    res = report.result("tool_tokens_declared")
    origins = table.column("ids_origin").to_pylist()
    n_returned = sum(origins[r] == "returned" for r in rows)
    assert res.by_origin["reconstructed"]["action"] == "block" and res.by_origin["returned"]["action"] == "filter"
    assert res.blocking == (n_returned < len(rows)) and res.excluded == len(rows)


def test_truncated_rows_are_filtered_and_nothing_else_fires(env):
    """Cut generations fail only not_truncated: the structural gates relax for rows that did not finish."""
    tok, ids, table = env
    rng = random.Random(8)
    cut_rows = pick_rows(table, 60, lambda r: len(r["output_ids"]) > 8, seed=2)
    reasons = ["length", "content_filter", "error", "abort", None]
    cuts = {r: rng.randint(1, len(table.column("output_ids")[r]) - 2) for r in cut_rows}
    outputs = table.column("output_ids").to_pylist()
    # A reconstructed cut row's digest is that of its (cut) text, i.e. of the bytes its ids decode to.
    cut_digest = {r: text_hash_int64(tok.decode_bytes(outputs[r][: -cuts[r]])) for r in cut_rows}
    bad = mutate(
        table,
        cut_rows,
        lambda o, r: o[: -cuts[r]],
        finish_reason=lambda v, r: reasons[r % len(reasons)],
        usage_completion_tokens=lambda u, r: None if u is None else u - cuts[r],
        output_text_hash=lambda v, r: None if v is None else cut_digest[r],
    )
    report = assert_caught(bad, cut_rows, tok, ids, "not_truncated")
    res = report.result("not_truncated")
    assert report.passed and not res.blocking
    assert report.excluded_counts == {"not_truncated": 60}
    assert np.flatnonzero(~report.filter_mask).tolist() == cut_rows
    assert sum(res.details["finish_reasons"].values()) == 60 and "null" in res.details["finish_reasons"]


def test_all_gate_names_exercised():
    """Every gate is the intended catcher of at least one mutation above."""
    import inspect
    import sys

    source = inspect.getsource(sys.modules[__name__])
    for name in GATE_NAMES:
        assert f'"{name}"' in source


def test_warn_override_keeps_rows_and_does_not_block(env):
    tok, ids, table = env
    rows = pick_rows(table, 10, _returned)  # returned ids: no text digest, so only single_eot sees the extra eot
    bad = mutate(table, rows, lambda o, r: o + [ids.eot_id])
    report = run_audit(bad, tok, ids, AuditSettings(actions={"single_eot": "warn"}))
    res = report.result("single_eot")
    assert res.failing == 10 and not res.passed and not res.blocking and res.excluded == 0
    assert report.passed and report.filter_mask.all()
