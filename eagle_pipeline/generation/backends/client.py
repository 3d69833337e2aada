"""The chat client of every live backend: the shared HTTP transport (`shared.http_client.HttpClient`) plus streamed
chat completions.

Streamed answers (`post_streamed`) are read and assembled in this event loop, or by a `Streamer` the run hands in
(`stream_workers`: child processes): a streamed answer costs ~2.5x the client CPU of a plain one, and at thousands of
streams in flight one loop is the limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from eagle_pipeline.generation.backends.stream import ChatStreamAssembler
from eagle_pipeline.shared.http_client import HttpClient


@dataclass(slots=True)
class Streamed:
    """One streamed exchange: the assembled chat completion, or the whole body of an answer that was not a stream."""

    status: int
    retry_after_s: float | None
    raw: bytes | None  # an error status or a plain JSON body, whole (then `text` and `body` are None)
    text: str | None = None  # the assembled chat completion as compact JSON: the stored `raw_response_json`
    body: dict[str, Any] | None = None  # `text` decoded
    chunks: int = 0  # data chunks received
    keepalives: int = 0  # keep-alive comments received


class Streamer(Protocol):
    """Carries streamed exchanges elsewhere (`stream_workers.StreamWorkers`: in child processes)."""

    async def post_streamed(self, url: str, body: bytes, keepalive_only_max_s: float | None) -> Streamed: ...


class ChatClient(HttpClient):
    """The transport, and streamed chat completions: with a `streamer`, streamed answers (`post_streamed`) are read
    and assembled by it instead of this event loop; everything else (retries, rows, the log, the budget) stays with
    the caller.
    """

    def __init__(
        self,
        *,
        concurrency: int,
        timeout_s: float,
        headers: dict[str, str] | None = None,
        max_request_s: float | None = None,
        streamer: Streamer | None = None,
    ) -> None:
        super().__init__(concurrency=concurrency, timeout_s=timeout_s, headers=headers, max_request_s=max_request_s)
        self._streamer = streamer

    async def post_streamed(self, url: str, body: bytes, keepalive_only_max_s: float | None) -> Streamed:
        """POST a `stream: true` request and return the assembled answer (`Streamed`), through the streamer when
        the client has one; a failed stream raises RequestFailure (stream.ChatStreamAssembler's classes)."""
        if self._streamer is not None:
            return await self._streamer.post_streamed(url, body, keepalive_only_max_s)
        return await assemble_streamed(self, url, body, keepalive_only_max_s)


async def assemble_streamed(client: HttpClient, url: str, body: bytes, keepalive_only_max_s: float | None) -> Streamed:
    """One streamed exchange through `client`, assembled in this event loop (what every worker process runs too)."""
    events = ChatStreamAssembler(keepalive_only_max_s=keepalive_only_max_s)
    status, raw, retry_after = await client.post(url, body, events)
    if raw is not None:  # an error status, or a server that answered with a plain JSON body
        return Streamed(status, retry_after, raw)
    obj = events.body()
    return Streamed(status, retry_after, None, events.body_json(obj), obj, events.chunks, events.keepalives)
