"""What a real vLLM 0.32 does that the doubles first missed (issue 25): one seed per request rather than per dataset,
the stop token id in `stop_reason`, `completion_tokens_details.reasoning_tokens`, and a 404 for a model name the
server does not serve, which must stop the run instead of failing every row."""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request

import pytest

from eagle_pipeline.generation.spec import SamplingSpec
from eagle_pipeline.generation.store.shards import read_errors, read_responses
from eagle_pipeline.prompts import canonical_json
from eagle_pipeline.simulation import SimulatedOpenRouterServer
from eagle_pipeline_tests.doubles import SimulatedSGLangServer, SimulatedVLLMServer

from .generation_helpers import SAMPLING, make_prompts, out_dirs, run, sim_backend
from .test_gen_selfhosted import END_THINK, EOS, THINK, encode, render, sglang_backend, vllm_backend

TOY = dict(encode=encode, think_start_id=THINK, think_end_id=END_THINK, eos_id=EOS)


def _seeds_by_sample(prompts, srv, seed_of) -> dict[str, int]:
    """sample id -> the seed its request carried, from every body the server received (matched by messages, so the
    test needs no knowledge of how seeds are derived)."""
    by_messages = {
        mj: sid for sid, mj in zip(prompts.column("sample_id").to_pylist(), prompts["messages_json"].to_pylist())
    }
    by_ids = {tuple(render(json.loads(mj), None)): sid for mj, sid in by_messages.items()}
    out: dict[str, int] = {}
    for key, _ in srv.arrivals():
        body = srv.body_for(key)
        sid = by_messages[canonical_json(body["messages"])] if "messages" in body else by_ids[tuple(body["input_ids"])]
        assert out.setdefault(sid, seed_of(body)) == seed_of(body), f"{sid}: its retries carried another seed"
    return out


@pytest.mark.parametrize("wire", ["openrouter", "vllm", "sglang"])
def test_each_sample_gets_its_own_seed_and_the_same_one_on_every_run(tmp_path, wire):
    prompts = make_prompts(8)
    seeds = []
    for attempt in ("first", "again"):
        faults = {"http_503": 0.5, "retry_after_s": 0.01}  # retries must resend the sample's seed
        if wire == "openrouter":
            with SimulatedOpenRouterServer(faults=faults) as srv:
                run(prompts, sim_backend(srv.url, stream=False), tmp_path / attempt)
                seeds.append(_seeds_by_sample(prompts, srv, lambda b: b["seed"]))
        elif wire == "vllm":
            with SimulatedVLLMServer(faults=faults, **TOY) as srv:
                run(prompts, vllm_backend(srv.url), tmp_path / attempt)
                seeds.append(_seeds_by_sample(prompts, srv, lambda b: b["seed"]))
        else:
            with SimulatedSGLangServer(faults=faults, **TOY) as srv:
                run(prompts, sglang_backend(srv.url), tmp_path / attempt, render_prompt_ids=render)
                seeds.append(_seeds_by_sample(prompts, srv, lambda b: b["sampling_params"]["sampling_seed"]))
    first, again = seeds
    assert len(first) == 8 and first == again  # reproducible: a rerun sends each sample the same seed
    assert len(set(first.values())) == 8  # and no two samples share one
    for sid, seed in first.items():
        # The documented derivation (docs/generation.md): blake2b of "seed:sample_id", 8 bytes little-endian, 31 bits.
        digest = hashlib.blake2b(f"{SAMPLING.seed}:{sid}".encode(), digest_size=8).digest()
        assert seed == int.from_bytes(digest, "little") & 0x7FFFFFFF == SAMPLING.request_seed(sid)
    # Sample ids still hash the sampling settings only (the seed of the dataset), so no committed id changes.
    assert prompts.column("sample_id").to_pylist() == make_prompts(8).column("sample_id").to_pylist()
    assert "request_seed" not in SAMPLING.to_dict()
    rows = read_responses(out_dirs(tmp_path / "first")[0]).to_pylist()
    assert {json.loads(r["sampling_json"])["request_seed"] for r in rows} == {"blake2b64(seed:sample_id) & 0x7fffffff"}


def test_no_seed_sends_none_and_extra_body_can_fix_one(tmp_path):
    prompts = make_prompts(3)
    with SimulatedVLLMServer(**TOY) as srv:
        run(prompts, vllm_backend(srv.url), tmp_path / "none", sampling=SamplingSpec(seed=None))
        assert all("seed" not in srv.body_for(k) for k, _ in srv.arrivals())
    with SimulatedVLLMServer(**TOY) as srv:
        run(prompts, vllm_backend(srv.url, extra_body={"seed": 11}), tmp_path / "fixed")
        assert {srv.body_for(k)["seed"] for k, _ in srv.arrivals()} == {11}


def test_a_model_that_ignores_the_prompt_still_answers_each_prompt_differently(tmp_path):
    """A tiny randomly initialised model answers from the sampling noise alone: with one seed for every request
    it gave all 20 prompts the same output on a real vLLM. Per-sample seeds draw different noise per prompt."""
    prompts = make_prompts(10)
    outputs = []
    for attempt in ("first", "again"):
        with SimulatedVLLMServer(prompt_blind=True, **TOY) as srv:
            run(prompts, vllm_backend(srv.url), tmp_path / attempt)
        rows = read_responses(out_dirs(tmp_path / attempt)[0]).to_pylist()
        outputs.append({r["sample_id"]: tuple(r["output_token_ids"]) for r in rows})
    assert len(outputs[0]) == 10 and len(set(outputs[0].values())) == 10
    assert outputs[0] == outputs[1]  # the same prompt draws the same output on a rerun


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_reports_the_stop_token_and_reasoning_tokens(tmp_path, stream):
    rows = []
    with SimulatedVLLMServer(**TOY) as srv:
        for name, budget in (("full", 2048), ("cut_in_reasoning", 40), ("cut_in_content", 460)):
            sampling = SamplingSpec(seed=7, max_tokens=budget)
            prompts = make_prompts(6, sampling=sampling, tools_every=2)
            s = run(prompts, vllm_backend(srv.url, stream=stream), tmp_path / name, sampling=sampling)
            assert s.completed == 6
            rows += read_responses(out_dirs(tmp_path / name)[0]).to_pylist()
    assert {r["finish_reason"] for r in rows} == {"stop", "tool_calls", "length"}
    assert any(r["finish_reason"] == "length" and END_THINK in r["output_token_ids"] for r in rows)
    for r in rows:
        raw = json.loads(r["raw_response_json"])
        ids, choice = r["output_token_ids"], raw["choices"][0]
        reasoning = ids.index(END_THINK) - 1 if END_THINK in ids else len(ids) - 1  # after <think>
        assert raw["usage"]["completion_tokens_details"] == {"reasoning_tokens": reasoning}
        assert r["usage_reasoning_tokens"] == reasoning
        if r["finish_reason"] == "length":
            assert choice.get("stop_reason") is None and r["native_finish_reason"] is None
        else:
            assert choice["stop_reason"] == EOS == ids[-1] and isinstance(choice["stop_reason"], int)
            assert r["native_finish_reason"] == str(EOS)


def test_vllm_serving_kimi_stops_on_im_end_which_is_not_the_tokenizer_eos(tmp_path, kimi_dir):
    """Kimi's tokenizer EOS is [EOS] (163585); generation stops on <|im_end|> (163586), a stop token id of the
    generation config, which vLLM reports in stop_reason. With thinking off nothing counts as reasoning."""
    from eagle_pipeline.tokens import load_tokenizer

    tok = load_tokenizer(kimi_dir)
    off = SamplingSpec(seed=7, thinking=False)
    with SimulatedVLLMServer(tokenizer=tok) as srv:
        run(make_prompts(3), vllm_backend(srv.url), tmp_path / "on")
        run(make_prompts(3, sampling=off), vllm_backend(srv.url), tmp_path / "off", sampling=off)
    for name, thinking in (("on", True), ("off", False)):
        for r in read_responses(out_dirs(tmp_path / name)[0]).to_pylist():
            raw = json.loads(r["raw_response_json"])
            assert raw["choices"][0]["stop_reason"] == 163586 == r["output_token_ids"][-1]
            want = r["output_token_ids"].index(163607) if thinking else 0  # the ids before </think>
            assert r["usage_reasoning_tokens"] == want and (want > 0) == thinking


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_vllm_answers_404_for_a_model_it_does_not_serve(tmp_path):
    msgs = [{"role": "user", "content": "hi"}]
    with SimulatedVLLMServer(served_model_name="kimi-k2.5", **TOY) as srv:
        for stream in (False, True):
            status, body = _post(
                srv.url + "/chat/completions", {"model": "/models/kimi", "messages": msgs, "stream": stream}
            )
            assert status == 404 and body == {
                "error": {
                    "message": "The model `/models/kimi` does not exist.",
                    "type": "NotFoundError",
                    "param": "model",
                    "code": 404,
                }
            }
        status, body = _post(srv.url + "/chat/completions", {"model": "kimi-k2.5", "messages": msgs})
        assert status == 200 and body["model"] == "kimi-k2.5"


@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_model_stops_the_run_with_a_hint_instead_of_failing_every_row(tmp_path, stream):
    prompts = make_prompts(40)
    with SimulatedVLLMServer(served_model_name="kimi-k2.5", **TOY) as srv:
        be = vllm_backend(
            srv.url, model="/models/Kimi-K2.5", concurrency=2, circuit_breaker_failures=1000, stream=stream
        )
        s = run(prompts, be, tmp_path)
        requests = srv.total_requests
    assert s.stopped_reason == "unknown_model" and s.completed == 0
    assert requests <= 2  # the requests already in flight, never one per row and never a retry
    e = read_errors(out_dirs(tmp_path)[1]).to_pylist()
    assert e and {x["error_class"] for x in e} == {"unknown_model"} and {x["http_status"] for x in e} == {404}
    message = e[0]["message"]
    assert "The model `/models/Kimi-K2.5` does not exist." in message and "--served-model-name" in message
