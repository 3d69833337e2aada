"""Streamed chat completions: server-sent events parsed incrementally and reassembled into the equivalent
non-streaming body.

`ChatStreamAssembler` takes the bytes of an SSE response as they arrive (`feed`, cut anywhere): `:` comment lines
are keep-alives (they reset nothing but prove liveness; a stream with only them for `keepalive_only_max_s` fails),
`data:` events are `chat.completion.chunk` objects whose deltas are concatenated (`reasoning`, else the text of
`reasoning_details`; `content`; `tool_calls` by `index`; vLLM's `token_ids`, and `prompt_token_ids` from the first
chunk, whose `content: ""` vLLM always sends: not content), and the final empty-choices chunk carries `usage`.
`body()` returns the chat completion a non-streaming request would have returned, parsed by the same parser
(`wire.parse_chat_completion`): a streamed and a non-streamed answer give the same row.

Every way a stream can fail is a RequestFailure of an existing class, so it is retried and recorded like any other
failed attempt and never kept as a partial row: a mid-stream `error` chunk or `finish_reason: "error"`
(provider_error), a stream that ends without `[DONE]` (connection: the connection was cut), one that ends without a
finish reason (provider_error), and keep-alives with no data for longer than `keepalive_only_max_s` (timeout).
"""

from __future__ import annotations

import json
import time
from itertools import repeat
from typing import Any

import orjson

from eagle_pipeline.shared import failures as F
from eagle_pipeline.shared.failures import RequestFailure

_DONE = "[DONE]"
# Received bytes decoded per batch: ~1,000 OpenRouter chunks, so the per-batch cost (the first chunk decoded with its
# envelope, one join and split) is negligible, while 2,000 long streams in flight hold at most ~0.5 GB undecoded.
BATCH_BYTES = 256 * 1024


class ChatStreamAssembler:
    """Reassembles one streamed chat completion from the body's bytes as they arrive (`feed`); `body()` at the end.

    Liveness is judged as bytes arrive; events are framed and their JSON decoded in batches: once `batch_bytes`
    have been received, the complete events so far (up to the last blank line) are decoded in one call (the
    envelope every chunk repeats decoded once, `_joined`) and applied, and only the incomplete tail is kept; the
    rest at the end, in `body()`. Per-chunk work is the client's main CPU cost at thousands of streams in flight,
    which batching keeps low, while memory per stream stays at the decoded texts plus one batch instead of every
    received byte (~300 bytes of JSON per token: ~20 MB for a 64K-token answer). An error chunk in an early batch
    raises from `feed`; a chunk that is not JSON (or not an object) is reported by `body()`, as if the stream had
    been decoded at once. `batch_bytes=math.inf` decodes the whole stream at the end.
    """

    def __init__(
        self, *, keepalive_only_max_s: float | None = None, status: int = 200, batch_bytes: float = BATCH_BYTES
    ) -> None:
        self.keepalive_only_max_s = keepalive_only_max_s
        self.status = status
        self.batch_bytes = batch_bytes
        self.chunks = 0
        self.keepalives = 0
        self.done = False
        self._raw: list[bytes] = []  # the bytes received since the last batch (its incomplete tail first)
        self._buffered = 0  # their length
        self._next_batch = batch_bytes  # `_buffered` at which the next batch is decoded
        self._applied = 0  # chunks decoded and applied so far (the number of the next batch's first chunk - 1)
        self._malformed: RequestFailure | None = None  # a batch's chunk that is not JSON: reported by `body()`
        self._events: list[bytes] = []  # data payloads of the complete events of this batch before [DONE]
        self._last_data = time.monotonic()
        self._top: dict[str, Any] = {}  # id, model, provider, created, ... (first seen)
        self._prompt_ids: list[int] | None = None
        self._role: str | None = None
        self._reasoning: list[str] | None = None
        self._reasoning_field = "reasoning"
        # Texts are collected in lists and joined once: growing one string per delta (thousands) is quadratic.
        self._details: dict[int, tuple[dict[str, Any], list[str]]] = {}  # index -> (first fragment, texts)
        self._content: list[str] | None = None
        self._tools: dict[int, tuple[dict[str, Any], list[str], list[str]]] = {}  # index -> (call, names, args)
        self._token_ids: list[int] | None = None
        self._finish: Any = None
        self._choice_extra: dict[str, Any] = {}  # native_finish_reason, stop_reason of the finish chunk
        self._usage: Any = None
        self._missing = ["id", "model", "provider", "object", "created", "system_fingerprint"]  # not yet in _top
        self._orjson = True  # the chunks were decoded by orjson, which can write the body back (`body_json`)

    # ---- input ---------------------------------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        """The next bytes of the response body, cut anywhere.

        Liveness is judged here (two substring scans per network read); events are framed and decoded a batch at
        a time (`_batch`, every `batch_bytes`): per-event work as bytes arrive was the client's largest cost at
        thousands of streams. Raises RequestFailure for keep-alives only for too long, or an error chunk.
        """
        self._raw.append(data)
        self._buffered += len(data)
        if self._buffered >= self._next_batch:
            self._batch()
        if b"data:" in data:
            self._last_data = time.monotonic()
        elif self.keepalive_only_max_s is not None and (data.startswith(b":") or b"\n:" in data):
            idle = time.monotonic() - self._last_data
            if idle > self.keepalive_only_max_s:
                raise RequestFailure(
                    F.TIMEOUT,
                    f"only keep-alives for over {self.keepalive_only_max_s:g} s (no data for {idle:.1f} s)",
                    True,
                    self.status,
                )

    @property
    def buffered_bytes(self) -> int:
        """Received bytes not yet decoded: at most about `batch_bytes` plus one event and one network read."""
        return self._buffered

    def _batch(self) -> None:
        """Decode and apply the complete events received so far; keep the incomplete tail."""
        self._frame(final=False)
        self._apply_events()
        # The texts so far as one string each (in place: the lists are appended to): a str per delta is ~3x the
        # text's size.
        for parts in (
            self._reasoning,
            self._content,
            *(texts for _, texts in self._details.values()),
            *(args for _, _, args in self._tools.values()),
        ):
            if parts is not None and len(parts) > 1:
                parts[:] = ["".join(parts)]
        # Not before `batch_bytes` more: an event longer than a batch (a vLLM first chunk with every prompt id) is
        # framed again only that often, not per read.
        self._next_batch = self._buffered + self.batch_bytes

    def _frame(self, *, final: bool = True) -> None:
        """Split the received bytes into events: data payloads up to `[DONE]`, keep-alive comments counted.

        Not `final`: only the events before the last blank line; the rest is kept for the next batch (a CRLF
        cut after its CR included). Splitting at a blank line the left-to-right split found gives the same events as
        splitting the whole body at once.
        """
        raw = b"".join(self._raw)
        self._raw, self._buffered = [], 0
        hold = b""
        if not final and raw[-1:] == b"\r":  # maybe the first half of `\r\n`: normalised with what follows
            raw, hold = raw[:-1], b"\r"
        if b"\r" in raw:
            raw = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        # Every event one line (what OpenRouter and vLLM send): the lines alternate event and blank, an odd number of
        # them, and the events are every other line, as splitting at blank lines gives them. Splitting at a byte is
        # ~2x faster than at two, and the check is one join.
        lines = raw.split(b"\n")
        one_line = len(lines) % 2 == 1 and not b"".join(lines[1::2])
        events = lines[::2] if one_line else raw.split(b"\n\n")
        del lines
        tail = events.pop()  # after the last blank line: `[DONE]` without its blank line, or a chunk cut short
        if not final:
            rest = tail + hold
            self._raw, self._buffered = ([rest] if rest else []), len(rest)
            raw = tail = b""
        if self.done:  # nothing may follow [DONE]; ignore rather than fail a complete answer (keep-alives counted)
            self.keepalives += sum(line[:1] == b":" for ev in events + [tail] for line in ev.split(b"\n"))
            return
        if one_line or (b"\n" not in b"".join(events) and b"\n" not in tail):
            # Every event is one line: framed without a Python step per event.
            self.keepalives += [ev[:1] for ev in events].count(b":") + (tail[:1] == b":")  # one line each
            payloads = [ev[5:] for ev in events if ev[:5] == b"data:"]
            if tail[:5] == b"data:":
                payloads.append(tail[5:])
                tail = b""
            done_at = next((i for i, p in enumerate(payloads) if len(p) < 16 and p.strip() == b"[DONE]"), None)
            if done_at is not None:
                self.done = True
                del payloads[done_at:]
            elif payloads and tail == b"" and final and raw[-1:] != b"\n":
                payloads.pop()  # the last event had no blank line and is not [DONE]: a chunk cut short
            self._events = payloads
            self.chunks += len(payloads)
            return
        for ev in events:
            if ev.startswith(b"data:") and b"\n" not in ev:  # the common case: one data line
                self._data_event(ev[5:])
            elif ev:
                self._general_event(ev)
        if tail.strip():
            complete = len(self._events)
            self._general_event(tail)
            if not self.done:
                del self._events[complete:]

    def _general_event(self, ev: bytes) -> None:
        data: list[bytes] = []
        for line in ev.split(b"\n"):
            if line.startswith(b":"):
                self.keepalives += 1
            elif line.startswith(b"data:"):
                value = line[5:]
                data.append(value[1:] if value.startswith(b" ") else value)
            # `event:`, `id:`, `retry:` carry nothing a chat completion needs.
        if data:
            self._data_event(b"\n".join(data))

    def _data_event(self, payload: bytes) -> None:
        if self.done:
            return  # nothing may follow [DONE]; ignore rather than fail a complete answer
        if len(payload) < 16 and payload.strip() == b"[DONE]":
            self.done = True
            return
        self.chunks += 1
        self._events.append(payload)

    def _apply_events(self) -> None:
        """Decode and apply this batch's events; a chunk that is not JSON (or not an object) is kept for `body()`."""
        events, self._events = self._events, []
        if not events or self._malformed is not None:
            return  # after a malformed chunk nothing more is applied, as when the whole stream is decoded at once
        try:
            self._apply(self._decode(events))
        except RequestFailure as f:
            if f.error_class != F.MALFORMED_BODY:
                raise
            self._malformed = f
        self._applied += len(events)

    def _decode(self, events: list[bytes]) -> list[Any]:
        joined = _joined(events)
        try:
            return orjson.loads(joined)  # about 4x the standard library on these many small objects
        except orjson.JSONDecodeError:
            pass
        try:  # what orjson refuses and json takes (NaN, integers beyond 64 bits)
            self._orjson = False
            return json.loads(joined)
        except ValueError:
            pass
        for i, payload in enumerate(events, self._applied + 1):  # find the culprit for the message
            try:
                json.loads(payload)
            except ValueError as exc:
                raise RequestFailure(
                    F.MALFORMED_BODY, F.truncate(f"stream chunk {i} is not JSON: {exc}"), True, self.status
                ) from None
        raise RequestFailure(F.MALFORMED_BODY, "stream chunks are not JSON", True, self.status)

    def _apply(self, chunks: list[Any]) -> None:
        missing = self._missing
        for n, chunk in enumerate(chunks, self._applied + 1):
            if not isinstance(chunk, dict):
                raise RequestFailure(F.MALFORMED_BODY, f"stream chunk {n} is not an object", True, self.status)
            if chunk.get("error"):
                raise _mid_stream(F.classify_body_error(chunk["error"], self.status), n)
            if missing:
                for k in [k for k in missing if k in chunk]:
                    self._top[k] = chunk[k]
                    missing.remove(k)
            usage = chunk.get("usage")
            if usage is not None:
                self._usage = usage
            choices = chunk.get("choices")
            if n == 1 and isinstance(chunk.get("prompt_token_ids"), list):  # vLLM: in the first chunk
                self._prompt_ids = chunk["prompt_token_ids"]
            if not choices:
                continue
            ch = choices[0]
            if not isinstance(ch, dict):
                raise RequestFailure(
                    F.MALFORMED_BODY, f"stream chunk {n}: choices[0] is not an object", True, self.status
                )
            delta = ch.get("delta")
            if n == 1 and self._prompt_ids is not None and delta and delta.get("content") == "":
                delta = {k: v for k, v in delta.items() if k != "content"}  # vLLM's announcement: not content
            if delta:
                content = delta.get("content")
                if content is not None and len(delta) == 1 and self._content is not None:
                    self._content.append(content)  # the common chunk
                elif (  # the common reasoning chunk: `reasoning` and its one reasoning_details fragment
                    len(delta) == 2
                    and self._reasoning is not None
                    and (text := delta.get("reasoning")).__class__ is str
                    and (details := delta.get("reasoning_details")).__class__ is list
                    and len(details) == 1
                    and (fragment := details[0]).__class__ is dict
                    and (entry := self._details.get(fragment.get("index"))) is not None  # type: ignore[arg-type]
                    and (fragment_text := fragment.get("text")).__class__ is str
                ):
                    self._reasoning.append(text)
                    entry[1].append(fragment_text)
                elif isinstance(delta, dict):
                    self._delta(delta)
            ids = ch.get("token_ids")
            if ids is not None:
                if n == 1 and self._prompt_ids is None and isinstance(ch.get("prompt_token_ids"), list):
                    self._prompt_ids = ch["prompt_token_ids"]
                if isinstance(ids, list):
                    if self._token_ids is None:
                        self._token_ids = []
                    self._token_ids.extend(ids)
            finish = ch.get("finish_reason")
            if finish is not None or ch.get("error"):
                if ch.get("error"):
                    raise _mid_stream(F.classify_body_error(ch["error"], self.status), n)
                if finish == "error":
                    raise _mid_stream(RequestFailure(F.PROVIDER_ERROR, "finish_reason 'error'", True, self.status), n)
                self._finish = finish
                for k in ("native_finish_reason", "stop_reason"):
                    if ch.get(k) is not None:
                        self._choice_extra[k] = ch[k]

    def _delta(self, delta: dict[str, Any]) -> None:
        role = delta.get("role")
        if isinstance(role, str):
            self._role = role
        text = delta.get("reasoning")
        if text is None and delta.get("reasoning_content") is not None:
            text, self._reasoning_field = delta["reasoning_content"], "reasoning_content"
        details = delta.get("reasoning_details")
        if details and isinstance(details, list):
            from_details = self._detail_fragments(details)
            if text is None and from_details:
                text = "".join(from_details)  # a provider that sends only reasoning_details
        if isinstance(text, str):
            if self._reasoning is None:
                self._reasoning = []
            self._reasoning.append(text)
        content = delta.get("content")
        if isinstance(content, str):
            if self._content is None:
                self._content = []
            self._content.append(content)
        tool_calls = delta.get("tool_calls")
        if tool_calls and isinstance(tool_calls, list):
            for frag in tool_calls:
                if isinstance(frag, dict):
                    self._tool_fragment(frag)

    def _detail_fragments(self, details: list[Any]) -> list[str]:
        """Merge `reasoning_details` fragments by index; return their reasoning text."""
        texts = []
        for d in details:
            if not isinstance(d, dict):
                continue
            idx = d.get("index")
            if not isinstance(idx, int):
                idx = 0
            text = d.get("text")
            entry = self._details.get(idx)
            if entry is None:
                entry = self._details[idx] = ({k: v for k, v in d.items() if k != "text"}, [])
            if isinstance(text, str):
                entry[1].append(text)
                if d.get("type") in ("reasoning.text", "reasoning.summary"):
                    texts.append(text)
        return texts

    def _tool_fragment(self, frag: dict[str, Any]) -> None:
        idx: int = frag["index"] if isinstance(frag.get("index"), int) else len(self._tools)
        entry = self._tools.get(idx)
        if entry is None:
            entry = self._tools[idx] = ({"id": None, "type": "function", "index": idx}, [], [])
        call, names, args = entry
        if frag.get("id"):
            call["id"] = frag["id"]
        if frag.get("type"):
            call["type"] = frag["type"]
        fn = frag.get("function")
        if isinstance(fn, dict):
            if fn.get("name"):
                names.append(fn["name"])
            if isinstance(fn.get("arguments"), str):
                args.append(fn["arguments"])

    # ---- output --------------------------------------------------------------------------------------------
    def body(self) -> dict[str, Any]:
        """The equivalent non-streaming chat completion; raises RequestFailure for an incomplete stream."""
        self._frame(final=True)
        if not self.done:
            # An error chunk before the cut says more than the cut; a chunk that is not JSON is part of the cut.
            self._apply_events()
            cut = f"stream ended without [DONE] after {self.chunks} chunks (connection cut)"
            raise RequestFailure(F.CONNECTION, cut, True, self.status)
        self._apply_events()
        if self._malformed is not None:
            raise self._malformed
        if self._finish is None:
            unfinished = f"stream ended without a finish_reason after {self.chunks} chunks"
            raise RequestFailure(F.PROVIDER_ERROR, unfinished, True, self.status)
        message: dict[str, Any] = {
            "role": self._role or "assistant",
            "content": "".join(self._content) if self._content is not None else None,
            self._reasoning_field: "".join(self._reasoning) if self._reasoning is not None else None,
        }
        if self._details:
            message["reasoning_details"] = [
                {**first, "text": "".join(texts)} if texts else first
                for first, texts in (self._details[i] for i in sorted(self._details))
            ]
        if self._tools:
            message["tool_calls"] = [
                {**call, "function": {"name": "".join(names), "arguments": "".join(args)}}
                for call, names, args in (self._tools[i] for i in sorted(self._tools))
            ]
        choice: dict[str, Any] = {"index": 0, "finish_reason": self._finish, **self._choice_extra, "message": message}
        if self._token_ids is not None:
            choice["token_ids"] = self._token_ids
        out: dict[str, Any] = {**self._top, "object": "chat.completion", "choices": [choice]}
        if self._usage is not None:
            out["usage"] = self._usage
        if self._prompt_ids is not None:
            out["prompt_token_ids"] = self._prompt_ids
        return out

    def body_json(self, body: dict[str, Any]) -> str:
        """`body` (from `body()`) as compact JSON text: the stored `raw_response_json`.

        orjson writes it ~5x faster than the standard library, the same text but for the spelling of some floats
        (`0.00001` for `1e-05`: the same number); what only the standard library decodes (NaN, integers beyond 64
        bits) orjson cannot write back, so such a body is written by the standard library.
        """
        if self._orjson:
            return orjson.dumps(body).decode()
        return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def _joined(events: list[bytes]) -> bytes:
    """The events as one JSON array; when every chunk repeats the first one's envelope, without the repeats.

    Every chunk of a stream starts with the same top-level members (`id`, `provider`, `model`, `object`,
    `created`, ...) before `choices`: decoding them once instead of per chunk builds about half the objects. The
    first chunk is kept whole (it gives those members, and vLLM's `prompt_token_ids`), the envelope must be a
    complete run of top-level members without `usage` or `error` (which `_apply` reads from every chunk), and each
    other chunk must repeat it byte for byte up to its next member: `{` + the rest is then valid JSON exactly when
    the chunk is, with the members `_apply` reads unchanged. Otherwise the events are joined as they are.
    """
    n = _envelope(events)
    if not n:
        return b"[" + b",".join(events) + b"]"
    return b"[" + events[0] + b",{" + b",{".join([e[n:] for e in events[1:]]) + b"]"


def _envelope(events: list[bytes]) -> int:
    """The length of the envelope every chunk after the first repeats (0: none to cut)."""
    first = events[0] if len(events) > 2 else b""
    cut = first.find(b'"choices":')
    envelope = first[:cut]
    if cut < 2 or envelope[-1:] != b"," or b'"usage"' in envelope or b'"error"' in envelope:
        return 0
    try:  # a complete run of top-level members, not the inside of a nested object that holds a "choices" key
        if not isinstance(orjson.loads(envelope + b'"choices":null}'), dict):
            return 0
    except orjson.JSONDecodeError:
        return 0
    return cut if all(map(bytes.startswith, events[1:], repeat(envelope + b'"'))) else 0


def _mid_stream(f: RequestFailure, chunks: int) -> RequestFailure:
    f.message = F.truncate(f"mid-stream error after {chunks} chunks: {f.message}")
    return f
