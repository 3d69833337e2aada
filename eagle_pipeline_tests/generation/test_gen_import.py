"""The import source: responses from files, matched to prompts, coexisting with live rows in one dataset."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from eagle_pipeline.generation.importing.response_lines import ResponseLinesError, read_response_lines
from eagle_pipeline.generation.spec import BackendSpec
from eagle_pipeline.generation.store.shards import read_errors, read_responses
from eagle_pipeline.simulation import SimulatedOpenRouterServer

from .generation_helpers import SAMPLING, make_prompts, out_dirs, run, sim_backend


def _body(content: str, **extra) -> dict:
    return {
        "id": f"gen-imported-{content[:8]}",
        "model": "moonshotai/kimi-k2.5",
        "provider": "Moonshot AI",
        "created": 1767225600,
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "native_finish_reason": "stop",
                "message": {"role": "assistant", "content": content, "reasoning": f"thinking about {content}"},
            }
        ],
        "usage": {
            "prompt_tokens": 11,
            "completion_tokens": 22,
            "completion_tokens_details": {"reasoning_tokens": 5},
            "cost": 0.001,
        },
        **extra,
    }


def test_jsonl_import_matching_and_coexistence_with_live_rows(tmp_path):
    prompts = make_prompts(10)
    rows = prompts.to_pylist()
    path = tmp_path / "old.jsonl"
    lines = [
        {"sample_id": rows[0]["sample_id"], "response": _body("by sample id")},
        {"source_id": rows[1]["source_id"], "response": _body("by source id")},
        {"messages": json.loads(rows[2]["messages_json"]), "response": _body("by messages")},
        # A bare chat-completion body carrying the prompt's messages beside `choices`.
        {**_body("bare body"), "messages": json.loads(rows[3]["messages_json"])},
        # vLLM body with ids: kept.
        {
            "sample_id": rows[4]["sample_id"],
            "response": {
                **_body("with ids", prompt_token_ids=[1, 2, 3]),
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "token_ids": [7, 8, 9],
                        "message": {"role": "assistant", "content": "with ids", "reasoning": "r"},
                    }
                ],
            },
        },
        {"sample_id": rows[0]["sample_id"], "response": _body("duplicate of the first")},
        {"sample_id": "B1-nosuchprompt", "response": _body("unmatched")},
        {"sample_id": rows[5]["sample_id"], "response": {"error": {"code": 502, "message": "upstream"}}},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n{not json\n")
    imp = BackendSpec(name="legacy", kind="import", import_paths=(str(path),))
    s = run(prompts, imp, tmp_path)
    assert (s.completed, s.skipped_duplicates, s.requested) == (5, 1, 6)
    assert s.errors_by_class == {"import_invalid": 2, "import_unmatched": 1} and s.failed == 3
    out, err = out_dirs(tmp_path)
    t = read_responses(out)
    got = {r["sample_id"]: r for r in t.to_pylist()}
    assert {got[rows[i]["sample_id"]]["content"] for i in range(5)} == {
        "by sample id",
        "by source id",
        "by messages",
        "bare body",
        "with ids",
    }
    r0 = got[rows[0]["sample_id"]]
    assert (
        r0["source"] == "import"
        and r0["backend"] == "legacy"
        and r0["provider"] == "Moonshot AI"
        and r0["attempts"] == 0
    )
    assert (
        r0["reasoning"] == "thinking about by sample id"
        and r0["usage_completion_tokens"] == 22
        and r0["cost_usd"] == 0.001
    )
    assert r0["messages_json"] == rows[0]["messages_json"] and json.loads(r0["sampling_json"]) == SAMPLING.to_dict()
    r4 = got[rows[4]["sample_id"]]
    assert r4["prompt_token_ids"] == [1, 2, 3] and r4["output_token_ids"] == [7, 8, 9]
    e = read_errors(err)
    msgs = e.column("message").to_pylist()
    assert any("old.jsonl:7" in m for m in msgs) and any("old.jsonl:9" in m for m in msgs)
    assert rows[5]["sample_id"] in e.column("sample_id").to_pylist()

    # Re-importing changes nothing; a live backend fills in exactly the rest.
    s2 = run(prompts, imp, tmp_path)
    assert s2.completed == 0 and s2.already_done == 5
    with SimulatedOpenRouterServer() as srv:
        s3 = run(prompts, sim_backend(srv.url), tmp_path)
        assert srv.total_requests == 5
    assert s3.completed == 5
    t = read_responses(out)
    assert t.num_rows == 10 and len(set(t.column("sample_id").to_pylist())) == 10
    assert sorted(t.column("source").to_pylist()) == ["import"] * 5 + ["simulated"] * 5


def test_parquet_import_of_an_earlier_run(tmp_path):
    prompts = make_prompts(6, tools_every=2)
    with SimulatedOpenRouterServer() as srv:
        run(prompts, sim_backend(srv.url), tmp_path / "elsewhere")
    src = read_responses(out_dirs(tmp_path / "elsewhere")[0])
    f = tmp_path / "export.parquet"
    pq.write_table(src.slice(0, 4), f)
    s = run(prompts, BackendSpec(name="pq", kind="import", import_paths=(str(f),)), tmp_path / "here")
    assert (s.completed, s.failed) == (4, 0)
    t = read_responses(out_dirs(tmp_path / "here")[0])
    before = {r["sample_id"]: r for r in src.to_pylist()}
    for r in t.to_pylist():
        b = before[r["sample_id"]]
        assert r["source"] == "import" and r["backend"] == "pq"
        for col in (
            "content",
            "reasoning",
            "tool_calls_json",
            "generation_id",
            "usage_completion_tokens",
            "raw_response_json",
            "finished_at",
            "endpoint",
            "attempts",
            "provider",
            "latency_s",
        ):
            assert r[col] == b[col], col


def test_the_import_and_reconstruct_read_a_record_by_one_rule(tmp_path):
    """A record's body is its `response` (an object, or that object as JSON text) or the record itself: the import
    backend and `eagle-pipeline reconstruct` read both forms alike (one reader, `response_lines.record_body`)."""
    prompts = make_prompts(3)
    rows = prompts.to_pylist()
    records = [
        {"sample_id": rows[0]["sample_id"], "response": _body("as an object")},
        {"sample_id": rows[1]["sample_id"], "response": json.dumps(_body("as JSON text"))},
        {"sample_id": rows[2]["sample_id"], **_body("as the record itself")},
    ]
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))

    s = run(prompts, BackendSpec(name="legacy", kind="import", import_paths=(str(path),)), tmp_path)
    assert (s.completed, s.failed) == (3, 0), s.errors_by_class
    imported = {r["sample_id"]: r["content"] for r in read_responses(out_dirs(tmp_path)[0]).to_pylist()}
    read, line_numbers, skipped = read_response_lines(path, "B1", skip_unusable=False)
    assert (line_numbers, skipped) == ([1, 2, 3], 0)
    reconstructed = {r["sample_id"]: r["content"] for r in read}
    assert (
        imported
        == reconstructed
        == {
            rows[0]["sample_id"]: "as an object",
            rows[1]["sample_id"]: "as JSON text",
            rows[2]["sample_id"]: "as the record itself",
        }
    )


def test_a_response_that_is_no_body_is_refused_by_both_readers(tmp_path):
    prompts = make_prompts(2)
    rows = prompts.to_pylist()
    path = tmp_path / "answers.jsonl"
    path.write_text(
        json.dumps({"sample_id": rows[0]["sample_id"], "response": 5})
        + "\n"
        + json.dumps({"sample_id": rows[1]["sample_id"], "response": "{not json"})
        + "\n"
    )
    s = run(prompts, BackendSpec(name="legacy", kind="import", import_paths=(str(path),)), tmp_path)
    assert (s.completed, s.errors_by_class) == (0, {"import_invalid": 2})
    messages = sorted(read_errors(out_dirs(tmp_path)[1]).column("message").to_pylist())
    assert "answers.jsonl:1: ValueError: 'response' must be the chat-completion body (an object)" in messages[0]
    assert "answers.jsonl:2: ValueError: 'response' is a string but not JSON" in messages[1]
    with pytest.raises(ResponseLinesError, match=r"answers.jsonl:1: 'response' must be the chat-completion body"):
        read_response_lines(path, "B1", skip_unusable=True)
