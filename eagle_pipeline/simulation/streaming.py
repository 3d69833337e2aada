"""Streamed answers of the simulated servers: a non-streaming completion body split into `chat.completion.chunk`
events, written as server-sent events with keep-alive comments, and the stream failures on request.

The chunks are cut from the very body a non-streaming request gets, so a client that reassembles them faithfully
must obtain that body back (the equivalence the tests check). Layout, as OpenRouter and vLLM send it: a first chunk
with the role (and, for vLLM, `prompt_token_ids`), reasoning deltas (`reasoning` plus a `reasoning_details` text
fragment when the body has details), content deltas, tool-call fragments (id and name first, then the arguments cut
mid-string), a finish chunk, a usage chunk with empty `choices`, then `data: [DONE]`. With `token_ids` in the body
(vLLM's `return_token_ids`), every chunk after the first carries its share of the ids.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

KEEPALIVE = b": OPENROUTER PROCESSING\n\n"

STREAM_FAULTS = (
    "stream_error",  # an `error` chunk with finish_reason 'error' after partial content (HTTP status stays 200)
    "stream_finish_error",  # finish_reason 'error' without an error object, after partial content
    "stream_cut",  # the connection closes after partial content: no finish reason, no [DONE]
    "stream_no_finish",  # every delta and [DONE], but no chunk carries a finish reason
    "stream_idle",  # silence longer than the client's idle timeout after partial content
    "stream_trickle",  # keep-alive comments forever, never any content
)


@dataclass(frozen=True)
class StreamStyle:
    """How a simulated server paces a stream: a silent "thinking" phase of `thinking_s` seconds with a keep-alive
    comment every `keepalive_s`, deltas of about `chunk_chars` characters, `chunk_delay_s` between chunks."""

    thinking_s: float = 0.0
    keepalive_s: float = 0.1
    chunk_chars: int = 64
    chunk_delay_s: float = 0.0


def _pieces(text: str, n: int) -> list[str]:
    n = max(1, n)
    return [text[i : i + n] for i in range(0, len(text), n)]


def completion_chunks(
    completion: dict[str, Any], *, chunk_chars: int, include_usage: bool = True, announce_content: bool = False
) -> list[dict]:
    """The chunk objects of a streamed form of `completion` (a non-streaming chat completion body).

    The first delta names the role, with `content: ""` when the answer has content, or always with
    `announce_content` (vLLM's first chunk is `{"role": "assistant", "content": ""}` whatever follows)."""
    choice = completion["choices"][0]
    msg = choice["message"]
    base: dict[str, Any] = {
        k: completion[k] for k in ("id", "provider", "model", "created", "system_fingerprint") if k in completion
    }
    base["object"] = "chat.completion.chunk"

    def chunk(delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None, **extra}]}

    first_delta: dict[str, Any] = {"role": msg.get("role", "assistant")}
    if isinstance(msg.get("content"), str) or announce_content:
        first_delta["content"] = ""
    first = chunk(first_delta)
    if "prompt_token_ids" in completion:
        first["prompt_token_ids"] = completion["prompt_token_ids"]
    deltas: list[dict[str, Any]] = []
    rfield = "reasoning_content" if msg.get("reasoning_content") is not None else "reasoning"
    details = msg.get("reasoning_details") or []
    for piece in _pieces(msg.get(rfield) or "", chunk_chars):
        d: dict[str, Any] = {rfield: piece}
        if details:
            d["reasoning_details"] = [{**details[0], "text": piece}]
        deltas.append(d)
    deltas += [{"content": piece} for piece in _pieces(msg.get("content") or "", chunk_chars)]
    for i, tc in enumerate(msg.get("tool_calls") or []):
        fn = tc["function"]
        idx = tc.get("index", i)
        deltas.append(
            {
                "tool_calls": [
                    {
                        "index": idx,
                        "id": tc["id"],
                        "type": tc["type"],
                        "function": {"name": fn["name"], "arguments": ""},
                    }
                ]
            }
        )
        # Arguments cut mid-string, as providers do: a client must concatenate before parsing.
        deltas += [
            {"tool_calls": [{"index": idx, "function": {"arguments": piece}}]}
            for piece in _pieces(fn["arguments"], max(1, chunk_chars // 4))
        ]
    finish_extra = {k: v for k, v in choice.items() if k not in ("index", "message", "token_ids", "finish_reason")}
    out = [first] + [chunk(d) for d in deltas] + [chunk({}, **finish_extra)]
    out[-1]["choices"][0]["finish_reason"] = choice["finish_reason"]
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        n = len(out) - 1
        for k, c in enumerate(out[1:]):
            c["choices"][0]["token_ids"] = ids[k * len(ids) // n : (k + 1) * len(ids) // n]
    if include_usage and completion.get("usage") is not None:
        out.append({**base, "choices": [], "usage": completion["usage"]})
    return out


def _event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def write_stream(
    request: web.Request,
    chunks: list[dict[str, Any]],
    style: StreamStyle,
    *,
    fault: str | None = None,
    idle_gap_s: float = 3600.0,
    headers: dict[str, str] | None = None,
) -> web.StreamResponse:
    """Send `chunks` as an SSE response paced by `style`, failing as `fault` (one of STREAM_FAULTS) asks."""
    resp = web.StreamResponse(
        status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **(headers or {})}
    )
    await resp.prepare(request)
    loop = asyncio.get_running_loop()
    end_thinking = loop.time() + style.thinking_s
    while fault == "stream_trickle" or loop.time() < end_thinking:
        await resp.write(KEEPALIVE)
        await asyncio.sleep(style.keepalive_s)
    *body, finish = [c for c in chunks if c.get("choices")]
    tail = [c for c in chunks if not c.get("choices")]  # the usage chunk
    half = max(1, len(body) // 2)
    for i, c in enumerate(body):
        if i == half and fault in ("stream_error", "stream_finish_error", "stream_cut", "stream_idle"):
            if fault == "stream_cut":
                if request.transport is not None:
                    request.transport.close()
                return resp
            if fault == "stream_idle":
                await asyncio.sleep(idle_gap_s)
            else:
                err = {**{k: v for k, v in c.items() if k != "choices"}}
                err["choices"] = [
                    {"index": 0, "delta": {"content": ""}, "finish_reason": "error", "native_finish_reason": "error"}
                ]
                if fault == "stream_error":
                    err["error"] = {
                        "code": 502,
                        "message": "Provider disconnected mid-stream",
                        "metadata": {"provider_name": "Simulated", "error_type": "provider_unavailable"},
                    }
                await resp.write(_event(err))
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
        await resp.write(_event(c))
        if style.chunk_delay_s:
            await asyncio.sleep(style.chunk_delay_s)
    if fault == "stream_no_finish":
        finish = json.loads(json.dumps(finish))
        finish["choices"][0]["finish_reason"] = None
        finish["choices"][0].pop("native_finish_reason", None)
    await resp.write(_event(finish))
    for c in tail:
        await resp.write(_event(c))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
