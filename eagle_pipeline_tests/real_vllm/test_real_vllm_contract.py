"""Contract tests: the same requests sent to the project's doubles and to a real vLLM 0.32 give answers of the same
shape. Each test states what the real server does; the doubles (which stay, for faults and speed) must match it.
A double may leave out fields, but every field it sends the real server sends too, with the same JSON type.

The doubles answer an unknown model name with vLLM's 404 and a too-long prompt with its 400, as these tests check
(issue 25: before, both doubles answered 200).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from eagle_pipeline.simulation.vllm_hidden_states import VLLMHiddenStatesDouble
from eagle_pipeline_tests.doubles import SimulatedVLLMServer

from ..tolerances import assert_forwards_close
from .conftest import MAX_MODEL_LEN

pytestmark = pytest.mark.real_vllm

LAYER_IDS = (2, 4, 5, 8)  # the tiny Llama's default aux layers (1, 3, 4) + the final id, as the server was started
IDS = [5, 9, 17, 33, 65, 129]


def json_shape(v: Any) -> Any:
    """The JSON type tree of a value: dicts by key, lists by their first element, None where the value is null."""
    if isinstance(v, dict):
        return {k: json_shape(x) for k, x in v.items()}
    if isinstance(v, list):
        return [json_shape(v[0])] if v else []
    if v is None:
        return None
    return "number" if isinstance(v, int | float) and not isinstance(v, bool) else type(v).__name__


def not_in_real(double: Any, real: Any, path: str = "") -> list[str]:
    """Paths where the double's shape is not the real one's: a field the real server does not send, or another
    type (null on either side matches anything: a field that is null in one answer may be set in another)."""
    if double is None or real is None:
        return []
    if isinstance(double, dict):
        if not isinstance(real, dict):
            return [f"{path or '.'}: object vs {real!r}"]
        out = [f"{path}.{k}: not sent by vLLM" for k in double if k not in real]
        return out + [p for k in double if k in real for p in not_in_real(double[k], real[k], f"{path}.{k}")]
    if isinstance(double, list):
        if not isinstance(real, list):
            return [f"{path}: list vs {real!r}"]
        return not_in_real(double[0], real[0], f"{path}[]") if double and real else []
    return [] if double == real else [f"{path}: {double} vs {real}"]


@pytest.fixture(scope="module")
def hs_double(real_vllm, tmp_path_factory) -> Iterator[VLLMHiddenStatesDouble]:
    """The hidden-states double serving the same checkpoint under the same name as the real server."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(real_vllm.model_dir, dtype=torch.float32).eval()
    storage = tmp_path_factory.mktemp("double_storage")
    with VLLMHiddenStatesDouble(
        model,
        layer_ids=LAYER_IDS,
        storage_path=storage,
        served_model_name=str(real_vllm.model_dir),
        max_model_len=MAX_MODEL_LEN,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def gen_double(real_vllm) -> Iterator[SimulatedVLLMServer]:
    """The generation double with a byte tokenizer shaped like the tiny model's (ids < 256 bytes; 256.. specials)."""
    with SimulatedVLLMServer(
        encode=lambda text: list(text.encode("utf-8")),
        think_start_id=260,
        think_end_id=261,
        eos_id=256,
        served_model_name=str(real_vllm.model_dir),
    ) as srv:
        yield srv


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    """POST `body` to `url + path` (the generation double's url already ends in /v1)."""
    return httpx.post(f"{url}{path}", json=body, timeout=120.0)


def _completion(**kw: Any) -> dict[str, Any]:
    return {"prompt": IDS, "max_tokens": 1, "return_token_ids": True, **kw}


def _chat(model: str, content: str = "Question 1: explain tides.", **kw: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 1.0,
        "top_p": 0.95,
        "seed": 7,
        "return_token_ids": True,
        "chat_template_kwargs": {"thinking": True},
        **kw,
    }


# ---- the extraction server: /v1/models and /v1/completions -----------------------------------------------------


def test_models_list_has_the_same_shape(real_vllm, hs_double):
    real = httpx.get(f"{real_vllm.url}/v1/models").json()
    double = httpx.get(f"{hs_double.url}/v1/models").json()
    assert real["data"][0]["id"] == str(real_vllm.model_dir) and real["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert not_in_real(json_shape(double), json_shape(real)) == []
    assert isinstance(double["data"][0]["max_model_len"], int)  # what a length pre-flight reads


def test_completion_and_connector_file_have_the_same_shape(real_vllm, hs_double):
    real = _post(real_vllm.url, "/v1/completions", _completion())
    double = _post(hs_double.url, "/v1/completions", _completion())
    assert real.status_code == double.status_code == 200
    r, d = real.json(), double.json()
    assert r["choices"][0]["prompt_token_ids"] == d["choices"][0]["prompt_token_ids"] == IDS
    assert not_in_real(json_shape(d), json_shape(r)) == []
    files = {}
    for name, body in (("real", r), ("double", d)):
        path = body["kv_transfer_params"]["hidden_states_path"]
        assert path.endswith(".safetensors") and path.split("/")[-1].startswith(body["id"])
        with open(path + ".lock") as lock:  # both hold LOCK_EX until written; a shared lock waits for that
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_SH)
            files[name] = load_file(path)
    real_file, double_file = files["real"], files["double"]
    assert {k: (v.dtype, v.shape) for k, v in real_file.items()} == {
        k: (v.dtype, v.shape) for k, v in double_file.items()
    }
    assert real_file["hidden_states"].shape == (len(IDS), len(LAYER_IDS), 64)
    assert real_file["token_ids"].tolist() == IDS
    # Same checkpoint, fp32 both sides (kernel summation order only): the double's states are vLLM's.
    assert_forwards_close(double_file["hidden_states"], real_file["hidden_states"], hs_double.model.config)


def test_token_id_out_of_vocabulary_is_400_on_both(real_vllm, hs_double):
    real = _post(real_vllm.url, "/v1/completions", _completion(prompt=[10**6]))
    double = _post(hs_double.url, "/v1/completions", _completion(prompt=[10**6]))
    assert real.status_code == double.status_code == 400
    assert real.json()["error"]["type"] == double.json()["error"]["type"] == "BadRequestError"
    assert not_in_real(json_shape(double.json()), json_shape(real.json())) == []


def test_real_server_unknown_model_is_404(real_vllm):
    real = _post(real_vllm.url, "/v1/completions", _completion(model="no-such-model"))
    assert real.status_code == 404
    assert real.json()["error"]["type"] == "NotFoundError" and real.json()["error"]["code"] == 404


def test_double_unknown_model_is_404(real_vllm, hs_double):
    real = _post(real_vllm.url, "/v1/completions", _completion(model="no-such-model"))
    double = _post(hs_double.url, "/v1/completions", _completion(model="no-such-model"))
    assert double.status_code == real.status_code == 404
    assert not_in_real(json_shape(double.json()), json_shape(real.json())) == []


def test_real_server_refuses_rows_at_or_over_max_model_len(real_vllm):
    """A row of exactly max_model_len ids leaves no room for the one output token; a longer one is over the limit:
    both 400, and either would stop a shard (issue 25, gap 2)."""
    at = _post(real_vllm.url, "/v1/completions", _completion(prompt=[7] * MAX_MODEL_LEN))
    over = _post(real_vllm.url, "/v1/completions", _completion(prompt=[7] * (MAX_MODEL_LEN + 1)))
    under = _post(real_vllm.url, "/v1/completions", _completion(prompt=[7] * (MAX_MODEL_LEN - 1)))
    assert (at.status_code, over.status_code, under.status_code) == (400, 400, 200)
    assert "max_tokens must be at least 1, got 0" in at.json()["error"]["message"]
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in over.json()["error"]["message"]


def test_double_refuses_rows_over_max_model_len(hs_double):
    limit = httpx.get(f"{hs_double.url}/v1/models").json()["data"][0]["max_model_len"]
    over = _post(hs_double.url, "/v1/completions", _completion(prompt=[7] * (limit + 1)))
    assert over.status_code == 400 and over.json()["error"]["type"] == "BadRequestError"


# ---- the generation server: /v1/chat/completions ----------------------------------------------------------------


def test_chat_completion_has_the_same_shape(real_vllm, gen_double):
    model = str(real_vllm.model_dir)
    real = _post(real_vllm.url, "/v1/chat/completions", _chat(model))
    double = _post(gen_double.url, "/chat/completions", _chat(model))
    assert real.status_code == double.status_code == 200
    r, d = real.json(), double.json()
    # What the backend reads: top-level prompt ids, the choice's ids, reasoning beside content, usage.
    for body in (r, d):
        assert isinstance(body["prompt_token_ids"], list) and isinstance(body["choices"][0]["token_ids"], list)
        assert "reasoning" in body["choices"][0]["message"] and "content" in body["choices"][0]["message"]
        assert body["usage"]["completion_tokens"] == len(body["choices"][0]["token_ids"])
    assert "stop_reason" in r["choices"][0]  # null, or the stop token / string that ended the answer
    assert isinstance(r["usage"]["completion_tokens_details"]["reasoning_tokens"], int)
    assert not_in_real(json_shape(d), json_shape(r)) == []


def test_double_chat_reports_stop_reason_and_reasoning_tokens(real_vllm, gen_double):
    d = _post(gen_double.url, "/chat/completions", _chat(str(real_vllm.model_dir))).json()
    assert "stop_reason" in d["choices"][0]
    assert isinstance(d["usage"]["completion_tokens_details"]["reasoning_tokens"], int)


def test_real_chat_unknown_model_and_too_long_prompt_are_400_and_404(real_vllm):
    unknown = _post(real_vllm.url, "/v1/chat/completions", _chat("no-such-model"))
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "NotFoundError"
    long = _post(
        real_vllm.url, "/v1/chat/completions", _chat(str(real_vllm.model_dir), content="x" * 2 * MAX_MODEL_LEN)
    )
    assert long.status_code == 400 and long.json()["error"]["type"] == "BadRequestError"


def test_double_chat_unknown_model_is_404(real_vllm, gen_double):
    real = _post(real_vllm.url, "/v1/chat/completions", _chat("no-such-model"))
    double = _post(gen_double.url, "/chat/completions", _chat("no-such-model"))
    assert double.status_code == real.status_code == 404
    assert not_in_real(json_shape(double.json()), json_shape(real.json())) == []


def _first_chunk(url: str, body: dict[str, Any]) -> dict[str, Any]:
    with httpx.stream("POST", url, json=body, timeout=120.0) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                return json.loads(line.removeprefix("data: "))
    raise AssertionError("no data event")


def test_streamed_first_chunk_is_the_same(real_vllm, gen_double):
    """vLLM's first streamed chunk announces the message with `content: ""` (whatever follows, reasoning included)
    and carries the prompt ids; the double's does the same, so the streamed-vs-plain tests of generation/ see it."""
    model = str(real_vllm.model_dir)
    body = _chat(model, stream=True, stream_options={"include_usage": True})
    real = _first_chunk(f"{real_vllm.url}/v1/chat/completions", body)
    double = _first_chunk(f"{gen_double.url}/chat/completions", body)
    for chunk in (real, double):
        assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert isinstance(chunk["prompt_token_ids"], list) and chunk["prompt_token_ids"]
    assert not_in_real(json_shape(double), json_shape(real)) == []
