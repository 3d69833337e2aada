"""The base of the simulated chat servers: the loopback harness (eagle_pipeline/shared/loopback_http.py) with a request log.

Subclasses give the routes and `handle` (one wire format each); the harness owns transport and lifecycle, this
class the bookkeeping the tests read.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from eagle_pipeline.shared.loopback_http import LoopbackHttpServer
from eagle_pipeline.simulation.faults import FaultPlan


@dataclass(frozen=True)
class RequestRecord:
    key: str
    attempt: int
    at: float  # server wall clock (time.time()) when the request arrived
    fault: str | None
    status: int


def _connection(request: web.Request) -> tuple[int, Any]:
    """One client connection, for as long as it is open (its handler object and the client's address and port)."""
    return id(request.protocol), request.transport.get_extra_info("peername") if request.transport else None


class LoopbackServer(LoopbackHttpServer):
    """A chat double: its POST `routes` (under `base_path`) go to `handle`, with a request log for tests."""

    routes: tuple[str, ...] = ()
    backlog = 4096

    def __init__(self, *, latency_s: float = 0.0, faults: dict[str, Any] | None = None, port: int = 0) -> None:
        super().__init__(port=port)
        self.latency_s = float(latency_s)
        self.plan = FaultPlan(faults)
        self._log: list[RequestRecord] = []
        self._arrivals: list[tuple[str, float]] = []
        self._answered: dict[tuple[str, int], float] = {}
        self._last_answer: dict[tuple[int, Any], tuple[str, int]] = {}  # connection -> its latest answer, unproven
        self._read_by: dict[tuple[str, int], float] = {}
        self._bodies: dict[str, dict[str, Any]] = {}
        self._headers: deque[dict[str, str]] = deque(maxlen=1000)  # the latest requests' headers, bounded

    def add_routes(self, app: web.Application) -> None:
        for r in self.routes:
            app.router.add_post(self.base_path + r, self._entry)

    # request bookkeeping
    def _note(self, key: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, int]:
        with self._lock:
            self._arrivals.append((key, time.time()))
            self._bodies[key] = body
            self._headers.append(headers)
            return self._count_locked(key)

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
            self._last_answer[_connection(request)] = (key, attempt)
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

    def read_by(self) -> dict[tuple[str, int], float]:
        """(request key, attempt) -> server wall clock when the client had certainly read that whole answer: the
        arrival of the next request on the connection that carried it (an HTTP/1.1 client sends one only after reading
        the previous response). In the order of those arrivals; an answer whose connection carried no other request is
        not here."""
        with self._lock:
            return dict(self._read_by)

    def request_log(self) -> list[RequestRecord]:
        with self._lock:
            return list(self._log)

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
        with self._lock:
            previous = self._last_answer.pop(_connection(request), None)
            if previous is not None:
                self._read_by[previous] = at
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
