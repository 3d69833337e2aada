"""Arrow layouts (slices, chunks, nulls, int64), input errors, and the Qwen3 profile on a byte-level tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from eagle_pipeline.audit import GATE_NAMES, AuditInputError, run_audit, run_gate, tool_call_id_ok
from eagle_pipeline.tokens import KIMI_PAT_STR, TOKEN_SAMPLES_SCHEMA, get_profile, reconstruct_output
from eagle_pipeline.tokens.kimi import tiktoken_tokenizer
from eagle_pipeline.tokens.text_hash import text_hash_int64

from .corpus import build_clean_table, mutate
from .helpers import assert_caught, pick_rows


@pytest.fixture(scope="module")
def demo_table(demo_tok, demo_ids):
    table = build_clean_table(demo_tok, demo_ids, 200, seed=11)
    # Known defects on fixed rows, so layouts can be compared row by row.
    bad = {3: "drop_eot", 50: "oov", 120: "double_close"}

    def fn(o, r):
        if bad[r] == "drop_eot":
            return o[:-1]
        if bad[r] == "oov":
            return [demo_tok.vocab_size + 7] + o
        k = o.index(demo_ids.think_close_id)
        return o[: k + 1] + [demo_ids.think_close_id] + o[k + 1 :]

    rows = [r for r in bad if table.column("thinking")[r].as_py() or bad[r] != "double_close"]
    return mutate(table, rows, fn)


def _fails(report):
    return {r.name: np.flatnonzero(r.row_fail).tolist() for r in report.results if r.failing}


def test_slices_and_chunks_match_contiguous(demo_table, demo_tok, demo_ids):
    full = _fails(run_audit(demo_table, demo_tok, demo_ids))
    assert full["ends_with_eot"] == [3] and full["ids_in_vocab"] == [50]
    # A slice keeps the parent's buffers with an offset; chunks must be combined correctly.
    sliced = run_audit(demo_table.slice(40, 100), demo_tok, demo_ids)
    assert {k: v for k, v in _fails(sliced).items()} == {
        k: [x - 40 for x in v if 40 <= x < 140] for k, v in full.items() if any(40 <= x < 140 for x in v)
    }
    chunked = pa.concat_tables([demo_table.slice(0, 77), demo_table.slice(77, 60), demo_table.slice(137)])
    assert chunked.column("output_ids").num_chunks == 3
    assert _fails(run_audit(chunked, demo_tok, demo_ids)) == full


def test_int64_ids_and_null_output(demo_table, demo_tok, demo_ids):
    full = _fails(run_audit(demo_table, demo_tok, demo_ids))
    wide = demo_table.set_column(
        demo_table.schema.get_field_index("output_ids"),
        "output_ids",
        demo_table.column("output_ids").cast(pa.list_(pa.int64())),
    )
    assert _fails(run_audit(wide, demo_tok, demo_ids)) == full
    outs = demo_table.column("output_ids").to_pylist()
    outs[10] = None
    nulled = demo_table.set_column(
        demo_table.schema.get_field_index("output_ids"), "output_ids", pa.array(outs, pa.list_(pa.int32()))
    )
    got = _fails(run_audit(nulled, demo_tok, demo_ids))
    assert 10 in got["ends_with_eot"] and 10 in got["single_eot"]


def test_empty_table(demo_tok, demo_ids):
    report = run_audit(TOKEN_SAMPLES_SCHEMA.empty_table(), demo_tok, demo_ids)
    assert report.passed and report.n_rows == 0 and len(report.filter_mask) == 0
    assert all(r.checked == 0 and r.failing == 0 for r in report.results)
    json.dumps(report.to_dict())


def test_input_errors_name_the_column(demo_table, demo_tok, demo_ids):
    with pytest.raises(AuditInputError, match="no column 'thinking'"):
        run_audit(demo_table.drop_columns(["thinking"]), demo_tok, demo_ids, gates=["single_think_close"])
    # A gate that does not need the column still runs.
    run_audit(demo_table.drop_columns(["thinking"]), demo_tok, demo_ids, gates=["ends_with_eot"])
    origins = demo_table.column("ids_origin").to_pylist()
    origins[5] = "guessed"
    bad = demo_table.set_column(demo_table.schema.get_field_index("ids_origin"), "ids_origin", pa.array(origins))
    with pytest.raises(AuditInputError, match="'guessed'"):
        run_audit(bad, demo_tok, demo_ids)
    thinking = demo_table.column("thinking").to_pylist()
    thinking[0] = None
    bad = demo_table.set_column(
        demo_table.schema.get_field_index("thinking"), "thinking", pa.array(thinking, pa.bool_())
    )
    with pytest.raises(AuditInputError, match="null"):
        run_audit(bad, demo_tok, demo_ids)
    bad = demo_table.set_column(
        demo_table.schema.get_field_index("output_ids"), "output_ids", pa.array(["x"] * demo_table.num_rows)
    )
    with pytest.raises(AuditInputError, match="list of integers"):
        run_audit(bad, demo_tok, demo_ids)


# ---- the text digest column -------------------------------------------------------------------------------------------


def _with_digests(table, digests, type_=None):
    type_ = type_ or pa.int64()
    i = table.schema.get_field_index("output_text_hash")
    return table.set_column(i, pa.field("output_text_hash", type_), pa.array(digests, type_))


def test_text_agreement_without_digests_checks_nothing(demo_table, demo_tok, demo_ids):
    """Files written before the column existed, or tables whose digests are all null, are not text-checked."""
    res = run_gate("text_agreement", demo_table.drop_columns(["output_text_hash"]), demo_tok, demo_ids)
    assert res.checked == 0 and res.failing == 0 and res.details["digest_column"] == "absent"
    for nulls in (
        _with_digests(demo_table, [None] * demo_table.num_rows),
        _with_digests(demo_table, [None] * demo_table.num_rows, pa.null()),
    ):
        res = run_gate("text_agreement", nulls, demo_tok, demo_ids)
        assert res.checked == 0 and res.details["rows_without_digest"] == demo_table.num_rows
        assert res.details["rows_without_digest_reconstructed"] == demo_table.column("ids_origin").to_pylist().count(
            "reconstructed"
        )


def test_text_agreement_problems(demo_table, demo_tok, demo_ids):
    outputs = demo_table.column("output_ids").to_pylist()
    digests = [text_hash_int64(demo_tok.decode_bytes(o)) if o[0] < demo_tok.vocab_size else None for o in outputs]
    digests[2] = digests[2] ^ 1  # one bit of the hash
    digests[4] = digests[5]  # another row's text
    outs = list(outputs)
    outs[6] = [demo_tok.vocab_size + 3] + outs[6]  # cannot be decoded at all
    outs[7] = [-1] + outs[7]
    table = _with_digests(demo_table, digests).set_column(
        demo_table.schema.get_field_index("output_ids"), "output_ids", pa.array(outs, pa.list_(pa.int32()))
    )
    res = run_gate("text_agreement", table, demo_tok, demo_ids)
    assert np.flatnonzero(res.row_fail).tolist() == [2, 4, 6, 7]
    assert res.details["problems"] == {"digest_mismatch": 2, "undecodable": 2}
    assert res.checked == demo_table.num_rows - 1  # row 50 (oov id) has no digest here
    # Sliced and chunked layouts give the same verdicts.
    sliced = run_gate("text_agreement", table.slice(3, 10), demo_tok, demo_ids)
    assert np.flatnonzero(sliced.row_fail).tolist() == [1, 3, 4]
    chunked = pa.concat_tables([table.slice(0, 5), table.slice(5)])
    assert np.flatnonzero(run_gate("text_agreement", chunked, demo_tok, demo_ids).row_fail).tolist() == [2, 4, 6, 7]
    with pytest.raises(AuditInputError, match="output_text_hash"):
        run_gate(
            "text_agreement", _with_digests(demo_table, ["x"] * demo_table.num_rows, pa.string()), demo_tok, demo_ids
        )


def test_text_agreement_with_an_ordinary_id_the_tokenizer_cannot_decode(demo_table, demo_tok, demo_ids):
    """A tokenizer whose undecodable ids are not all special ones: the gate checks every id, not only the rare ones."""
    from eagle_pipeline.tokens import text_hash as th

    outputs = demo_table.column("output_ids").to_pylist()
    with_hash = [i for i, h in enumerate(demo_table.column("output_text_hash").to_pylist()) if h is not None]
    first = with_hash[0]
    victim = outputs[first][0]
    assert victim < min(demo_tok.special_tokens.values())  # an ordinary id
    before = set(np.flatnonzero(run_gate("text_agreement", demo_table, demo_tok, demo_ids).row_fail).tolist())
    table = th.token_hash_table(demo_tok)
    saved = table.decodable.copy()
    try:
        table.decodable[victim] = False
        res = run_gate("text_agreement", demo_table, demo_tok, demo_ids)
    finally:
        table.decodable[:] = saved
    holding = {i for i in with_hash if victim in outputs[i]}
    assert first in holding and set(np.flatnonzero(res.row_fail).tolist()) == before | holding
    assert res.details["problems"]["undecodable"] == len(holding)


def test_text_hash_from_ids_equals_hash_of_decoded_bytes(kimi_tok, demo_tok):
    """The vectorised per-row hash equals the hash of decode_bytes for random ids of the whole vocabulary (specials
    included), empty rows, and rows spread over several of the gate's chunks."""
    from eagle_pipeline.tokens import text_hash as th

    for tok in (kimi_tok, demo_tok):
        table = th.token_hash_table(tok)
        rng = np.random.default_rng(5)
        lengths = rng.choice([0, 1, 2, 7, 300, 5000], size=400)
        values = rng.integers(0, tok.vocab_size, int(lengths.sum()), dtype=np.int32)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        got = th.ids_text_hashes(values, offsets, table)
        want = [th.text_hash(tok.decode_bytes(values[offsets[i] : offsets[i + 1]])) for i in range(400)]
        assert got.tolist() == want
    texts = [b"", b"a", "abé".encode(), b"abe", bytes(range(256)) * 40]
    assert len({th.text_hash(t) for t in texts}) == len(texts)
    # The definition, written out: sum of R[byte] * B**position mod 2**64.
    assert th.text_hash("abé".encode()) == sum(
        int(th.R[b]) * pow(th.B, i, 1 << 64) for i, b in enumerate("abé".encode())
    ) % (1 << 64)


def test_literal_special_string_encoded_as_special_id(demo_tok, demo_ids):
    """A literal `</think>` in the content must be ordinary tokens. Encoded as the special id instead, the bytes are
    the same, so the digest agrees (a limit of comparing bytes); the structural gates catch it instead."""
    rec = reconstruct_output(demo_tok, demo_ids, reasoning="r", content="say </think> now", tool_calls=None)
    wrong = demo_tok.encode_with_specials("r</think>say </think> now<|im_end|>")
    assert wrong != rec.ids and demo_tok.decode_bytes(wrong) == demo_tok.decode_bytes(rec.ids)
    table = pa.table(
        {
            "sample_id": ["ok", "wrong"],
            "dataset": ["D"] * 2,
            "source": ["x"] * 2,
            "backend": ["x"] * 2,
            "provider": [None] * 2,
            "prompt_ids": [[]] * 2,
            "output_ids": [rec.ids, wrong],
            "ids_origin": ["reconstructed"] * 2,
            "finish_reason": ["stop"] * 2,
            "usage_completion_tokens": [None] * 2,
            "usage_prompt_tokens": [None] * 2,
            "thinking": [True] * 2,
            "dataset_has_tools": [False] * 2,
            "n_tool_calls": [0] * 2,
            "literal_special": [True] * 2,
            "prompt_key": ["a", "b"],
            "output_text_hash": [rec.text_hash] * 2,
        },
        schema=TOKEN_SAMPLES_SCHEMA,
    )
    report = run_audit(table, demo_tok, demo_ids)
    assert report.result("text_agreement").failing == 0
    assert np.flatnonzero(report.result("single_think_close").row_fail).tolist() == [1] and not report.passed


def test_tool_call_id_rule():
    assert tool_call_id_ok("functions.get_weather:0") and tool_call_id_ok("functions.a.b:c:12")
    assert tool_call_id_ok("call_8f2a9c") and tool_call_id_ok("toolu_01AbC")
    for bad in ["", " ", "functions.get weather:0", "functions.get_weather", "functions.:0", "call 1", "a\tb"]:
        assert not tool_call_id_ok(bad), bad


# ---- Qwen3 profile: the model writes <think> itself, tool calls are <tool_call> JSON </tool_call> ---------------------

QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<|reserved_special_token_0|>",
]


@pytest.fixture(scope="module")
def qwen():
    # Single-byte ranks: every text encodes canonically, which is all these structural tests need.
    tok = tiktoken_tokenizer(
        name="bytes-qwen",
        kind="test",
        source="test",
        ranks={bytes([i]): i for i in range(256)},
        special_names=QWEN_SPECIALS,
        pat_str=KIMI_PAT_STR,
        chat_template=None,
    )
    ids = get_profile("qwen3").resolve(tok)
    rows = []
    for i in range(60):
        thinking = i % 4 != 0
        calls = None
        if i % 3 == 0:
            calls = [
                {"id": f"c{k}", "function": {"name": f"tool{k}", "arguments": json.dumps({"k": k})}}
                for k in range(1 + i % 2)
            ]
        content = "" if i % 5 == 0 else f"Answer {i}."
        rec = reconstruct_output(
            tok,
            ids,
            reasoning=f"reason {i}" if thinking else None,
            content=content,
            tool_calls=calls,
            thinking=thinking,
        )
        rows.append((rec, thinking, bool(calls)))
    n = len(rows)
    table = pa.table(
        {
            "sample_id": [f"q{i}" for i in range(n)],
            "dataset": ["Q"] * n,
            "source": ["vllm"] * n,
            "backend": ["vllm"] * n,
            "provider": [None] * n,
            "prompt_ids": [[]] * n,
            "output_ids": [r.ids for r, _, _ in rows],
            "ids_origin": ["reconstructed"] * n,
            "finish_reason": ["tool_calls" if c else "stop" for _, _, c in rows],
            "usage_completion_tokens": [len(r.ids) for r, _, _ in rows],
            "usage_prompt_tokens": [None] * n,
            "thinking": [t for _, t, _ in rows],
            "dataset_has_tools": [True] * n,
            "n_tool_calls": [r.n_tool_calls for r, _, _ in rows],
            "literal_special": [False] * n,
            "prompt_key": ["k"] * n,
            "output_text_hash": [r.text_hash for r, _, _ in rows],
        },
        schema=TOKEN_SAMPLES_SCHEMA,
    )
    return tok, ids, table


def test_qwen3_clean(qwen):
    tok, ids, table = qwen
    report = run_audit(table, tok, ids)
    assert {r.name: r.failing for r in report.results} == dict.fromkeys(GATE_NAMES, 0)
    assert report.result("no_think_open").details["model_opens_think"] is True
    assert report.result("tool_sections_valid").details["well_formed_calls"] == sum(
        table.column("n_tool_calls").to_pylist()
    )


def test_qwen3_missing_or_extra_think_open(qwen):
    tok, ids, table = qwen
    rows = pick_rows(table, 10, lambda r: r["thinking"])
    assert_caught(
        mutate(table, rows, lambda o, r: o[1:]),
        rows,
        tok,
        ids,
        "no_think_open",
        allowed={"reasoning_nonempty", "text_agreement"},
    )
    rows2 = pick_rows(table, 10, lambda r: not r["thinking"])
    assert_caught(
        mutate(table, rows2, lambda o, r: [ids.think_open_id] + o),
        rows2,
        tok,
        ids,
        "no_think_open",
        allowed={"text_agreement"},
    )


def test_qwen3_empty_reasoning(qwen):
    tok, ids, table = qwen
    rows = pick_rows(table, 10, lambda r: r["thinking"])

    def empty(o, r):
        k = o.index(ids.think_close_id)
        return o[:1] + tok.encode_ordinary("\n\n") + o[k:]

    assert_caught(
        mutate(table, rows, empty),
        rows,
        tok,
        ids,
        "reasoning_nonempty",
        allowed={"billing_agreement", "text_agreement"},
    )


@pytest.mark.parametrize(
    "kind, problem",
    [
        ("bad_body", "bad_arguments"),
        ("no_name", "bad_arguments"),
        ("text_between", "stray_tokens"),
        ("unclosed", "unbalanced"),
    ],
)
def test_qwen3_malformed_tool_calls(qwen, kind, problem):
    tok, ids, table = qwen

    def fn(o, r):
        a = o.index(ids.tool_call_begin_id)
        b = o.index(ids.tool_call_end_id)
        if kind == "bad_body":
            return o[: a + 1] + tok.encode_ordinary('\n{"name": "x", "arguments": \n') + o[b:]
        if kind == "no_name":
            return o[: a + 1] + tok.encode_ordinary('\n{"arguments": {}}\n') + o[b:]
        if kind == "text_between":
            return o[: b + 1] + tok.encode_ordinary(" oops ") + o[b + 1 :]
        return o[:b] + o[b + 1 :]

    rows = pick_rows(table, 8, lambda r: r["n_tool_calls"] > 0)
    report = assert_caught(
        mutate(table, rows, fn),
        rows,
        tok,
        ids,
        "tool_sections_valid",
        allowed={"billing_agreement", "text_agreement"},
    )
    problems = report.result("tool_sections_valid").details["problems"]
    if kind == "text_between":
        # Text after the first call is "stray" when another call follows, "not_at_end" when the eot follows.
        n_multi = sum(table.column("n_tool_calls")[r].as_py() > 1 for r in rows)
        assert problems == {k: v for k, v in {"stray_tokens": n_multi, "not_at_end": 8 - n_multi}.items() if v}
    else:
        assert problems == {problem: 8}
