"""Wire formats: request bodies and response parsing for OpenRouter, vLLM and SGLang.

Each backend turns one prompt into request bytes and one response into the backend-specific columns of the
responses table (`ParsedResponse`); the runner adds provenance, timing and the raw body. Parsing raises
RequestFailure for anything that is not a usable response, classified for the retry loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from eagle_pipeline.generation.backends.client import ChatClient
from eagle_pipeline.generation.spec import BackendSpec, SamplingSpec
from eagle_pipeline.shared import failures as F
from eagle_pipeline.shared.failures import RequestFailure

RenderPromptIds = Callable[[list[dict[str, Any]], "list[dict[str, Any]] | None"], "list[int]"]


class PromptItem(NamedTuple):
    """One request: the prompts table's columns the backends need; a turn of a regenerated conversation
    (`regenerate: all_turns`, generation/plan/turns.py) also names its conversation and its index there."""

    sample_id: str
    messages_json: str
    tools_json: str | None
    conversation_id: str | None = None
    turn_index: int | None = None


@dataclass
class ParsedResponse:
    """The backend-specific columns of one responses row."""

    model: str | None = None
    provider: str | None = None
    reasoning: str | None = None
    content: str | None = None
    tool_calls_json: str | None = None
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    finish_reason: str | None = None
    native_finish_reason: str | None = None
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    usage_reasoning_tokens: int | None = None
    cost_usd: float | None = None
    generation_id: str | None = None
    stream_chunks: int | None = None  # streamed answers: data chunks received (None: not streamed)
    stream_keepalives: int | None = None  # streamed answers: keep-alive comments received


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` over `base`, merging nested dicts (so extra_body can add one provider key without replacing all)."""
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _price_cost(spec: BackendSpec, prompt_tokens: int | None, completion_tokens: int | None) -> float | None:
    if spec.price_per_m_prompt is None and spec.price_per_m_completion is None:
        return None
    if prompt_tokens is None and completion_tokens is None:
        return None
    return (
        (prompt_tokens or 0) * (spec.price_per_m_prompt or 0.0)
        + (completion_tokens or 0) * (spec.price_per_m_completion or 0.0)
    ) / 1e6


def _int_or_none(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return None


def _text_or_none(v: Any) -> str | None:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list):  # OpenAI content parts
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in v)
    return _dumps(v)


def _as_dict(v: Any) -> dict[str, Any]:
    """`v` when it is a JSON object, else an empty one (optional sub-objects of a body)."""
    return v if isinstance(v, dict) else {}


def _ids_or_none(v: Any) -> list[int] | None:
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return v
    return None


def load_json_body(status: int, raw: bytes) -> tuple[str, Any]:
    """Decode a response body; an undecodable 2xx body is a retryable malformed-body failure."""
    try:
        text = raw.decode("utf-8")
        return text, json.loads(text)
    except (UnicodeDecodeError, ValueError) as exc:
        if 200 <= status < 300:
            raise RequestFailure(
                F.MALFORMED_BODY, f"response body is not JSON ({len(raw)} bytes): {exc}", True, status
            ) from None
        return raw.decode("utf-8", errors="replace"), None


def error_for_status(status: int, obj: Any, text: str, retry_after_s: float | None) -> RequestFailure:
    """Classify a non-2xx response, using the error object of the body when there is one."""
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict):
        message = str(err.get("message") or err)
    elif isinstance(obj, dict) and obj.get("detail") is not None:
        message = str(obj.get("detail"))
    elif isinstance(obj, dict) and obj.get("message"):
        message = str(obj.get("message"))
    else:
        message = text.strip() or f"HTTP {status}"
    return F.classify_status(status, F.truncate(message), retry_after_s=retry_after_s, error_obj=err)


def _answer_object(obj: Any, status: int) -> dict[str, Any]:
    """A response body as the object every backend answers with; an `error` it carries raised as its failure."""
    if not isinstance(obj, dict):
        raise RequestFailure(F.MALFORMED_BODY, f"expected a JSON object, got {type(obj).__name__}", True, status)
    if obj.get("error"):
        raise F.classify_body_error(obj["error"], status)
    return obj


def parse_chat_completion(obj: Any, status: int, *, want_ids: bool, spec: BackendSpec | None = None) -> ParsedResponse:
    """Parse an OpenAI-style chat completion body (OpenRouter, vLLM, or an imported one).

    `error` is checked before `choices`: OpenRouter reports upstream failures inside HTTP 200 bodies.
    """
    obj = _answer_object(obj, status)
    choices = obj.get("choices")
    if not choices:
        raise RequestFailure(F.NO_CHOICES, "response has no choices", True, status)
    ch = choices[0]
    if not isinstance(ch, dict):
        raise RequestFailure(F.MALFORMED_BODY, "choices[0] is not an object", True, status)
    if ch.get("error"):
        raise F.classify_body_error(ch["error"], status)
    msg = ch.get("message")
    if not isinstance(msg, dict):
        raise RequestFailure(F.MALFORMED_BODY, "choices[0].message missing", True, status)
    finish = ch.get("finish_reason")
    if finish == "error":
        raise RequestFailure(F.PROVIDER_ERROR, "finish_reason 'error'", True, status)
    reasoning = msg.get("reasoning")
    if reasoning is None:
        reasoning = msg.get("reasoning_content")
    reasoning = _text_or_none(reasoning)
    content = _text_or_none(msg.get("content"))
    tool_calls = msg.get("tool_calls") or None
    if finish is None and not content and not reasoning and not tool_calls:
        # "No content generated": a cold start or dropped upstream; not billed, worth retrying.
        raise RequestFailure(F.EMPTY_COMPLETION, "no finish_reason and nothing generated", True, status)
    usage = _as_dict(obj.get("usage"))
    details = _as_dict(usage.get("completion_tokens_details"))
    reasoning_tokens = _int_or_none(details.get("reasoning_tokens"))
    if reasoning_tokens is None:
        reasoning_tokens = _int_or_none(usage.get("reasoning_tokens"))
    prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
    completion_tokens = _int_or_none(usage.get("completion_tokens"))
    cost = usage.get("cost")
    cost = float(cost) if isinstance(cost, (int, float)) and not isinstance(cost, bool) else None
    if cost is None and spec is not None:
        cost = _price_cost(spec, prompt_tokens, completion_tokens)
    prompt_ids = output_ids = None
    if want_ids:
        prompt_ids = _ids_or_none(obj.get("prompt_token_ids"))
        if prompt_ids is None:
            prompt_ids = _ids_or_none(ch.get("prompt_token_ids"))
        output_ids = _ids_or_none(ch.get("token_ids"))
        if prompt_ids is None or output_ids is None:
            raise RequestFailure(
                F.MISSING_TOKEN_IDS,
                "endpoint returned no token ids (prompt_token_ids / choices[0].token_ids); it must support return_token_ids",
                False,
                status,
            )
    native = ch.get("native_finish_reason")
    if native is None and ch.get("stop_reason") is not None:
        native = str(ch.get("stop_reason"))  # vLLM: matched stop string or token id
    return ParsedResponse(
        model=obj.get("model") if isinstance(obj.get("model"), str) else None,
        provider=obj.get("provider") if isinstance(obj.get("provider"), str) else None,
        reasoning=reasoning,
        content=content,
        tool_calls_json=_dumps(tool_calls) if tool_calls else None,
        prompt_token_ids=prompt_ids,
        output_token_ids=output_ids,
        finish_reason=finish if isinstance(finish, str) else None,
        native_finish_reason=native if isinstance(native, str) or native is None else str(native),
        usage_prompt_tokens=prompt_tokens,
        usage_completion_tokens=completion_tokens,
        usage_reasoning_tokens=reasoning_tokens,
        cost_usd=cost,
        generation_id=obj.get("id") if isinstance(obj.get("id"), str) else None,
    )


class HttpBackend:
    """Base of the live backends: a URL, a body per prompt, a parser per response."""

    path = "/chat/completions"

    def __init__(self, spec: BackendSpec, sampling: SamplingSpec) -> None:
        self.spec = spec
        self.sampling = sampling
        self.url = spec.endpoint.rstrip("/") + self.path  # type: ignore[union-attr]

    def build_body(self, item: PromptItem, attempt: int) -> bytes:
        raise NotImplementedError

    async def exchange(self, client: ChatClient, item: PromptItem, attempt: int) -> tuple[str, ParsedResponse]:
        """One attempt: request `item` and return (body text to store, parsed columns), or raise RequestFailure."""
        status, raw, retry_after = await client.post(self.url, self.build_body(item, attempt))
        return self.parse(status, raw or b"", retry_after, item)

    def parse(
        self, status: int, raw: bytes, retry_after_s: float | None, item: PromptItem
    ) -> tuple[str, ParsedResponse]:
        """Return (body text, parsed columns) or raise RequestFailure: a status outside 2xx fails as its status says,
        whatever the body; a 2xx body is parsed by the backend's own format (`parse_answer`)."""
        text, obj = load_json_body(status, raw)
        if not 200 <= status < 300:
            raise error_for_status(status, obj, text, retry_after_s)
        return text, self.parse_answer(obj, status, item)

    def parse_answer(self, obj: Any, status: int, item: PromptItem) -> ParsedResponse:
        """The parsed columns of a 2xx body, or raise RequestFailure."""
        raise NotImplementedError

    def forget(self, item: PromptItem) -> None:
        """Drop per-prompt state once the prompt is finished (success or final failure)."""


class _ChatBackend(HttpBackend):
    """OpenAI-style /chat/completions. The body is spliced from a precomputed prefix and the prompt's stored JSON,
    so no per-request json.loads/dumps of messages (CPU per request is the limit at thousands in flight)."""

    want_ids = False

    def __init__(self, spec: BackendSpec, sampling: SamplingSpec) -> None:
        super().__init__(spec, sampling)
        static = deep_merge(self.static_body(), spec.extra_body)
        static.pop("messages", None)
        static.pop("tools", None)
        # Each request gets its sample's own seed (`build_body`), unless extra_body fixes one for all.
        self._seeded = sampling.seed is not None and "seed" not in spec.extra_body
        self._prefix = _dumps(static)[:-1]  # without the closing brace; static always has "model"
        self.stream = bool(static.get("stream"))

    async def exchange(self, client: ChatClient, item: PromptItem, attempt: int) -> tuple[str, ParsedResponse]:
        if not self.stream:
            return await super().exchange(client, item, attempt)
        s = await client.post_streamed(self.url, self.build_body(item, attempt), self.spec.max_keepalive_only_s)
        if s.raw is not None:  # an error status, or a server that answered with a plain JSON body
            return self.parse(s.status, s.raw, s.retry_after_s, item)
        assert s.text is not None and s.body is not None
        parsed = parse_chat_completion(s.body, s.status, want_ids=self.want_ids, spec=self.spec)
        parsed.stream_chunks, parsed.stream_keepalives = s.chunks, s.keepalives
        # The stored body is the assembled equivalent of the non-streaming answer.
        return s.text, parsed

    def static_body(self) -> dict[str, Any]:
        raise NotImplementedError

    def sampling_body(self) -> dict[str, Any]:
        """The fields every OpenAI-style server takes: model and sampling parameters (the seed is per request)."""
        s = self.sampling
        return {
            "model": self.spec.model,
            "stream": self.spec.effective_stream,
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
        }

    def build_body(self, item: PromptItem, attempt: int) -> bytes:
        prefix = self._prefix
        if self._seeded:
            prefix += f',"seed":{self.sampling.request_seed(item.sample_id)}'
        tools = item.tools_json
        if tools and tools not in ("null", "[]"):
            return f'{prefix},"messages":{item.messages_json},"tools":{tools}}}'.encode()
        return f'{prefix},"messages":{item.messages_json}}}'.encode()

    def parse_answer(self, obj: Any, status: int, item: PromptItem) -> ParsedResponse:
        return parse_chat_completion(obj, status, want_ids=self.want_ids, spec=self.spec)


class OpenRouterBackend(_ChatBackend):
    """OpenRouter (and the simulated server): reasoning on/off, provider routing, usage accounting."""

    def static_body(self) -> dict[str, Any]:
        body = self.sampling_body()
        body["reasoning"] = {"enabled": bool(self.sampling.thinking)}
        # Deprecated upstream (usage is always returned) but harmless; older deployments honour it.
        body["usage"] = {"include": True}
        if self.spec.provider:
            body["provider"] = dict(self.spec.provider)
        return body


class VLLMBackend(_ChatBackend):
    """vLLM's OpenAI server with `return_token_ids`: ids are taken exactly as returned."""

    want_ids = True

    def static_body(self) -> dict[str, Any]:
        body = self.sampling_body()
        body["return_token_ids"] = True
        body["chat_template_kwargs"] = {"thinking": bool(self.sampling.thinking)}
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}  # vLLM sends no usage in a stream without it
        return body


class SGLangBackend(HttpBackend):
    """SGLang's native /generate: the project renders the prompt ids; output ids are taken as returned."""

    path = "/generate"

    def __init__(self, spec: BackendSpec, sampling: SamplingSpec, render_prompt_ids: RenderPromptIds) -> None:
        super().__init__(spec, sampling)
        if render_prompt_ids is None:
            raise ValueError(
                f"backend {spec.name!r}: kind 'sglang' needs render_prompt_ids(messages, tools) -> list[int]"
            )
        self.render_prompt_ids = render_prompt_ids
        s = sampling
        sp: dict[str, Any] = {
            # SGLang's default max_new_tokens is 128: always send it.
            "max_new_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        self._static = deep_merge({"sampling_params": sp, "stream": False}, spec.extra_body)
        # Each request gets its sample's own seed (`build_body`), unless extra_body fixes one for all.
        fixed = _as_dict(spec.extra_body.get("sampling_params")).get("sampling_seed") is not None
        self._seeded = s.seed is not None and not fixed
        self._ids_cache: dict[str, list[int]] = {}

    def prompt_ids(self, item: PromptItem) -> list[int]:
        ids = self._ids_cache.get(item.sample_id)
        if ids is None:
            messages = json.loads(item.messages_json)
            tools = json.loads(item.tools_json) if item.tools_json else None
            ids = [int(x) for x in self.render_prompt_ids(messages, tools)]
            self._ids_cache[item.sample_id] = ids
        return ids

    def build_body(self, item: PromptItem, attempt: int) -> bytes:
        body = dict(self._static)
        if self._seeded:
            seed = self.sampling.request_seed(item.sample_id)
            body["sampling_params"] = {**body["sampling_params"], "sampling_seed": seed}
        body["input_ids"] = self.prompt_ids(item)
        body["rid"] = f"{item.sample_id}:{attempt}"  # unique per attempt: a timed-out attempt may still run server-side
        return _dumps(body).encode()

    def parse_answer(self, obj: Any, status: int, item: PromptItem) -> ParsedResponse:
        return parse_sglang_generate(obj, status, self.prompt_ids(item), self.spec)

    def forget(self, item: PromptItem) -> None:
        self._ids_cache.pop(item.sample_id, None)


def parse_sglang_generate(
    obj: Any, status: int, prompt_ids: list[int], spec: BackendSpec | None = None
) -> ParsedResponse:
    """Parse a /generate response (a dict, or a one-element list for batch form)."""
    if isinstance(obj, list) and len(obj) == 1:
        obj = obj[0]
    obj = _answer_object(obj, status)
    meta = obj.get("meta_info")
    if not isinstance(meta, dict):
        raise RequestFailure(F.MALFORMED_BODY, "response has no meta_info", True, status)
    fr = meta.get("finish_reason")
    ftype = fr.get("type") if isinstance(fr, dict) else (fr if isinstance(fr, str) else None)
    if ftype == "abort":
        msg = fr.get("message") if isinstance(fr, dict) else None
        raise RequestFailure(F.PROVIDER_ERROR, F.truncate(f"request aborted: {msg or ''}"), True, status)
    # Current releases return output_ids; older ones token_ids; the logprob tuples carry them as a last resort.
    out = _ids_or_none(obj.get("output_ids"))
    if out is None:
        out = _ids_or_none(obj.get("token_ids"))
    if out is None and isinstance(meta.get("output_token_logprobs"), list):
        try:
            out = [int(t[1]) for t in meta["output_token_logprobs"]]
        except (TypeError, ValueError, IndexError):
            out = None
    if out is None:
        raise RequestFailure(F.MISSING_TOKEN_IDS, "response has no output_ids", False, status)
    returned_prompt = _ids_or_none(obj.get("prompt_token_ids"))
    pt = _int_or_none(meta.get("prompt_tokens"))
    ct = _int_or_none(meta.get("completion_tokens"))
    return ParsedResponse(
        model=None,
        provider=None,
        reasoning=None,  # /generate applies no reasoning parser: the raw text goes to content
        content=obj.get("text") if isinstance(obj.get("text"), str) else None,
        tool_calls_json=None,
        prompt_token_ids=returned_prompt if returned_prompt is not None else list(prompt_ids),
        output_token_ids=out,
        finish_reason=ftype,
        native_finish_reason=_dumps(fr) if isinstance(fr, dict) else None,
        usage_prompt_tokens=pt,
        usage_completion_tokens=ct,
        usage_reasoning_tokens=_int_or_none(meta.get("reasoning_tokens")),
        cost_usd=_price_cost(spec, pt, ct) if spec is not None else None,
        generation_id=str(meta["id"]) if meta.get("id") is not None else None,
    )


def make_backend(
    spec: BackendSpec, sampling: SamplingSpec, render_prompt_ids: RenderPromptIds | None = None
) -> HttpBackend:
    if spec.kind.speaks_openrouter:
        return OpenRouterBackend(spec, sampling)
    if spec.kind == "vllm":
        return VLLMBackend(spec, sampling)
    if spec.kind == "sglang":
        return SGLangBackend(spec, sampling, render_prompt_ids)  # type: ignore[arg-type]
    raise ValueError(f"backend {spec.name!r}: kind {spec.kind!r} makes no HTTP requests")
