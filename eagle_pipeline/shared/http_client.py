"""The HTTP transport of every client of the project (generation's backends, the vLLM hidden-state requests).

aiohttp, one ClientSession per run with a connector sized to the concurrency: at 2,000 requests in flight the
per-request CPU of the client is the limit, and aiohttp's pool does O(1) work per request where httpx's pool
does work proportional to its size (measurements in docs/generation.md).

Timeouts: `timeout_s` bounds connecting and each read (no byte from the server for that long fails the attempt),
not the whole request: a streamed answer that keeps sending data or keep-alive comments may run as long as it needs.
`max_request_s` is an optional overall cap. Transport failures become `failures.RequestFailure`; a connection that
could not be made at all (the name does not resolve, nothing listens) is `UNREACHABLE`, apart from a connection lost.
"""

from __future__ import annotations

import time
from typing import Protocol, Self

import aiohttp

from eagle_pipeline.shared import failures as F
from eagle_pipeline.shared.failures import RequestFailure


class StreamSink(Protocol):
    """Takes the bytes of a streamed (text/event-stream) response body as they arrive, cut anywhere."""

    def feed(self, data: bytes) -> None: ...


class HttpClient:
    """POSTs JSON bytes and returns (status, raw body, Retry-After seconds); transport failures become RequestFailure.
    Streamed chat completions: generation.backends.client.ChatClient."""

    def __init__(
        self,
        *,
        concurrency: int,
        timeout_s: float,
        headers: dict[str, str] | None = None,
        max_request_s: float | None = None,
    ) -> None:
        self._concurrency = concurrency
        self._timeout = aiohttp.ClientTimeout(
            total=max_request_s, connect=None, sock_connect=timeout_s, sock_read=timeout_s
        )
        self._timeout_s = timeout_s
        self._max_request_s = max_request_s
        self._headers = {"Content-Type": "application/json", "Accept": "application/json", **(headers or {})}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        connector = aiohttp.TCPConnector(
            limit=self._concurrency,  # one connection per in-flight request, reused (keep-alive)
            limit_per_host=0,
            ttl_dns_cache=300,
            keepalive_timeout=60,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            headers=self._headers,
            cookie_jar=aiohttp.DummyCookieJar(),  # no cookie bookkeeping per response
            auto_decompress=True,
            raise_for_status=False,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def post(
        self, url: str, body: bytes, events: StreamSink | None = None
    ) -> tuple[int, bytes | None, float | None]:
        """POST `body`. With `events`, a 2xx text/event-stream answer is fed to it as it arrives and
        None is returned as the body; any other answer (an error status, a plain JSON body) is returned whole."""
        assert self._session is not None, "HttpClient used outside `async with`"
        t0 = time.monotonic()
        try:
            async with self._session.post(url, data=body) as resp:
                retry_after = resp.headers.get("Retry-After")
                retry_s = F.parse_retry_after(retry_after) if retry_after else None
                if events is not None and 200 <= resp.status < 300 and resp.content_type == "text/event-stream":
                    read = resp.content.readany  # what iter_any() awaits, without its iterator per read
                    while data := await read():
                        events.feed(data)
                    return resp.status, None, retry_s
                raw = await resp.read()
                return resp.status, raw, retry_s
        except TimeoutError:
            elapsed = time.monotonic() - t0
            if self._max_request_s is not None and elapsed >= self._max_request_s * 0.99:
                message = f"request exceeded max_request_s = {self._max_request_s:g} s"
            else:
                message = f"no data from the server for {self._timeout_s:g} s (after {elapsed:.1f} s)"
            raise RequestFailure(F.TIMEOUT, message, True) from None
        except aiohttp.ClientPayloadError as exc:
            raise RequestFailure(
                F.CONNECTION, F.truncate(f"response body cut: {type(exc).__name__}: {exc}"), True
            ) from None
        except aiohttp.ClientConnectorDNSError as exc:
            raise RequestFailure(
                F.UNREACHABLE, F.truncate(f"cannot resolve {exc.host} ({exc.os_error})"), True
            ) from None
        except aiohttp.ClientConnectorError as exc:
            where = f"{exc.host}:{exc.port}"
            raise RequestFailure(
                F.UNREACHABLE, F.truncate(f"cannot connect to {where} ({exc.os_error})"), True
            ) from None
        except aiohttp.ClientResponseError as exc:
            raise RequestFailure(
                F.CONNECTION, F.truncate(f"{type(exc).__name__}: {exc.message}"), True, exc.status or None
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise RequestFailure(F.CONNECTION, F.truncate(f"{type(exc).__name__}: {exc}"), True) from None
