"""The base of the simulated servers: an aiohttp app on 127.0.0.1 in a background thread, with a request log.

Subclasses give the routes and `handle` (one wire format each); transport, lifecycle and bookkeeping live here.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Self

from aiohttp import web

from eagle_pipeline.generation.simulated.faults import FaultPlan


@dataclass(frozen=True)
class RequestRecord:
    key: str
    attempt: int
    at: float  # server wall clock (time.time()) when the request arrived
    fault: str | None
    status: int


class LoopbackServer:
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
        self._arrivals: list[tuple[str, float]] = []
        self._answered: dict[tuple[str, int], float] = {}
        self._bodies: dict[str, dict[str, Any]] = {}
        self._headers: deque[dict[str, str]] = deque(maxlen=1000)  # the latest requests' headers, bounded
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.port: int | None = None

    # lifecycle
    def start(self) -> Self:
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

    def __enter__(self) -> Self:
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
            self._runner = runner
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
            self._arrivals.append((key, time.time()))
            self._counts[key] += 1
            self._bodies[key] = body
            self._headers.append(headers)
            return self._counts[key], sum(self._counts.values())

    def _record(self, key: str, attempt: int, at: float, fault: str | None, status: int) -> None:
        with self._lock:
            self._log.append(RequestRecord(key, attempt, at, fault, status))

    async def _send_answer(
        self, request: web.Request, resp: web.StreamResponse, key: str, attempt: int
    ) -> web.StreamResponse:
        """Send an answer whole (a no-op for a stream already ended) and note when its last byte went out."""
        await resp.prepare(request)
        await resp.write_eof()
        with self._lock:
            self._answered[(key, attempt)] = time.time()
        return resp

    def arrivals(self) -> list[tuple[str, float]]:
        """(request key, server wall clock) of every request as it arrived, in order, those a client abandoned
        included (the request log records a request only once its latency has passed)."""
        with self._lock:
            return list(self._arrivals)

    def answered_at(self) -> dict[tuple[str, int], float]:
        """(request key, attempt) -> server wall clock (time.time()) when the whole answer had been written to the
        socket: every successful answer, streamed or not; never a fault or a cut stream."""
        with self._lock:
            return dict(self._answered)

    def open_connections(self) -> int:
        """Client connections the server still holds. Zero after a client was killed means every request it had sent
        is in the request log (or was dropped unread with its connection, never to be recorded)."""
        assert self._loop is not None, "server not started"

        async def count() -> int:
            server = self._runner.server if self._runner is not None else None
            return len(server.connections) if server is not None else 0

        return asyncio.run_coroutine_threadsafe(count(), self._loop).result(30)

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
