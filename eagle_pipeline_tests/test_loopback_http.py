"""The loopback harness every HTTP double stands on: a free port, readiness, counting, shutdown, a failed start."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from aiohttp import web

from eagle_pipeline.shared.loopback_http import LoopbackHttpServer


class _Echo(LoopbackHttpServer):
    base_path = "/api"

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(self.base_path + "/echo/{key}", self._echo)

    async def _echo(self, request: web.Request) -> web.Response:
        with self._lock:
            attempt, total = self._count_locked(request.match_info["key"])
        return web.json_response({"attempt": attempt, "total": total})


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read()


def test_serves_on_a_free_port_counts_requests_and_stops():
    with _Echo() as a, _Echo() as b:
        assert a.port != b.port and a.url == f"http://127.0.0.1:{a.port}/api"
        assert _get(a.url + "/echo/x") == b'{"attempt": 1, "total": 1}'
        assert _get(a.url + "/echo/y") == b'{"attempt": 1, "total": 2}'
        assert _get(a.url + "/echo/x") == b'{"attempt": 2, "total": 3}'
        assert a.request_counts() == {"x": 2, "y": 1} and a.total_requests == 3 and b.total_requests == 0
        url = a.url
    with pytest.raises(urllib.error.URLError):
        _get(url + "/echo/x")  # stopped: nothing listens there any more
    a.stop()  # a second stop is a no-op


def test_a_failed_start_is_raised_and_stop_after_it_is_a_no_op():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        server = _Echo(port=taken.getsockname()[1])
        with pytest.raises(RuntimeError, match=r"_Echo failed to start: .*(in use|Address)"):
            server.start()
        server.stop()
