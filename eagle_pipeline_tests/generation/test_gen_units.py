"""Unit tests: specs, failure classification, body parsing, the simulated answer generator."""

from __future__ import annotations

import dataclasses
import email.utils
import json
import time

import pyarrow as pa
import pytest

from eagle_pipeline.generation.backends.wire import OpenRouterBackend, ParsedResponse, PromptItem, parse_chat_completion
from eagle_pipeline.generation.spec import BackendSpec, SamplingSpec
from eagle_pipeline.generation.store.rows import RESPONSES_SCHEMA, RowProvenance, error_row, response_values
from eagle_pipeline.shared import failures as F
from eagle_pipeline.shared.failures import Redactor, RequestFailure, classify_status, parse_retry_after
from eagle_pipeline.simulation import (
    Answer,
    FaultPlan,
    SimulatedOpenRouterServer,
    request_key,
    synthesize,
    truncate_answer,
)

from .generation_helpers import SEARCH_TOOL, WEATHER_TOOL


def test_backend_spec_validation_and_defaults():
    assert (
        BackendSpec(name="or", kind="openrouter", endpoint="https://openrouter.ai/api/v1").effective_concurrency == 2000
    )
    assert BackendSpec(name="v", kind="vllm", endpoint="http://h:8000/v1").effective_concurrency == 256
    assert BackendSpec(name="v", kind="vllm", endpoint="http://h:8000/v1", concurrency=7).effective_concurrency == 7
    with pytest.raises(ValueError, match="kind"):
        BackendSpec(name="x", kind="bogus", endpoint="http://h")
    with pytest.raises(ValueError, match="endpoint"):
        BackendSpec(name="x", kind="openrouter")
    with pytest.raises(ValueError, match="import_paths"):
        BackendSpec(name="x", kind="import")
    d = BackendSpec(name="s", kind="simulated", simulated={"count_completion_tokens": len}).to_dict()
    json.dumps(d)  # callables in `simulated` must not break serialisation
    # The defaults are those of the configuration file (docs/configuration.md); test_config checks both paths agree.
    sim = BackendSpec(name="s", kind="simulated")
    assert (sim.effective_concurrency, sim.max_retries, sim.kind.is_http, sim.source) == (256, 8, True, "simulated")
    assert not BackendSpec(name="i", kind="import", import_paths=("a.jsonl",)).kind.is_http
    assert SamplingSpec(seed=3).to_dict() == {
        "temperature": 0.6,
        "top_p": 0.95,
        "seed": 3,
        "max_tokens": 2048,
        "thinking": True,
    }
    assert SamplingSpec().seed == 0
    with pytest.raises(ValueError):
        SamplingSpec(max_tokens=0)


def test_parse_retry_after_seconds_fraction_and_http_date():
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after("0.25") == 0.25
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    now = time.time()
    date = email.utils.formatdate(now + 30, usegmt=True)
    assert 28.0 <= parse_retry_after(date, now=now) <= 31.0
    assert parse_retry_after(email.utils.formatdate(now - 30, usegmt=True), now=now) == 0.0


def test_classify_status():
    assert classify_status(429, "x").error_class == F.RATE_LIMIT and classify_status(429, "x").retryable
    for s in (500, 502, 503, 504):
        f = classify_status(s, "x")
        assert f.error_class == F.SERVER_ERROR and f.retryable and f.stop_reason is None
    assert (
        classify_status(408, "x").retryable
        and classify_status(409, "x").retryable
        and classify_status(425, "x").retryable
    )
    a = classify_status(401, "x")
    assert a.stop_reason == F.STOP_AUTH and not a.retryable
    assert classify_status(403, "x").stop_reason == F.STOP_AUTH
    # OpenRouter's moderation 403 concerns one prompt: recorded, not a run stop.
    m = classify_status(
        403, "flagged", error_obj={"code": 403, "metadata": {"reasons": ["violence"], "flagged_input": "..."}}
    )
    assert m.error_class == F.MODERATION and m.stop_reason is None
    c = classify_status(402, "x")
    assert c.stop_reason == F.STOP_CREDITS
    inflight = classify_status(402, "x", error_obj={"metadata": {"limit_source": "openrouter_in_flight_budget"}})
    assert inflight.retryable and inflight.stop_reason is None
    b = classify_status(400, "context too long")
    assert b.error_class == F.BAD_REQUEST and not b.retryable


def test_parse_chat_checks_error_before_choices():
    body = {
        "error": {"code": 429, "message": "Rate limit exceeded"},
        "choices": [{"message": {"content": "x"}, "finish_reason": "stop"}],
    }
    with pytest.raises(RequestFailure) as ei:
        parse_chat_completion(body, 200, want_ids=False)
    assert ei.value.error_class == F.RATE_LIMIT and ei.value.retryable and ei.value.http_status == 200
    with pytest.raises(RequestFailure) as ei:
        parse_chat_completion({"error": {"code": 502, "message": "upstream"}}, 200, want_ids=False)
    assert ei.value.error_class == F.PROVIDER_ERROR and ei.value.retryable
    with pytest.raises(RequestFailure) as ei:
        parse_chat_completion({"error": {"code": 401, "message": "bad key"}}, 200, want_ids=False)
    assert ei.value.stop_reason == F.STOP_AUTH
    with pytest.raises(RequestFailure) as ei:
        parse_chat_completion({"id": "gen-1", "choices": []}, 200, want_ids=False)
    assert ei.value.error_class == F.NO_CHOICES and ei.value.retryable
    with pytest.raises(RequestFailure) as ei:
        parse_chat_completion(
            {"choices": [{"message": {"content": "partial"}, "finish_reason": "error"}]}, 200, want_ids=False
        )
    assert ei.value.error_class == F.PROVIDER_ERROR
    with pytest.raises(RequestFailure) as ei:
        parse_chat_completion({"choices": [{"message": {"content": None}, "finish_reason": None}]}, 200, want_ids=False)
    assert ei.value.error_class == F.EMPTY_COMPLETION


def test_parse_chat_fields_and_fallbacks():
    body = {
        "id": "gen-9",
        "model": "m",
        "provider": "P",
        "choices": [
            {
                "finish_reason": "stop",
                "native_finish_reason": "end_turn",
                "message": {"role": "assistant", "content": "", "reasoning_content": "thinking..."},
            }
        ],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 9,
            "completion_tokens_details": {"reasoning_tokens": 4},
            "cost": 0.5,
        },
    }
    p = parse_chat_completion(body, 200, want_ids=False)
    # Empty content is a sample-quality outcome, not an error.
    assert (
        p.content == ""
        and p.reasoning == "thinking..."
        and p.finish_reason == "stop"
        and p.native_finish_reason == "end_turn"
    )
    assert (p.usage_prompt_tokens, p.usage_completion_tokens, p.usage_reasoning_tokens, p.cost_usd) == (5, 9, 4, 0.5)
    assert p.generation_id == "gen-9" and p.provider == "P"
    with pytest.raises(RequestFailure) as ei:
        parse_chat_completion(body, 200, want_ids=True)
    assert ei.value.error_class == F.MISSING_TOKEN_IDS and not ei.value.retryable
    spec = BackendSpec(
        name="v", kind="vllm", endpoint="http://h/v1", price_per_m_prompt=1.0, price_per_m_completion=2.0
    )
    body2 = dict(body, usage={"prompt_tokens": 1_000_000, "completion_tokens": 500_000})
    assert parse_chat_completion(body2, 200, want_ids=False, spec=spec).cost_usd == pytest.approx(2.0)


def test_openrouter_body_is_valid_json_with_settings():
    spec = BackendSpec(
        name="or",
        kind="openrouter",
        endpoint="https://openrouter.ai/api/v1",
        model="moonshotai/kimi-k2.5",
        provider={"only": ["moonshotai"], "allow_fallbacks": False},
        extra_body={"provider": {"require_parameters": True}},
    )
    be = OpenRouterBackend(spec, SamplingSpec(seed=5, max_tokens=100, thinking=False))
    msgs = json.dumps([{"role": "user", "content": 'hi "there" é'}], ensure_ascii=False)
    body = json.loads(be.build_body(PromptItem("s", msgs, json.dumps([WEATHER_TOOL])), 1))
    assert body["messages"][0]["content"] == 'hi "there" é' and body["tools"][0]["function"]["name"] == "get_weather"
    assert body["provider"] == {"only": ["moonshotai"], "allow_fallbacks": False, "require_parameters": True}
    assert body["reasoning"] == {"enabled": False} and body["max_tokens"] == 100
    assert body["seed"] == SamplingSpec(seed=5).request_seed("s") != 5  # each sample's own seed
    # Streaming is on by default for OpenRouter (docs/generation.md); `stream: false` turns it off.
    assert body["usage"] == {"include": True} and body["stream"] is True and "stream_options" not in body
    plain = OpenRouterBackend(dataclasses.replace(spec, stream=False), SamplingSpec())
    assert json.loads(plain.build_body(PromptItem("s", msgs, None), 1))["stream"] is False
    assert "tools" not in json.loads(be.build_body(PromptItem("s", msgs, None), 1))
    assert be.url == "https://openrouter.ai/api/v1/chat/completions"


def test_redactor_removes_key_and_bearer_tokens():
    r = Redactor(["sk-or-v1-SECRETSECRET"])
    assert "SECRET" not in r("key sk-or-v1-SECRETSECRET echoed")
    assert r("Authorization: Bearer abc.def-123") == "Authorization: Bearer ***"
    assert r(None) is None and r("") == ""


def test_synthesize_is_deterministic_and_refers_to_prompt():
    msgs = [{"role": "user", "content": "Explain glacier formation in the Alps"}]
    k = request_key(msgs, 1)
    a, b = synthesize(msgs, None, k), synthesize(msgs, None, k)
    assert a == b
    assert "glacier formation" in a.reasoning and a.content and a.finish_reason == "stop"
    assert synthesize(msgs, None, request_key(msgs, 2)) != a
    assert synthesize(msgs, None, k, thinking=False).reasoning == ""


def test_synthesize_tool_calls_follow_schema():
    n_calls = 0
    for i in range(60):
        msgs = [{"role": "user", "content": f"What's the weather like for trip {i}?"}]
        ans = synthesize(msgs, [WEATHER_TOOL, SEARCH_TOOL], request_key(msgs, 0))
        if not ans.tool_calls:
            continue
        n_calls += 1
        assert ans.finish_reason == "tool_calls"
        for j, tc in enumerate(ans.tool_calls):
            name = tc["function"]["name"]
            assert tc["id"] == f"functions.{name}:{j}" and tc["type"] == "function"
            args = json.loads(tc["function"]["arguments"])
            if name == "get_weather":
                assert isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit")
                assert "days" not in args or 1 <= args["days"] <= 7
            else:
                assert isinstance(args["query"], str)
    assert 20 <= n_calls <= 50  # ~60% of prompts that offer tools
    # After a tool result the model answers instead of calling again.
    msgs = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "functions.get_weather:0"},
    ]
    assert not synthesize(msgs, [WEATHER_TOOL], request_key(msgs, 0)).tool_calls


def test_truncate_answer_respects_counter():
    count = lambda r, c, t: len(r) + len(c) + 10 * len(t)  # noqa: E731
    ans = Answer("r" * 50, "c" * 50, [], "stop")
    assert truncate_answer(ans, 200, count) is ans
    cut = truncate_answer(ans, 70, count)
    assert cut.finish_reason == "length" and cut.reasoning == "r" * 50 and cut.content == "c" * 20
    cut = truncate_answer(ans, 30, count)
    assert cut.reasoning == "r" * 30 and cut.content == ""  # reasoning consumed the whole budget


def test_fault_plan_selection():
    with pytest.raises(ValueError, match="unknown"):
        FaultPlan({"http_999": 1.0})
    p = FaultPlan({"http_500": 1.0, "fail_first_n_attempts": 2})
    assert (
        p.status_fault("k", 1, 1) == "http_500"
        and p.status_fault("k", 2, 2) == "http_500"
        and p.status_fault("k", 3, 3) is None
    )
    p = FaultPlan({"select": {"http_502": ["a"]}, "after_requests": {"http_401": 5}})
    assert p.status_fault("a", 1, 1) == "http_502" and p.status_fault("b", 1, 1) is None
    assert p.status_fault("b", 9, 6) == "http_401"
    hits = sum(FaultPlan({"length": 0.3}).quality_faults(f"k{i}", 0) == {"length"} for i in range(1000))
    assert 230 <= hits <= 370


def test_simulated_usage_uses_given_counters():
    srv = SimulatedOpenRouterServer(
        count_completion_tokens=lambda r, c, t: 1000 + len(r) + len(c),
        count_prompt_tokens=lambda m, t, th: 77,
        price_per_m_prompt=1.0,
        price_per_m_completion=2.0,
    )
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hello there world"}],
        "seed": 1,
        "max_tokens": 100000,
    }
    out = srv.answer(body)
    msg = out["choices"][0]["message"]
    u = out["usage"]
    assert u["prompt_tokens"] == 77
    assert u["completion_tokens"] == 1000 + len(msg["reasoning"]) + len(msg["content"])
    assert u["completion_tokens_details"]["reasoning_tokens"] == 1000 + len(msg["reasoning"])
    assert u["cost"] == pytest.approx((77 * 1.0 + u["completion_tokens"] * 2.0) / 1e6)
    assert out["id"].startswith("gen-") and out["provider"] == "Simulated"
    assert (
        msg["reasoning_details"][0]["type"] == "reasoning.text"
        and msg["reasoning_details"][0]["text"] == msg["reasoning"]
    )
    # max_tokens below the answer's size: finish 'length', usage within the cap.
    out = srv.answer(dict(body, max_tokens=1010))
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] <= 1010


def test_response_row_builder_fills_every_column_from_its_source():
    prov = RowProvenance("B3", "vllm", "be", "http://h/v1", "fallback-model", "fp8", '{"seed":1}', False)
    parsed = ParsedResponse(
        model=None,
        provider="P",
        reasoning="r",
        content="c",
        tool_calls_json="[]",
        prompt_token_ids=[1, 2],
        output_token_ids=[3],
        finish_reason="stop",
        native_finish_reason="eos",
        usage_prompt_tokens=2,
        usage_completion_tokens=1,
        usage_reasoning_tokens=0,
        cost_usd=0.5,
        generation_id="g",
    )
    item = PromptItem("sid", "[]", None)
    values = response_values(
        prov, item, parsed, latency_s=1.5, attempts=2, started_us=10, finished_us=20, raw_response_json="{}"
    )
    row = pa.table({n: [v] for n, v in zip(RESPONSES_SCHEMA.names, values)}, schema=RESPONSES_SCHEMA).to_pylist()[0]
    expected = {
        "sample_id": "sid",
        "dataset": "B3",
        "messages_json": "[]",
        "tools_json": None,
        "source": "vllm",
        "backend": "be",
        "endpoint": "http://h/v1",
        "model": "fallback-model",  # the response named none
        "provider": "P",
        "quantization": "fp8",
        "reasoning": "r",
        "content": "c",
        "tool_calls_json": "[]",
        "prompt_token_ids": [1, 2],
        "output_token_ids": [3],
        "finish_reason": "stop",
        "native_finish_reason": "eos",
        "usage_prompt_tokens": 2,
        "usage_completion_tokens": 1,
        "usage_reasoning_tokens": 0,
        "cost_usd": 0.5,
        "generation_id": "g",
        "sampling_json": '{"seed":1}',
        "thinking": False,
        "latency_s": 1.5,
        "attempts": 2,
        "raw_response_json": "{}",
    }
    assert len(values) == len(RESPONSES_SCHEMA) and {k: row[k] for k in expected} == expected
    assert [row["started_at"].microsecond, row["finished_at"].microsecond] == [10, 20]
    err = error_row(
        sample_id="sid",
        dataset="B3",
        backend="be",
        error_class="auth",
        http_status=401,
        message="key sk-SECRET-123 rejected " + "x" * 2000,
        attempts=1,
        redact=Redactor(["sk-SECRET-123"]),
    )
    assert err["message"].startswith("key *** rejected") and len(err["message"]) <= 1000
