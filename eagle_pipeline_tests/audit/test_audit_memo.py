"""The token-samples step's encoding memo: the audit's round trip takes the encodings reconstruction made instead of
running the BPE again, with the same report, and still catches ids that are not what reconstruction made."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from eagle_pipeline.audit import run_audit
from eagle_pipeline.tokens import EncodingMemo, get_profile, reconstruct_table

CALLS = json.dumps(
    [{"id": "functions.lookup:0", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}]
)


@pytest.fixture(params=["kimi", "demo"])
def env(request):
    tok = request.getfixturevalue(f"{request.param}_tok")
    return tok, get_profile("kimi-k2.5").resolve(tok)


def _responses(tok, n: int = 40) -> pa.Table:
    """n answers (reasoning, content, some tool calls, CJK, a literal special string) and one row of returned ids."""
    rows = []
    for i in range(n):
        rows.append(
            {
                "sample_id": f"s{i:03d}",
                "messages_json": json.dumps([{"role": "user", "content": f"question {i}"}]),
                "reasoning": f"Step {i}: the cache misses, so the index is rebuilt. 漢字 {i * 7} times.",
                "content": f"Answer {i}." + (" It says <|im_end|> literally." if i % 9 == 0 else ""),
                "tool_calls_json": CALLS if i % 4 == 0 else None,
                "output_token_ids": None,
            }
        )
    rows.append(
        {
            "sample_id": "s-returned",
            "messages_json": json.dumps([{"role": "user", "content": "hi"}]),
            "reasoning": None,
            "content": None,
            "tool_calls_json": None,
            "output_token_ids": tok.encode_with_specials("think</think>Hi there<|im_end|>"),
        }
    )
    n_all = len(rows)
    return pa.table(
        {
            "sample_id": [r["sample_id"] for r in rows],
            "dataset": ["B1"] * n_all,
            "source": ["openrouter"] * n_all,
            "backend": ["or"] * n_all,
            "messages_json": [r["messages_json"] for r in rows],
            "reasoning": pa.array([r["reasoning"] for r in rows], pa.string()),
            "content": pa.array([r["content"] for r in rows], pa.string()),
            "tool_calls_json": pa.array([r["tool_calls_json"] for r in rows], pa.string()),
            "output_token_ids": pa.array([r["output_token_ids"] for r in rows], pa.list_(pa.int32())),
            "finish_reason": ["stop"] * n_all,
        }
    )


def _count_encodes(monkeypatch, tok) -> list[str]:
    """Every text the tokenizer's backend is asked to encode ordinarily from now on."""
    seen: list[str] = []
    backend = tok._backend
    plain, flagged = backend.encode_ordinary_arrays, backend.encode_ordinary_arrays_flagged

    def arrays(texts):
        seen.extend(texts)
        return plain(texts)

    def arrays_flagged(texts, flag):
        seen.extend(texts)
        return flagged(texts, flag)

    monkeypatch.setattr(backend, "encode_ordinary_arrays", arrays)
    monkeypatch.setattr(backend, "encode_ordinary_arrays_flagged", arrays_flagged)
    return seen


def test_the_audit_encodes_only_what_reconstruction_did_not(env, monkeypatch):
    tok, ids = env
    resp = _responses(tok)
    table = reconstruct_table(resp, tok, "kimi-k2.5", dataset_has_tools=True)
    plain = run_audit(table, tok, ids)

    memo = EncodingMemo()
    seen = _count_encodes(monkeypatch, tok)
    again = reconstruct_table(resp, tok, "kimi-k2.5", dataset_has_tools=True, memo=memo)
    assert again.equals(table)
    by_reconstruction = len(seen)
    assert len(memo) == len(set(seen[:by_reconstruction])) > 0
    seen.clear()
    with_memo = run_audit(table, tok, ids, memo=memo)

    assert with_memo.to_dict() == plain.to_dict()
    assert with_memo.result("round_trip").checked == table.num_rows and plain.passed
    # The round trip re-encoded only the spans of the row whose ids the server returned: "think" and "Hi there".
    assert sorted(seen) == ["Hi there", "think"]
    assert memo.encoded == 2 and memo.hits >= by_reconstruction - 1


def test_ids_that_are_not_what_reconstruction_made_still_fail(env):
    """A memo from the clean table; the audited table's row 1 holds one token spelled as its characters' tokens (the
    same text, non-canonical BPE): the round trip flags it with the memo exactly as without."""
    tok, ids = env
    resp = _responses(tok)
    memo = EncodingMemo()
    table = reconstruct_table(resp, tok, "kimi-k2.5", dataset_has_tools=True, memo=memo)
    out = table.column("output_ids").to_pylist()
    row = out[1]
    k = next(i for i, t in enumerate(row) if len(tok.decode_bytes([t]).decode("utf-8", "ignore")) >= 2)
    spelled = [i for ch in tok.decode_bytes([row[k]]).decode("utf-8") for i in tok.encode_ordinary(ch)]
    out[1] = row[:k] + spelled + row[k + 1 :]
    bad = table.set_column(
        table.schema.get_field_index("output_ids"), "output_ids", pa.array(out, pa.list_(pa.int32()))
    )

    plain = run_audit(bad, tok, ids).result("round_trip")
    with_memo = run_audit(bad, tok, ids, memo=memo).result("round_trip")
    assert np.flatnonzero(with_memo.row_fail).tolist() == np.flatnonzero(plain.row_fail).tolist() == [1]
    assert with_memo.details == plain.details and with_memo.details["problems"] == {"non_canonical": 1}
