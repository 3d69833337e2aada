"""The import source: responses from files, matched to prompts, coexisting with live rows in one dataset."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

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
