"""The one long-lived async HTTP client shared by every live backend.

aiohttp, one ClientSession per run with a connector sized to the concurrency: at 2,000 requests in flight the
per-request CPU of the client is the limit, and aiohttp's pool does O(1) work per request where httpx's pool
does work proportional to its size (measurements in docs/generation.md).
"""

from __future__ import annotations

import aiohttp

from eagle_pipeline.generation import failures as F
from eagle_pipeline.generation.failures import RequestFailure


class HttpClient:
    """POSTs JSON bytes and returns (status, raw body, Retry-After seconds); transport failures become RequestFailure."""

    def __init__(self, *, concurrency: int, timeout_s: float, headers: dict[str, str] | None = None) -> None:
        self._concurrency = concurrency
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._timeout_s = timeout_s
        self._headers = {"Content-Type": "application/json", "Accept": "application/json", **(headers or {})}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> HttpClient:
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

    async def post(self, url: str, body: bytes) -> tuple[int, bytes, float | None]:
        assert self._session is not None, "HttpClient used outside `async with`"
        try:
            async with self._session.post(url, data=body) as resp:
                raw = await resp.read()
                retry_after = resp.headers.get("Retry-After")
                return resp.status, raw, F.parse_retry_after(retry_after) if retry_after else None
        except TimeoutError:
            raise RequestFailure(F.TIMEOUT, f"no complete response within {self._timeout_s:g} s", True) from None
        except aiohttp.ClientPayloadError as exc:
            raise RequestFailure(
                F.CONNECTION, F.truncate(f"response body cut: {type(exc).__name__}: {exc}"), True
            ) from None
        except aiohttp.ClientResponseError as exc:
            raise RequestFailure(
                F.CONNECTION, F.truncate(f"{type(exc).__name__}: {exc.message}"), True, exc.status or None
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise RequestFailure(F.CONNECTION, F.truncate(f"{type(exc).__name__}: {exc}"), True) from None
