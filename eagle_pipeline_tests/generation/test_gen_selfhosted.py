"""vLLM (/v1/chat/completions + return_token_ids) and SGLang (/generate with input_ids): ids exactly as returned."""

from __future__ import annotations

import json

import pytest

from eagle_pipeline.generation.spec import BackendSpec, SamplingSpec
from eagle_pipeline.generation.store.shards import read_errors, read_responses
from eagle_pipeline.simulation import ids_key
from eagle_pipeline_tests.doubles import SimulatedSGLangServer, SimulatedVLLMServer

from .generation_helpers import SAMPLING, make_prompts, out_dirs, run, sample_key

THINK, END_THINK, EOS = 3, 4, 2


def encode(text: str) -> list[int]:
    """A byte-level toy tokenizer: ids 10..265; 0..9 are special."""
    return [b + 10 for b in text.encode("utf-8")]


def decode(ids: list[int]) -> str:
    return bytes(i - 10 for i in ids if i >= 10).decode("utf-8", errors="replace")


def render(messages, tools) -> list[int]:
    """The project's prompt rendering stand-in: role markers as special ids, content as bytes."""
    ids: list[int] = []
    for m in messages:
        ids += [5 if m["role"] == "user" else 6] + encode(m["content"] or "")
    return ids + [7]


def vllm_backend(url: str, **kw) -> BackendSpec:
    base = dict(
        name="vllm-local",
        kind="vllm",
        endpoint=url,
        model="moonshotai/Kimi-K2.5",
        concurrency=4,
        max_retries=3,
        backoff_base_s=0.01,
        backoff_max_s=0.02,
        price_per_m_prompt=0.1,
        price_per_m_completion=0.4,
    )
    return BackendSpec(**{**base, **kw})


def sglang_backend(url: str, **kw) -> BackendSpec:
    base = dict(
        name="sglang-local",
        kind="sglang",
        endpoint=url,
        model="moonshotai/Kimi-K2.5",
        concurrency=4,
        max_retries=3,
        backoff_base_s=0.01,
        backoff_max_s=0.02,
    )
    return BackendSpec(**{**base, **kw})


def test_vllm_ids_as_returned(tmp_path):
    prompts = make_prompts(12, tools_every=3)
    with SimulatedVLLMServer(
        encode=encode,
        think_start_id=THINK,
        think_end_id=END_THINK,
        eos_id=EOS,
        faults={"http_503": 0.3, "retry_after_s": 0.01},
    ) as srv:
        s = run(prompts, vllm_backend(srv.url), tmp_path)
        expected = {}
        for p in prompts.to_pylist():
            body = srv.body_for(sample_key(p["sample_id"], p["messages_json"]))
            assert body["return_token_ids"] is True and body["chat_template_kwargs"] == {"thinking": True}
            assert body["max_tokens"] == SAMPLING.max_tokens and body["seed"] == SAMPLING.request_seed(p["sample_id"])
            expected[p["sample_id"]] = srv.answer(body)
    assert (s.completed, s.failed, s.simulated) == (12, 0, False)
    t = read_responses(out_dirs(tmp_path)[0])
    for r in t.to_pylist():
        exp = expected[r["sample_id"]]
        assert r["source"] == "vllm" and r["backend"] == "vllm-local" and r["provider"] is None
        assert (
            r["prompt_token_ids"] == exp["prompt_token_ids"] and r["output_token_ids"] == exp["choices"][0]["token_ids"]
        )
        assert (
            r["output_token_ids"][0] == THINK
            and r["output_token_ids"][-1] == EOS
            and END_THINK in r["output_token_ids"]
        )
        assert r["reasoning"] == exp["choices"][0]["message"]["reasoning"] and r["reasoning"]
        assert r["usage_completion_tokens"] == len(r["output_token_ids"])
        assert r["cost_usd"] == pytest.approx(
            (r["usage_prompt_tokens"] * 0.1 + r["usage_completion_tokens"] * 0.4) / 1e6
        )
        if r["tool_calls_json"]:
            assert r["finish_reason"] == "tool_calls"


def test_vllm_reasoning_content_fallback_and_thinking_off(tmp_path):
    off = SamplingSpec(seed=1, max_tokens=512, thinking=False)
    prompts = make_prompts(3, sampling=off)
    with SimulatedVLLMServer(
        encode=encode, think_start_id=THINK, think_end_id=END_THINK, eos_id=EOS, reasoning_field="reasoning_content"
    ) as srv:
        run(prompts, vllm_backend(srv.url), tmp_path, sampling=off)
        first = prompts.slice(0, 1).to_pylist()[0]
        body = srv.body_for(sample_key(first["sample_id"], first["messages_json"], off))
    assert body["chat_template_kwargs"] == {"thinking": False}
    t = read_responses(out_dirs(tmp_path)[0])
    assert set(t.column("reasoning").to_pylist()) == {None} and set(t.column("thinking").to_pylist()) == {False}
    assert all(THINK not in ids for ids in t.column("output_token_ids").to_pylist())
    with SimulatedVLLMServer(
        encode=encode, think_start_id=THINK, think_end_id=END_THINK, eos_id=EOS, reasoning_field="reasoning_content"
    ) as srv:
        run(make_prompts(2), vllm_backend(srv.url), tmp_path / "on")
    t = read_responses(out_dirs(tmp_path / "on")[0])
    assert all(x for x in t.column("reasoning").to_pylist())  # taken from reasoning_content


def test_vllm_without_token_ids_is_a_classified_error(tmp_path):
    prompts = make_prompts(6)
    with SimulatedVLLMServer(
        encode=encode, think_start_id=THINK, think_end_id=END_THINK, eos_id=EOS, supports_token_ids=False
    ) as srv:
        s = run(prompts, vllm_backend(srv.url, circuit_breaker_failures=4), tmp_path)
        assert srv.total_requests == s.requested  # not retried: an old server stays old
    out, err = out_dirs(tmp_path)
    assert s.completed == 0 and s.errors_by_class == {"missing_token_ids": s.failed}
    assert s.stopped_reason == "circuit_breaker" and s.failed >= 4
    assert read_responses(out).num_rows == 0
    e = read_errors(err)
    assert (
        set(e.column("error_class").to_pylist()) == {"missing_token_ids"}
        and "return_token_ids" in e.column("message")[0].as_py()
    )


def test_sglang_generate_request_and_ids(tmp_path):
    prompts = make_prompts(10)
    with SimulatedSGLangServer(
        encode=encode,
        decode=decode,
        think_start_id=THINK,
        think_end_id=END_THINK,
        eos_id=EOS,
        faults={"http_500": 0.3, "error_200": 0.3},
    ) as srv:
        s = run(prompts, sglang_backend(srv.url), tmp_path, render_prompt_ids=render)
        expected = {}
        for p in prompts.to_pylist():
            ids = render(json.loads(p["messages_json"]), None)
            body = srv.body_for(ids_key(ids, SAMPLING.request_seed(p["sample_id"])))
            assert body is not None and body["input_ids"] == ids
            sp = body["sampling_params"]
            assert sp == {
                "max_new_tokens": 2048,
                "temperature": 1.0,
                "top_p": 0.95,
                "skip_special_tokens": False,
                "no_stop_trim": True,
                "sampling_seed": SAMPLING.request_seed(p["sample_id"]),
            }
            assert body["rid"].startswith(p["sample_id"] + ":")
            expected[p["sample_id"]] = (ids, srv.answer(body))
    assert (s.completed, s.failed) == (10, 0)
    t = read_responses(out_dirs(tmp_path)[0])
    for r in t.to_pylist():
        ids, exp = expected[r["sample_id"]]
        assert r["source"] == "sglang" and r["prompt_token_ids"] == ids and r["output_token_ids"] == exp["output_ids"]
        assert r["finish_reason"] == "stop" and json.loads(r["native_finish_reason"]) == {
            "type": "stop",
            "matched": EOS,
        }
        assert r["content"] == exp["text"] and r["content"].endswith("<|im_end|>") and r["reasoning"] is None
        assert r["usage_prompt_tokens"] == len(ids) and r["usage_completion_tokens"] == len(r["output_token_ids"])
        assert r["generation_id"] == r["sample_id"] + f":{r['attempts']}"
        assert "Question" in decode(r["output_token_ids"])  # the double quotes the decoded prompt


def test_sglang_length_and_abort(tmp_path):
    small = SamplingSpec(seed=3, max_tokens=16)
    prompts = make_prompts(4, sampling=small)
    with SimulatedSGLangServer(
        encode=encode,
        think_start_id=THINK,
        think_end_id=END_THINK,
        eos_id=EOS,
        faults={"error_200": 1.0, "fail_first_n_attempts": 100},
    ) as srv:
        s = run(prompts, sglang_backend(srv.url, max_retries=1), tmp_path, sampling=small, render_prompt_ids=render)
    assert s.completed == 0 and s.errors_by_class == {"provider_error": 4}  # abort finish -> retried, then recorded
    with SimulatedSGLangServer(encode=encode, think_start_id=THINK, think_end_id=END_THINK, eos_id=EOS) as srv:
        s = run(prompts, sglang_backend(srv.url), tmp_path / "ok", sampling=small, render_prompt_ids=render)
    t = read_responses(out_dirs(tmp_path / "ok")[0])
    assert s.completed == 4 and set(t.column("finish_reason").to_pylist()) == {"length"}
    assert all(len(x) == 16 for x in t.column("output_token_ids").to_pylist())
    assert {json.loads(x)["type"] for x in t.column("native_finish_reason").to_pylist()} == {"length"}


def test_sglang_needs_render_prompt_ids(tmp_path):
    with SimulatedSGLangServer(encode=encode, think_start_id=THINK, think_end_id=END_THINK, eos_id=EOS) as srv:
        with pytest.raises(ValueError, match="render_prompt_ids"):
            run(make_prompts(1), sglang_backend(srv.url), tmp_path)
