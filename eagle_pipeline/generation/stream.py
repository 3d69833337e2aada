"""Streamed chat completions: server-sent events parsed incrementally and reassembled into the equivalent
non-streaming body.

`ChatStreamAssembler` takes the raw lines of an SSE response one at a time (`feed_line`): `:` comment lines are
keep-alives (counted; they only prove the connection is alive), `data:` lines are `chat.completion.chunk` objects
whose deltas are concatenated (`reasoning`, else the text of `reasoning_details`; `content`; `tool_calls` fragments
by `index`; vLLM's `token_ids`, and `prompt_token_ids` from the first chunk), and the final empty-choices chunk
carries `usage`. `body()` returns the chat completion a non-streaming request would have returned, which goes
through the same parser (`backends.parse_chat_completion`), so a streamed and a non-streamed answer give the same row.

Every way a stream can fail is a RequestFailure of an existing class, so it is retried and recorded like any other
failed attempt and never kept as a partial row: a mid-stream `error` chunk or `finish_reason: "error"`
(provider_error), a stream that ends without `[DONE]` (connection: the connection was cut), one that ends without a
finish reason (provider_error), and keep-alives with no data for longer than `keepalive_only_max_s` (timeout).
"""

from __future__ import annotations

import json
import time
from typing import Any

from eagle_pipeline.generation import failures as F
from eagle_pipeline.generation.failures import RequestFailure

_DONE = "[DONE]"


class ChatStreamAssembler:
    """Reassembles one streamed chat completion, line by line; raises RequestFailure as soon as the stream fails."""

    def __init__(self, *, keepalive_only_max_s: float | None = None, status: int = 200) -> None:
        self.keepalive_only_max_s = keepalive_only_max_s
        self.status = status
        self.chunks = 0
        self.keepalives = 0
        self.done = False
        self._data: list[str] = []  # data lines of the event being read (an event may span several)
        self._last_data = time.monotonic()
        self._top: dict[str, Any] = {}  # id, model, provider, created, ... of the first chunk
        self._prompt_ids: list[int] | None = None
        self._role: str | None = None
        self._reasoning: list[str] | None = None
        self._reasoning_field = "reasoning"
        self._details: dict[int, dict[str, Any]] = {}
        self._content: list[str] | None = None
        self._tools: dict[int, dict[str, Any]] = {}
        self._token_ids: list[int] | None = None
        self._finish: Any = None
        self._choice_extra: dict[str, Any] = {}  # native_finish_reason, stop_reason, logprobs
        self._usage: Any = None

    # ---- input ---------------------------------------------------------------------------------------------
    def feed_line(self, raw: bytes) -> None:
        """One line of the response body (with or without its line ending)."""
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:
            self._dispatch()
            return
        if line.startswith(":"):
            self.keepalives += 1
            limit = self.keepalive_only_max_s
            if limit is not None and time.monotonic() - self._last_data > limit:
                raise RequestFailure(
                    F.TIMEOUT,
                    f"only keep-alives for over {limit:g} s ({self.keepalives} comments, {self.chunks} chunks)",
                    True,
                    self.status,
                )
            return
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        # `event:`, `id:`, `retry:` carry nothing a chat completion needs.

    def _dispatch(self) -> None:
        if not self._data:
            return
        data = "\n".join(self._data)
        self._data = []
        self._last_data = time.monotonic()
        if self.done:
            return  # nothing may follow [DONE]; ignore rather than fail a complete answer
        if data.strip() == _DONE:
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError as exc:
            raise RequestFailure(
                F.MALFORMED_BODY, F.truncate(f"stream chunk {self.chunks + 1} is not JSON: {exc}"), True, self.status
            ) from None
        self.chunks += 1
        self._chunk(chunk)

    def _chunk(self, chunk: Any) -> None:
        if not isinstance(chunk, dict):
            raise RequestFailure(F.MALFORMED_BODY, f"stream chunk {self.chunks} is not an object", True, self.status)
        if chunk.get("error"):
            raise _mid_stream(F.classify_body_error(chunk["error"], self.status), self.chunks)
        for k in ("id", "model", "provider", "object", "created", "system_fingerprint"):
            if k in chunk and k not in self._top:
                self._top[k] = chunk[k]
        if self._prompt_ids is None and isinstance(chunk.get("prompt_token_ids"), list):
            self._prompt_ids = chunk["prompt_token_ids"]
        if chunk.get("usage") is not None:
            self._usage = chunk["usage"]
        choices = chunk.get("choices")
        if not choices:
            return
        ch = choices[0]
        if not isinstance(ch, dict):
            raise RequestFailure(F.MALFORMED_BODY, "stream chunk choices[0] is not an object", True, self.status)
        if ch.get("error"):
            raise _mid_stream(F.classify_body_error(ch["error"], self.status), self.chunks)
        if self._prompt_ids is None and isinstance(ch.get("prompt_token_ids"), list):
            self._prompt_ids = ch["prompt_token_ids"]
        delta = ch.get("delta")
        if isinstance(delta, dict):
            self._delta(delta)
        ids = ch.get("token_ids")
        if isinstance(ids, list):
            if self._token_ids is None:
                self._token_ids = []
            self._token_ids.extend(ids)
        for k in ("native_finish_reason", "stop_reason", "logprobs"):
            if ch.get(k) is not None:
                self._choice_extra[k] = ch[k]
        finish = ch.get("finish_reason")
        if finish == "error":
            raise _mid_stream(RequestFailure(F.PROVIDER_ERROR, "finish_reason 'error'", True, self.status), self.chunks)
        if finish is not None:
            self._finish = finish

    def _delta(self, delta: dict[str, Any]) -> None:
        if isinstance(delta.get("role"), str):
            self._role = delta["role"]
        text = None
        for field in ("reasoning", "reasoning_content"):
            if isinstance(delta.get(field), str):
                text, self._reasoning_field = delta[field], field
                break
        details = delta.get("reasoning_details")
        if isinstance(details, list):
            from_details = []
            for d in details:
                if not isinstance(d, dict):
                    continue
                idx = d.get("index", 0) if isinstance(d.get("index"), int) else 0
                merged = self._details.get(idx)
                if merged is None:
                    self._details[idx] = dict(d)
                elif isinstance(d.get("text"), str):
                    merged["text"] = (merged.get("text") or "") + d["text"]
                if d.get("type") in ("reasoning.text", "reasoning.summary") and isinstance(d.get("text"), str):
                    from_details.append(d["text"])
            if text is None and from_details:
                text = "".join(from_details)  # a provider that sends only reasoning_details
        if text is not None:
            (self._reasoning if self._reasoning is not None else self._start("_reasoning")).append(text)
        if isinstance(delta.get("content"), str):
            (self._content if self._content is not None else self._start("_content")).append(delta["content"])
        tool_calls = delta.get("tool_calls")
        if isinstance(tool_calls, list):
            for frag in tool_calls:
                if isinstance(frag, dict):
                    self._tool_fragment(frag)

    def _start(self, attr: str) -> list[str]:
        parts: list[str] = []
        setattr(self, attr, parts)
        return parts

    def _tool_fragment(self, frag: dict[str, Any]) -> None:
        idx = frag.get("index") if isinstance(frag.get("index"), int) else len(self._tools)
        call = self._tools.get(idx)
        if call is None:
            call = self._tools[idx] = {
                "id": None,
                "type": "function",
                "index": idx,
                "function": {"name": "", "arguments": ""},
            }
        if frag.get("id"):
            call["id"] = frag["id"]
        if frag.get("type"):
            call["type"] = frag["type"]
        fn = frag.get("function")
        if isinstance(fn, dict):
            if fn.get("name"):
                call["function"]["name"] += fn["name"]
            if isinstance(fn.get("arguments"), str):
                call["function"]["arguments"] += fn["arguments"]

    # ---- output --------------------------------------------------------------------------------------------
    def body(self) -> dict[str, Any]:
        """The equivalent non-streaming chat completion; raises RequestFailure for an incomplete stream."""
        self._dispatch()  # a last event without its blank line
        if not self.done:
            raise RequestFailure(
                F.CONNECTION,
                f"stream ended without [DONE] after {self.chunks} chunks (connection cut)",
                True,
                self.status,
            )
        if self._finish is None:
            raise RequestFailure(
                F.PROVIDER_ERROR, f"stream ended without a finish_reason after {self.chunks} chunks", True, self.status
            )
        message: dict[str, Any] = {
            "role": self._role or "assistant",
            "content": "".join(self._content) if self._content is not None else None,
            self._reasoning_field: "".join(self._reasoning) if self._reasoning is not None else None,
        }
        if self._details:
            message["reasoning_details"] = [self._details[i] for i in sorted(self._details)]
        if self._tools:
            message["tool_calls"] = [self._tools[i] for i in sorted(self._tools)]
        choice: dict[str, Any] = {"index": 0, "finish_reason": self._finish, **self._choice_extra, "message": message}
        if self._token_ids is not None:
            choice["token_ids"] = self._token_ids
        out: dict[str, Any] = {**self._top, "object": "chat.completion", "choices": [choice]}
        if self._usage is not None:
            out["usage"] = self._usage
        if self._prompt_ids is not None:
            out["prompt_token_ids"] = self._prompt_ids
        return out


def _mid_stream(f: RequestFailure, chunks: int) -> RequestFailure:
    f.message = F.truncate(f"mid-stream error after {chunks} chunks: {f.message}")
    return f
