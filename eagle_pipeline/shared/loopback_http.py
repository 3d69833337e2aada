"""The harness of the project's loopback HTTP doubles: an aiohttp app on 127.0.0.1 in a background thread.

Every double uses it: the simulated servers the configuration can name (simulation/: the OpenRouter-format server
and the double of vLLM's `extract_hidden_states` server) and the tests' vLLM and SGLang chat doubles
(eagle_pipeline_tests/doubles/). It owns the transport and the lifecycle: a free port (or a given one), `start` returning once the socket listens (or raising what stopped it),
`stop` from any thread (also after the server stopped itself), and the per-key request counts every double keeps.
Each double adds its routes and its wire format.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections import Counter
from typing import Self

from aiohttp import web


class LoopbackHttpServer:
    """An aiohttp app on 127.0.0.1 in a background thread; a context manager. `url` is the base URL to configure.

    Subclasses implement `add_routes`, and count each request with `_count_locked` under `_lock`."""

    base_path = ""  # prefix of every route, part of `url`
    client_max_size = 64 * 1024 * 1024  # the largest request body accepted
    backlog = 128  # pending connections the listening socket queues

    def __init__(self, *, port: int = 0) -> None:
        self._port = port  # 0: a free one
        self.port: int | None = None
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._total = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def add_routes(self, app: web.Application) -> None:
        raise NotImplementedError

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
        """Stop serving and join the thread; a no-op when not started or when the server already stopped itself."""
        if self._thread is not None and self._loop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
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
            app = web.Application(client_max_size=self.client_max_size)
            self.add_routes(app)
            # handler_cancellation: a client that timed out stops the server's sleeping handler too.
            runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5)
            loop.run_until_complete(runner.setup())
            self._runner = runner
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", self._port))
            sock.listen(self.backlog)
            self.port = sock.getsockname()[1]
            loop.run_until_complete(web.SockSite(runner, sock, backlog=self.backlog).start())
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

    def open_connections(self) -> int:
        """Client connections the server still holds. Zero after a client was killed means every request it had sent
        is in the request log (or was dropped unread with its connection, never to be recorded)."""
        assert self._loop is not None, "server not started"

        async def count() -> int:
            server = self._runner.server if self._runner is not None else None
            return len(server.connections) if server is not None else 0

        return asyncio.run_coroutine_threadsafe(count(), self._loop).result(30)

    # request counts
    def _count_locked(self, key: str) -> tuple[int, int]:
        """Count one request under `key` (call with `_lock` held): (its attempt number, requests seen in all)."""
        self._counts[key] += 1
        self._total += 1
        return self._counts[key], self._total

    def request_counts(self) -> dict[str, int]:
        """Requests seen per request key (all attempts; each double says what its key is)."""
        with self._lock:
            return dict(self._counts)

    @property
    def total_requests(self) -> int:
        with self._lock:
            return self._total
