"""Loopback servers that speak OpenRouter's, vLLM's and SGLang's wire formats, with deterministic answers and faults.

`SimulatedOpenRouterServer` is the offline stand-in for OpenRouter (the 'simulated' backend kind and the test
double); `SimulatedVLLMServer` and `SimulatedSGLangServer` return token ids through a tokenizer-like `encode`.
All listen on 127.0.0.1 only, on an aiohttp app in a background thread, and are context managers:

    with SimulatedOpenRouterServer(latency_s=0.01, faults={"http_429": 0.2}) as srv:
        ... BackendSpec(kind="simulated", endpoint=srv.url, ...)

Answers are a pure function of the request (hash of messages + seed): reasoning that quotes the prompt, an
answer, and, for ~60% of prompts that offer tools, tool calls whose arguments follow the tool's JSON schema.

Faults (the `faults` dict): a fault name maps to a rate in [0, 1] (chosen per request key by hash, so the same
prompts are affected on every run), and `select` maps a fault name to explicit request keys (`request_key()`).
Transient faults hit only the first `fail_first_n_attempts` attempts of a key (default 1), so retries clear them;
status faults 401/402 and answer-quality faults hit every attempt. `after_requests: {fault: N}` applies a fault
to every request once the server has seen more than N (a key revoked or credits exhausted mid-run).

  transient: http_429 (Retry-After: retry_after_s), http_500, http_502, http_503, timeout (sleeps
             timeout_sleep_s, beyond the client's timeout), error_200 (HTTP 200 with an error body), no_choices,
             cut_body (connection closed mid-body), bad_json (complete HTTP response, truncated JSON)
  status:    http_401, http_402
  quality:   length (finish 'length', text cut), empty_content, empty_reasoning, billing_mismatch
             (usage.completion_tokens +15%), bad_tool_args (malformed JSON arguments), prompt_mismatch
             (usage.prompt_tokens counts a system prompt the provider injected: +PROMPT_INJECTED_TOKENS)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import re
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from eagle_pipeline.prompts import canonical_json

TRANSIENT_FAULTS = (
    "http_429",
    "http_500",
    "http_502",
    "http_503",
    "timeout",
    "error_200",
    "no_choices",
    "cut_body",
    "bad_json",
)
STATUS_FAULTS = ("http_401", "http_402")
QUALITY_FAULTS = ("length", "empty_content", "empty_reasoning", "billing_mismatch", "bad_tool_args", "prompt_mismatch")
PROMPT_INJECTED_TOKENS = 37
ALL_FAULTS = TRANSIENT_FAULTS + STATUS_FAULTS + QUALITY_FAULTS
_FAULT_OPTIONS = ("select", "after_requests", "fail_first_n_attempts", "retry_after_s", "timeout_sleep_s", "echo_auth")

CountCompletion = Callable[[str, str, list], int]
CountPrompt = Callable[[list, "list | None", bool], int]  # (messages, tools, thinking) -> prompt tokens


def request_key(messages: Sequence[dict[str, Any]] | str, seed: int | None = None) -> str:
    """The key a simulated server files a request under: a hash of the canonical messages and the seed.

    `messages` may be the prompts table's `messages_json` (already canonical) or the list itself.
    """
    mj = messages if isinstance(messages, str) else canonical_json(list(messages))
    return hashlib.sha256(f"{mj}|{seed}".encode()).hexdigest()[:24]


def ids_key(input_ids: Sequence[int], seed: int | None = None) -> str:
    """SGLang server key: a hash of the prompt ids and the seed."""
    return hashlib.sha256(f"{','.join(map(str, input_ids))}|{seed}".encode()).hexdigest()[:24]


def _unit(*parts: str) -> float:
    h = hashlib.sha256("|".join(parts).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def crude_token_count(text: str) -> int:
    """~4 bytes a token: the fallback when no tokenizer-backed counter is given."""
    return (len(text.encode("utf-8")) + 3) // 4


def crude_completion_tokens(reasoning: str, content: str, tool_calls: list) -> int:
    n = crude_token_count(reasoning) + crude_token_count(content) + 1  # + end of turn
    if reasoning:
        n += 2  # think markers
    for tc in tool_calls:
        fn = tc.get("function", {})
        n += 5 + crude_token_count(fn.get("name", "")) + crude_token_count(fn.get("arguments", ""))
    return n


def crude_prompt_tokens(messages: list, tools: list | None, thinking: bool = True) -> int:
    n = 3
    for m in messages:
        c = m.get("content")
        n += 4 + crude_token_count(c if isinstance(c, str) else json.dumps(c or ""))
    if tools:
        n += crude_token_count(json.dumps(tools))
    return n


# ---- deterministic answers ---------------------------------------------------------------------------------

_WORD = re.compile(r"[A-Za-z][A-Za-z'\-]{3,}")
_STOP = {
    "what",
    "that",
    "this",
    "with",
    "from",
    "have",
    "your",
    "about",
    "which",
    "would",
    "could",
    "should",
    "there",
    "their",
    "please",
    "explain",
}

_REASONING = (
    'The user is asking: "{snippet}".',
    "The key terms are {w1} and {w2}, so the answer has to connect them.",
    "Let me work through {w3} step by step before writing anything.",
    "I should double-check the part about {w1}; it is easy to get wrong.",
    "An edge case involving {w2} is worth a sentence.",
    "A short, direct answer with one example should be enough here.",
    "First define {w1}, then show how {w3} follows from it.",
    "Nothing in the request about {w2} is ambiguous, so no clarifying question is needed.",
)
_CONTENT = (
    "Here is the short version about {w1}.",
    "In brief, {w1} relates to {w2} in a direct way: one determines the other.",
    "Start from {w3}; then apply it to {w1}, and the result follows.",
    "For example, take a small case of {w2} and check it by hand.",
    "A common mistake is to ignore {w3} — keep it in mind.",
    "If you want, I can go deeper into {w2}.",
)


def _topic(messages: list) -> tuple[str, list[str]]:
    text = ""
    for m in reversed(messages):
        if m.get("role") in ("user", "tool") and isinstance(m.get("content"), str):
            text = m["content"]
            break
    words = [w for w in _WORD.findall(text) if w.lower() not in _STOP] or ["question", "request", "details"]
    snippet = " ".join(text.split()[:10]) or "the request"
    return snippet.replace('"', "'"), words


def _value_for(schema: Any, name: str, rng: random.Random, words: list[str], depth: int = 0) -> Any:
    if not isinstance(schema, dict):
        return rng.choice(words)
    if schema.get("enum"):
        return rng.choice(schema["enum"])
    t = schema.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), "string")
    if t == "integer":
        lo, hi = int(schema.get("minimum", 1)), int(schema.get("maximum", 100))
        return rng.randint(lo, max(lo, hi))
    if t == "number":
        lo, hi = float(schema.get("minimum", 0)), float(schema.get("maximum", 100))
        return round(rng.uniform(lo, max(lo, hi)), 2)
    if t == "boolean":
        return rng.random() < 0.5
    if t == "array":
        if depth > 3:
            return []
        return [_value_for(schema.get("items", {}), name, rng, words, depth + 1) for _ in range(rng.randint(1, 2))]
    if t == "object" or "properties" in schema:
        if depth > 3:
            return {}
        props = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        return {
            k: _value_for(v, k, rng, words, depth + 1) for k, v in props.items() if k in required or rng.random() < 0.5
        }
    return " ".join(rng.sample(words, k=min(len(words), rng.randint(1, 3))))


@dataclass
class Answer:
    reasoning: str
    content: str
    tool_calls: list[dict[str, Any]]
    finish_reason: str


def synthesize(
    messages: list, tools: list | None, key: str, *, thinking: bool = True, tool_call_rate: float = 0.6
) -> Answer:
    """The deterministic answer to one request."""
    rng = random.Random(int(key, 16))
    snippet, words = _topic(messages)

    def fill(t: str) -> str:
        return t.format(snippet=snippet, w1=rng.choice(words), w2=rng.choice(words), w3=rng.choice(words))

    reasoning = ""
    if thinking:
        reasoning = " ".join([fill(_REASONING[0])] + [fill(t) for t in rng.sample(_REASONING[1:], k=rng.randint(2, 5))])
    content = " ".join(fill(t) for t in rng.sample(_CONTENT, k=rng.randint(2, 5)))
    tool_calls: list[dict[str, Any]] = []
    last_role = messages[-1].get("role") if messages else None
    usable = [
        t
        for t in (tools or [])
        if isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name")
    ]
    if usable and last_role != "tool" and rng.random() < tool_call_rate:
        prior = sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")
        n = 2 if len(usable) > 1 and rng.random() < 0.2 else 1
        for i, tool in enumerate(rng.sample(usable, k=n)):
            fn = tool["function"]
            args = _value_for(fn.get("parameters") or {"type": "object", "properties": {}}, fn["name"], rng, words)
            tool_calls.append(
                {
                    "id": f"functions.{fn['name']}:{prior + i}",
                    "type": "function",
                    "index": i,
                    "function": {"name": fn["name"], "arguments": json.dumps(args, ensure_ascii=False)},
                }
            )
        content = "" if rng.random() < 0.5 else f"I'll call {tool_calls[0]['function']['name']} to get that."
        return Answer(reasoning, content, tool_calls, "tool_calls")
    return Answer(reasoning, content, [], "stop")


def _longest_prefix(text: str, fits: Callable[[str], bool]) -> str:
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(text[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return text[:lo]


def truncate_answer(ans: Answer, max_tokens: int, count: CountCompletion) -> Answer:
    """Cut an answer to `max_tokens` as a provider would: reasoning first consumes the budget; finish 'length'."""
    if count(ans.reasoning, ans.content, ans.tool_calls) <= max_tokens:
        return ans
    if count(ans.reasoning, "", []) >= max_tokens:
        r = _longest_prefix(ans.reasoning, lambda p: count(p, "", []) <= max_tokens)
        return Answer(r, "", [], "length")
    c = _longest_prefix(ans.content, lambda p: count(ans.reasoning, p, []) <= max_tokens)
    return Answer(ans.reasoning, c, [], "length")


# ---- fault plan --------------------------------------------------------------------------------------------


class FaultPlan:
    """Which fault (if any) a request gets, from its key, its attempt number and the server's request count."""

    def __init__(self, faults: dict[str, Any] | None) -> None:
        faults = dict(faults or {})
        unknown = set(faults) - set(ALL_FAULTS) - set(_FAULT_OPTIONS)
        if unknown:
            raise ValueError(
                f"unknown fault settings {sorted(unknown)}; known: {list(ALL_FAULTS) + list(_FAULT_OPTIONS)}"
            )
        self.rates = {k: float(faults[k]) for k in ALL_FAULTS if k in faults}
        self.select = {k: set(v) for k, v in (faults.get("select") or {}).items()}
        self.after = {k: int(v) for k, v in (faults.get("after_requests") or {}).items()}
        for k in list(self.select) + list(self.after):
            if k not in ALL_FAULTS:
                raise ValueError(f"unknown fault {k!r}")
        self.fail_first_n = int(faults.get("fail_first_n_attempts", 1))
        self.retry_after_s = faults.get("retry_after_s", 1)
        self.timeout_sleep_s = float(faults.get("timeout_sleep_s", 3600.0))
        self.echo_auth = bool(faults.get("echo_auth", False))

    def _hit(self, fault: str, key: str, n_seen: int) -> bool:
        if key in self.select.get(fault, ()):
            return True
        if fault in self.after and n_seen > self.after[fault]:
            return True
        rate = self.rates.get(fault, 0.0)
        return rate > 0 and _unit(fault, key) < rate

    def status_fault(self, key: str, attempt: int, n_seen: int) -> str | None:
        for f in STATUS_FAULTS:
            if self._hit(f, key, n_seen):
                return f
        if attempt <= self.fail_first_n:
            for f in TRANSIENT_FAULTS:
                if self._hit(f, key, n_seen):
                    return f
        return None

    def quality_faults(self, key: str, n_seen: int) -> set[str]:
        return {f for f in QUALITY_FAULTS if self._hit(f, key, n_seen)}


# ---- server base -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestRecord:
    key: str
    attempt: int
    at: float  # server wall clock (time.time()) when the request arrived
    fault: str | None
    status: int


class _LoopbackServer:
    """An aiohttp app on 127.0.0.1 in a background thread, with a request log for tests."""

    routes: tuple[str, ...] = ()
    base_path = ""

    def __init__(self, *, latency_s: float = 0.0, faults: dict[str, Any] | None = None, port: int = 0) -> None:
        self.latency_s = float(latency_s)
        self.plan = FaultPlan(faults)
        self._port = port
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._log: list[RequestRecord] = []
        self._bodies: dict[str, dict[str, Any]] = {}
        self._headers: deque[dict[str, str]] = deque(maxlen=1000)  # the latest requests' headers, bounded
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.port: int | None = None

    # lifecycle
    def start(self) -> _LoopbackServer:
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._serve, name=type(self).__name__, daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise RuntimeError(f"{type(self).__name__} failed to start: {self._error}")
        return self

    def stop(self) -> None:
        if self._thread is None or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self.port is not None, "server not started"
        return f"http://127.0.0.1:{self.port}{self.base_path}"

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            app = web.Application(client_max_size=64 * 1024 * 1024)
            for r in self.routes:
                app.router.add_post(self.base_path + r, self._entry)
            # handler_cancellation: a client that timed out stops the server's sleeping handler too.
            runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5)
            loop.run_until_complete(runner.setup())
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", self._port))
            sock.listen(4096)
            self.port = sock.getsockname()[1]
            site = web.SockSite(runner, sock, backlog=4096)
            loop.run_until_complete(site.start())
        except BaseException as exc:  # surfaced by start()
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()

    # request bookkeeping
    def _note(self, key: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, int]:
        with self._lock:
            self._counts[key] += 1
            self._bodies[key] = body
            self._headers.append(headers)
            return self._counts[key], sum(self._counts.values())

    def _record(self, key: str, attempt: int, at: float, fault: str | None, status: int) -> None:
        with self._lock:
            self._log.append(RequestRecord(key, attempt, at, fault, status))

    def request_counts(self) -> dict[str, int]:
        """Requests seen per request key (all attempts)."""
        with self._lock:
            return dict(self._counts)

    def request_log(self) -> list[RequestRecord]:
        with self._lock:
            return list(self._log)

    @property
    def total_requests(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def body_for(self, key: str) -> dict[str, Any] | None:
        """The last request body seen for a key."""
        with self._lock:
            return self._bodies.get(key)

    def headers_seen(self) -> list[dict[str, str]]:
        """Headers of the latest (up to 1,000) requests."""
        with self._lock:
            return list(self._headers)

    async def _entry(self, request: web.Request) -> web.StreamResponse:
        at = time.time()
        raw = await request.read()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("body is not an object")
        except ValueError as exc:
            return web.json_response({"error": {"code": 400, "message": f"invalid JSON body: {exc}"}}, status=400)
        return await self.handle(request, body, at)

    async def handle(self, request: web.Request, body: dict[str, Any], at: float) -> web.StreamResponse:
        raise NotImplementedError

    async def _status_fault_response(
        self, request: web.Request, fault: str, ok_body: Callable[[], bytes], message_extra: str = ""
    ) -> web.StreamResponse | None:
        """The response for a status/transient fault, or None for the 'timeout' fault after its sleep (answer normally)."""
        p = self.plan
        if fault == "timeout":
            await asyncio.sleep(p.timeout_sleep_s)
            return None
        if fault == "http_429":
            return _err(
                429,
                "Rate limit exceeded",
                {"error_type": "rate_limit_exceeded", "provider_code": "rate_limited"},
                headers={"Retry-After": _fmt_retry_after(p.retry_after_s)},
            )
        if fault in ("http_500", "http_502", "http_503"):
            code = int(fault[-3:])
            headers = {"Retry-After": _fmt_retry_after(p.retry_after_s)} if code == 503 else None
            return _err(
                code,
                {500: "Internal Server Error", 502: "Provider returned error", 503: "No available providers"}[code],
                None,
                headers,
            )
        if fault == "http_401":
            return _err(401, "No auth credentials found" + message_extra, {"error_type": "authentication"})
        if fault == "http_402":
            return _err(
                402,
                "Insufficient credits. Add more using https://openrouter.ai/credits" + message_extra,
                {"error_type": "payment_required"},
            )
        if fault == "error_200":
            return web.json_response(
                {
                    "error": {
                        "code": 502,
                        "message": "Provider returned error" + message_extra,
                        "metadata": {"provider_name": "Simulated", "error_type": "provider_unavailable"},
                    }
                },
                status=200,
            )
        full = ok_body()
        if fault == "no_choices":
            obj = json.loads(full)
            obj.pop("choices", None)
            return web.Response(body=json.dumps(obj).encode(), status=200, content_type="application/json")
        if fault == "bad_json":
            return web.Response(body=full[: len(full) // 2], status=200, content_type="application/json")
        if fault == "cut_body":
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            resp.content_length = len(full)
            await resp.prepare(request)
            await resp.write(full[: len(full) // 2])
            if request.transport is not None:
                request.transport.close()
            return resp
        raise AssertionError(fault)


def _fmt_retry_after(v: Any) -> str:
    f = float(v)
    return str(int(f)) if f.is_integer() else f"{f:g}"


def _err(status: int, message: str, metadata: dict | None = None, headers: dict | None = None) -> web.Response:
    err: dict[str, Any] = {"code": status, "message": message}
    if metadata:
        err["metadata"] = metadata
    return web.json_response({"error": err}, status=status, headers=headers)


def _auth_of(request: web.Request) -> str:
    return request.headers.get("Authorization", "")


# ---- OpenRouter ------------------------------------------------------------------------------------------


class SimulatedOpenRouterServer(_LoopbackServer):
    """OpenRouter's POST /api/v1/chat/completions on loopback (`url` is the base URL to put in BackendSpec.endpoint)."""

    base_path = "/api/v1"
    routes = ("/chat/completions",)

    def __init__(
        self,
        *,
        latency_s: float = 0.0,
        faults: dict[str, Any] | None = None,
        count_completion_tokens: CountCompletion | None = None,
        count_prompt_tokens: CountPrompt | None = None,
        price_per_m_prompt: float = 0.60,
        price_per_m_completion: float = 2.50,
        provider_name: str = "Simulated",
        api_key: str | None = None,
        tool_call_rate: float = 0.6,
        model: str | None = None,
        port: int = 0,
    ) -> None:
        super().__init__(latency_s=latency_s, faults=faults, port=port)
        self.served_model = model  # reported as `model` in responses; None echoes the requested model
        self.count_completion = count_completion_tokens or crude_completion_tokens
        self.count_prompt = count_prompt_tokens or crude_prompt_tokens
        self.price_prompt = price_per_m_prompt
        self.price_completion = price_per_m_completion
        self.provider_name = provider_name
        self.api_key = api_key
        self.tool_call_rate = tool_call_rate

    async def handle(self, request: web.Request, body: dict[str, Any], at: float) -> web.StreamResponse:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not body.get("model"):
            return _err(400, "messages and model are required", {"error_type": "invalid_request"})
        seed = body.get("seed")
        key = request_key(messages, seed)
        headers = {k: v for k, v in request.headers.items()}
        attempt, n_seen = self._note(key, body, headers)
        echo = f" (received Authorization: {_auth_of(request)})" if self.plan.echo_auth else ""
        if self.api_key is not None and _auth_of(request) != f"Bearer {self.api_key}":
            self._record(key, attempt, at, "bad_key", 401)
            return _err(401, "User not found." + echo, {"error_type": "authentication"})
        fault = self.plan.status_fault(key, attempt, n_seen)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        ok = lambda: self._answer_bytes(body, attempt, n_seen)  # noqa: E731
        if fault is not None:
            resp = await self._status_fault_response(request, fault, ok, echo)
            if resp is not None:
                self._record(key, attempt, at, fault, resp.status)
                return resp
        self._record(key, attempt, at, fault, 200)
        payload = ok()
        return web.Response(
            body=payload,
            status=200,
            content_type="application/json",
            headers={"X-Generation-Id": _gen_id(key, attempt)},
        )

    def answer(self, body: dict[str, Any], *, attempt: int = 1, n_seen: int = 0) -> dict[str, Any]:
        """The success body for a request (also used by tests to know what to expect)."""
        messages = body["messages"]
        tools = body.get("tools")
        seed = body.get("seed")
        key = request_key(messages, seed)
        reasoning_opt = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else {}
        thinking = reasoning_opt.get("enabled", True) is not False and reasoning_opt.get("effort") != "none"
        ans = synthesize(messages, tools, key, thinking=thinking, tool_call_rate=self.tool_call_rate)
        q = self.plan.quality_faults(key, n_seen)
        if "bad_tool_args" in q and tools and not ans.tool_calls:
            ans = synthesize(messages, tools, key, thinking=thinking, tool_call_rate=1.0)
        if "empty_reasoning" in q:
            ans.reasoning = ""
        if "empty_content" in q and not ans.tool_calls:
            ans.content = ""
        if "bad_tool_args" in q:
            for tc in ans.tool_calls:
                tc["function"]["arguments"] = tc["function"]["arguments"][:-2]
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        if "length" in q:
            full = self.count_completion(ans.reasoning, ans.content, ans.tool_calls)
            max_tokens = max(1, min(int(max_tokens or full), full // 2))
        if isinstance(max_tokens, int) and max_tokens > 0:
            ans = truncate_answer(ans, max_tokens, self.count_completion)
        completion_tokens = self.count_completion(ans.reasoning, ans.content, ans.tool_calls)
        reasoning_tokens = self.count_completion(ans.reasoning, "", []) if ans.reasoning else 0
        if "billing_mismatch" in q:
            completion_tokens = max(completion_tokens + 1, round(completion_tokens * 1.15))
        prompt_tokens = self.count_prompt(messages, tools, thinking)
        if "prompt_mismatch" in q:
            prompt_tokens += PROMPT_INJECTED_TOKENS
        cost = (prompt_tokens * self.price_prompt + completion_tokens * self.price_completion) / 1e6
        message: dict[str, Any] = {
            "role": "assistant",
            "content": ans.content,
            "refusal": None,
            "reasoning": ans.reasoning or None,
            "reasoning_details": (
                [
                    {
                        "type": "reasoning.text",
                        "text": ans.reasoning,
                        "signature": None,
                        "id": None,
                        "format": "unknown",
                        "index": 0,
                    }
                ]
                if ans.reasoning
                else []
            ),
        }
        if ans.tool_calls:
            message["tool_calls"] = ans.tool_calls
        out: dict[str, Any] = {
            "id": _gen_id(key, attempt),
            "provider": self.provider_name,
            "model": self.served_model or body["model"],
            "object": "chat.completion",
            "created": int(time.time()),
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "logprobs": None,
                    "finish_reason": ans.finish_reason,
                    "native_finish_reason": ans.finish_reason,
                    "message": message,
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "cost": round(cost, 10),
                "is_byok": False,
            },
        }
        return out

    def _answer_bytes(self, body: dict[str, Any], attempt: int, n_seen: int) -> bytes:
        return json.dumps(self.answer(body, attempt=attempt, n_seen=n_seen), ensure_ascii=False).encode()


def _gen_id(key: str, attempt: int) -> str:
    return f"gen-{int(time.time())}-{hashlib.sha256(f'{key}:{attempt}'.encode()).hexdigest()[:20]}"


# ---- vLLM and SGLang -------------------------------------------------------------------------------------


class _IdServer(_LoopbackServer):
    """Shared by the vLLM and SGLang doubles: answers rendered to ids with `encode` and special ids."""

    def __init__(
        self,
        *,
        encode: Callable[[str], list[int]],
        think_start_id: int,
        think_end_id: int,
        eos_id: int,
        latency_s: float = 0.0,
        faults: dict[str, Any] | None = None,
        port: int = 0,
    ) -> None:
        super().__init__(latency_s=latency_s, faults=faults, port=port)
        self.encode = encode
        self.think_start_id, self.think_end_id, self.eos_id = think_start_id, think_end_id, eos_id

    def output_ids(self, ans: Answer, *, thinking: bool, finished: bool) -> list[int]:
        ids: list[int] = []
        if thinking:
            ids += [self.think_start_id, *self.encode(ans.reasoning), self.think_end_id]
        ids += self.encode(ans.content)
        for tc in ans.tool_calls:
            ids += self.encode(json.dumps(tc["function"], ensure_ascii=False))
        if finished:
            ids.append(self.eos_id)
        return ids

    def _count(self, thinking: bool) -> CountCompletion:
        return lambda r, c, tcs: len(self.output_ids(Answer(r, c, tcs, "stop"), thinking=thinking, finished=True))

    def generate(self, ans: Answer, *, thinking: bool, max_tokens: int | None) -> tuple[Answer, list[int]]:
        """Ids as a server emits them: at most `max_tokens`, cut mid-stream (no closing markers) on 'length'.

        The text fields of a cut answer are the longest prefixes that fit (what a detokenizer would show, roughly)."""
        ids = self.output_ids(ans, thinking=thinking, finished=True)
        if not max_tokens or len(ids) <= max_tokens:
            return ans, ids
        cut = truncate_answer(ans, max_tokens, self._count(thinking))
        return Answer(cut.reasoning, cut.content, [], "length"), ids[:max_tokens]


class SimulatedVLLMServer(_IdServer):
    """vLLM's POST /v1/chat/completions with `return_token_ids` (top-level prompt_token_ids, choices[0].token_ids).

    `supports_token_ids=False` imitates a server older than v0.10.2 (the flag is ignored); `reasoning_field`
    chooses `reasoning` (current) or `reasoning_content` (older releases).
    """

    base_path = "/v1"
    routes = ("/chat/completions",)

    def __init__(self, *, supports_token_ids: bool = True, reasoning_field: str = "reasoning", **kw: Any) -> None:
        super().__init__(**kw)
        self.supports_token_ids = supports_token_ids
        self.reasoning_field = reasoning_field

    def prompt_ids(self, messages: list, tools: list | None) -> list[int]:
        text = "".join(f"<|{m.get('role')}|>{m.get('content') or ''}" for m in messages) + "<|assistant|>"
        if tools:
            text = json.dumps(tools) + text
        return self.encode(text)

    async def handle(self, request: web.Request, body: dict[str, Any], at: float) -> web.StreamResponse:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return web.json_response(
                {"error": {"message": "messages required", "type": "BadRequestError", "param": None, "code": 400}},
                status=400,
            )
        seed = body.get("seed")
        key = request_key(messages, seed)
        attempt, n_seen = self._note(key, body, dict(request.headers))
        fault = self.plan.status_fault(key, attempt, n_seen)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        ok = lambda: json.dumps(self.answer(body)).encode()  # noqa: E731
        if fault is not None:
            resp = await self._status_fault_response(request, fault, ok)
            if resp is not None:
                self._record(key, attempt, at, fault, resp.status)
                return resp
        self._record(key, attempt, at, fault, 200)
        return web.json_response(self.answer(body))

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        messages, tools, seed = body["messages"], body.get("tools"), body.get("seed")
        key = request_key(messages, seed)
        thinking = (body.get("chat_template_kwargs") or {}).get("thinking", True) is not False
        ans = synthesize(messages, tools, key, thinking=thinking)
        q = self.plan.quality_faults(key, 0)
        count = self._count(thinking)
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        if "length" in q:
            max_tokens = max(1, count(ans.reasoning, ans.content, ans.tool_calls) // 2)
        ans, out_ids = self.generate(
            ans, thinking=thinking, max_tokens=max_tokens if isinstance(max_tokens, int) else None
        )
        p_ids = self.prompt_ids(messages, tools)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": ans.content or None,
            self.reasoning_field: ans.reasoning or None,
        }
        if ans.tool_calls:
            message["tool_calls"] = ans.tool_calls
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": ans.finish_reason,
            "stop_reason": None,
        }
        out: dict[str, Any] = {
            "id": f"chatcmpl-{key[:16]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or "simulated",
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(p_ids),
                "completion_tokens": len(out_ids),
                "total_tokens": len(p_ids) + len(out_ids),
            },
        }
        if self.supports_token_ids and body.get("return_token_ids"):
            out["prompt_token_ids"] = p_ids
            choice["token_ids"] = out_ids
        return out


class SimulatedSGLangServer(_IdServer):
    """SGLang's native POST /generate: `input_ids` in, `output_ids` + `meta_info` out.

    Rejects requests without `input_ids` or without `sampling_params.max_new_tokens` (SGLang's default is 128,
    which silently truncates reasoning; the double makes forgetting it loud). `decode` (optional) lets answers
    quote the prompt; text markers are used in `text` when special tokens are not skipped.
    """

    routes = ("/generate",)

    def __init__(
        self,
        *,
        decode: Callable[[list[int]], str] | None = None,
        think_start_text: str = "<think>",
        think_end_text: str = "</think>",
        eos_text: str = "<|im_end|>",
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self.decode = decode
        self.think_start_text, self.think_end_text, self.eos_text = think_start_text, think_end_text, eos_text

    async def handle(self, request: web.Request, body: dict[str, Any], at: float) -> web.StreamResponse:
        input_ids = body.get("input_ids")
        sp = body.get("sampling_params") if isinstance(body.get("sampling_params"), dict) else {}
        if not isinstance(input_ids, list) or not input_ids or not all(isinstance(x, int) for x in input_ids):
            return web.json_response({"error": {"message": "input_ids (list[int]) is required"}}, status=400)
        if not isinstance(sp.get("max_new_tokens"), int):
            return web.json_response(
                {"error": {"message": "sampling_params.max_new_tokens must be set explicitly"}}, status=400
            )
        key = ids_key(input_ids, sp.get("sampling_seed"))
        attempt, n_seen = self._note(key, body, dict(request.headers))
        fault = self.plan.status_fault(key, attempt, n_seen)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        ok = lambda: json.dumps(self.answer(body)).encode()  # noqa: E731
        if fault is not None and fault not in ("no_choices", "error_200"):
            resp = await self._status_fault_response(request, fault, ok)
            if resp is not None:
                self._record(key, attempt, at, fault, resp.status)
                return resp
        if fault == "error_200":
            self._record(key, attempt, at, fault, 200)
            out = self.answer(body)
            out["meta_info"]["finish_reason"] = {"type": "abort", "message": "simulated abort"}
            return web.json_response(out)
        self._record(key, attempt, at, fault, 200)
        return web.json_response(self.answer(body))

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        input_ids = body["input_ids"]
        sp = body.get("sampling_params") or {}
        key = ids_key(input_ids, sp.get("sampling_seed"))
        prompt_text = self.decode(input_ids) if self.decode else ""
        ans = synthesize([{"role": "user", "content": prompt_text}], None, key, thinking=True)
        count = self._count(True)
        max_new = int(sp["max_new_tokens"])
        if "length" in self.plan.quality_faults(key, 0):
            max_new = max(1, min(max_new, count(ans.reasoning, ans.content, []) // 2))
        ans, out_ids = self.generate(ans, thinking=True, max_tokens=max_new)
        finished = ans.finish_reason != "length"
        if finished:
            text = f"{self.think_start_text}{ans.reasoning}{self.think_end_text}{ans.content}"
            if not sp.get("skip_special_tokens", True) and sp.get("no_stop_trim", False):
                text += self.eos_text
        else:
            text = f"{self.think_start_text}{ans.reasoning}" + (
                f"{self.think_end_text}{ans.content}" if ans.content else ""
            )
        fr = {"type": "stop", "matched": self.eos_id} if finished else {"type": "length", "length": len(out_ids)}
        rid = body.get("rid") or key
        return {
            "text": text,
            "output_ids": out_ids,
            "meta_info": {
                "id": rid,
                "finish_reason": fr,
                "prompt_tokens": len(input_ids),
                "completion_tokens": len(out_ids),
                "cached_tokens": 0,
                "e2e_latency": self.latency_s,
            },
        }
