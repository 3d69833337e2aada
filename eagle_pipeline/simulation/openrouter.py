"""The OpenRouter double: POST /api/v1/chat/completions with OpenRouter's bodies, usage, cost and error format."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from typing import Any

from aiohttp import web

from eagle_pipeline.simulation.answers import (
    Answer,
    AnswerLengths,
    CountCompletion,
    CountPrompt,
    crude_completion_tokens,
    crude_prompt_tokens,
    request_key,
    synthesize,
    tool_history_problem,
    truncate_answer,
)
from eagle_pipeline.simulation.faults import PROMPT_INJECTED_TOKENS, error_response, fault_response
from eagle_pipeline.simulation.server import LoopbackServer
from eagle_pipeline.simulation.streaming import STREAM_FAULTS, StreamStyle, completion_chunks, write_stream


def _auth_of(request: web.Request) -> str:
    return request.headers.get("Authorization", "")


class SimulatedOpenRouterServer(LoopbackServer):
    """OpenRouter's POST /api/v1/chat/completions on loopback (`url` is the base URL to put in BackendSpec.endpoint).

    A request with `stream: true` is answered with server-sent events paced by `stream` (a `StreamStyle` or its
    keyword arguments: the silent thinking phase with keep-alives, delta size, delay between chunks); the stream
    faults (`streaming.STREAM_FAULTS`) apply to streamed requests only. Each request waits `latency_s` plus a share
    of `latency_spread_s` fixed by its request key and attempt (answers of varied length), before it is answered.
    `lengths` (an `AnswerLengths` or its keyword arguments) makes answers as long as a reasoning model's.
    """

    base_path = "/api/v1"
    routes = ("/chat/completions",)

    def __init__(
        self,
        *,
        latency_s: float = 0.0,
        latency_spread_s: float = 0.0,
        faults: dict[str, Any] | None = None,
        count_completion_tokens: CountCompletion | None = None,
        count_prompt_tokens: CountPrompt | None = None,
        price_per_m_prompt: float = 0.60,
        price_per_m_completion: float = 2.50,
        provider_name: str = "Simulated",
        api_key: str | None = None,
        tool_call_rate: float = 0.6,
        tool_rounds: int = 0,
        model: str | None = None,
        stream: StreamStyle | dict[str, Any] | None = None,
        lengths: AnswerLengths | dict[str, Any] | None = None,
        port: int = 0,
    ) -> None:
        super().__init__(latency_s=latency_s, faults=faults, port=port)
        self.latency_spread_s = float(latency_spread_s)
        self.served_model = model  # reported as `model` in responses; None echoes the requested model
        self.count_completion = count_completion_tokens or crude_completion_tokens
        self.count_prompt = count_prompt_tokens or crude_prompt_tokens
        self.price_prompt = price_per_m_prompt
        self.price_completion = price_per_m_completion
        self.provider_name = provider_name
        self.api_key = api_key
        self.tool_call_rate = tool_call_rate
        self.tool_rounds = tool_rounds
        self.stream_style = stream if isinstance(stream, StreamStyle) else StreamStyle(**(stream or {}))
        self.lengths = lengths if isinstance(lengths, AnswerLengths) or lengths is None else AnswerLengths(**lengths)

    async def handle(self, request: web.Request, body: dict[str, Any], at: float) -> web.StreamResponse:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not body.get("model"):
            return error_response(400, "messages and model are required", {"error_type": "invalid_request"})
        problem = tool_history_problem(messages)
        if problem:
            return error_response(400, problem, {"error_type": "invalid_request"})
        seed = body.get("seed")
        key = request_key(messages, seed)
        headers = {k: v for k, v in request.headers.items()}
        attempt, n_seen = self._note(key, body, headers)
        echo = f" (received Authorization: {_auth_of(request)})" if self.plan.echo_auth else ""
        if self.api_key is not None and _auth_of(request) != f"Bearer {self.api_key}":
            self._record(key, attempt, at, "bad_key", 401)
            return error_response(401, "User not found." + echo, {"error_type": "authentication"})
        fault = self.plan.status_fault(key, attempt, n_seen)
        streaming = body.get("stream") is True
        if fault in STREAM_FAULTS and not streaming:
            fault = None
        latency = self.latency_s
        if self.latency_spread_s:
            latency += self.latency_spread_s * random.Random(f"{key}:{attempt}").random()
        if latency:
            await asyncio.sleep(latency)
        ok = lambda: self._answer_bytes(body, attempt, n_seen)  # noqa: E731
        if fault is not None and fault not in STREAM_FAULTS:
            resp = await fault_response(self.plan, request, fault, ok, echo)
            if resp is not None:
                self._record(key, attempt, at, fault, resp.status)
                return resp
        self._record(key, attempt, at, fault, 200)
        if streaming:
            completion = self.answer(body, attempt=attempt, n_seen=n_seen)
            chunks = completion_chunks(completion, chunk_chars=self.stream_style.chunk_chars)
            sent = await write_stream(
                request,
                chunks,
                self.stream_style,
                fault=fault,
                idle_gap_s=self.plan.timeout_sleep_s,
                headers={"X-Generation-Id": completion["id"]},
            )
            return sent if fault is not None else await self._send_answer(request, sent, key, attempt)
        payload = ok()
        resp = web.Response(
            body=payload,
            status=200,
            content_type="application/json",
            headers={"X-Generation-Id": _gen_id(key, attempt)},
        )
        return await self._send_answer(request, resp, key, attempt)

    def answer(self, body: dict[str, Any], *, attempt: int = 1, n_seen: int = 0) -> dict[str, Any]:
        """The success body for a request (also used by tests to know what to expect)."""
        messages, tools = body["messages"], body.get("tools")
        key = request_key(messages, body.get("seed"))
        reasoning_opt = body["reasoning"] if isinstance(body.get("reasoning"), dict) else {}
        thinking = reasoning_opt.get("enabled", True) is not False and reasoning_opt.get("effort") != "none"
        q = self.plan.quality_faults(key, n_seen)
        ans = self._final_answer(body, key, thinking, q)
        return {
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
                    "message": _message(ans),
                }
            ],
            "usage": self._usage(messages, tools, thinking, ans, q),
        }

    def _final_answer(self, body: dict[str, Any], key: str, thinking: bool, q: set[str]) -> Answer:
        """The deterministic answer with this request's quality faults applied and cut to its `max_tokens`."""
        messages, tools = body["messages"], body.get("tools")
        options: dict[str, Any] = {"thinking": thinking, "tool_rounds": self.tool_rounds, "lengths": self.lengths}
        ans = synthesize(messages, tools, key, tool_call_rate=self.tool_call_rate, **options)
        if "bad_tool_args" in q and tools and not ans.tool_calls:
            ans = synthesize(messages, tools, key, tool_call_rate=1.0, **options)
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
        return ans

    def _usage(self, messages: list, tools: list | None, thinking: bool, ans: Answer, q: set[str]) -> dict[str, Any]:
        """OpenRouter's `usage` for an answer: token counts (wrong on purpose under billing faults) and cost."""
        completion_tokens = self.count_completion(ans.reasoning, ans.content, ans.tool_calls)
        reasoning_tokens = self.count_completion(ans.reasoning, "", []) if ans.reasoning else 0
        if "billing_mismatch" in q:
            completion_tokens = max(completion_tokens + 1, round(completion_tokens * 1.15))
        prompt_tokens = self.count_prompt(messages, tools, thinking)
        if "prompt_mismatch" in q:
            prompt_tokens += PROMPT_INJECTED_TOKENS
        cost = (prompt_tokens * self.price_prompt + completion_tokens * self.price_completion) / 1e6
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "cost": round(cost, 10),
            "is_byok": False,
        }

    def _answer_bytes(self, body: dict[str, Any], attempt: int, n_seen: int) -> bytes:
        return json.dumps(self.answer(body, attempt=attempt, n_seen=n_seen), ensure_ascii=False).encode()


def _gen_id(key: str, attempt: int) -> str:
    return f"gen-{int(time.time())}-{hashlib.sha256(f'{key}:{attempt}'.encode()).hexdigest()[:20]}"


def _message(ans: Answer) -> dict[str, Any]:
    """The assistant message of an OpenRouter completion: content, reasoning (and its details), tool calls."""
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
    return message
