"""Faults of the simulated servers: which request gets which fault (`FaultPlan`), and the HTTP response of each
transport or status fault (OpenRouter's error format, which the vLLM and SGLang doubles reuse)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from eagle_pipeline.simulation.streaming import STREAM_FAULTS

TRANSIENT_FAULTS = (
    "http_429",
    "http_500",
    "http_502",
    "http_503",
    "timeout",
    "error_200",
    "no_choices",
    "cut_body",
    "bad_json",
)
STATUS_FAULTS = ("http_401", "http_402")
QUALITY_FAULTS = ("length", "empty_content", "empty_reasoning", "billing_mismatch", "bad_tool_args", "prompt_mismatch")
PROMPT_INJECTED_TOKENS = 37
ALL_FAULTS = TRANSIENT_FAULTS + STREAM_FAULTS + STATUS_FAULTS + QUALITY_FAULTS
_FAULT_OPTIONS = ("select", "after_requests", "fail_first_n_attempts", "retry_after_s", "timeout_sleep_s", "echo_auth")


def _unit(*parts: str) -> float:
    h = hashlib.sha256("|".join(parts).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


class FaultPlan:
    """Which fault (if any) a request gets, from its key, its attempt number and the server's request count."""

    def __init__(self, faults: dict[str, Any] | None) -> None:
        faults = dict(faults or {})
        unknown = set(faults) - set(ALL_FAULTS) - set(_FAULT_OPTIONS)
        if unknown:
            raise ValueError(
                f"unknown fault settings {sorted(unknown)}; known: {list(ALL_FAULTS) + list(_FAULT_OPTIONS)}"
            )
        self.rates = {k: float(faults[k]) for k in ALL_FAULTS if k in faults}
        self.select = {k: set(v) for k, v in (faults.get("select") or {}).items()}
        self.after = {k: int(v) for k, v in (faults.get("after_requests") or {}).items()}
        for k in list(self.select) + list(self.after):
            if k not in ALL_FAULTS:
                raise ValueError(f"unknown fault {k!r}")
        self.fail_first_n = int(faults.get("fail_first_n_attempts", 1))
        self.retry_after_s = faults.get("retry_after_s", 1)
        self.timeout_sleep_s = float(faults.get("timeout_sleep_s", 3600.0))
        self.echo_auth = bool(faults.get("echo_auth", False))

    def _hit(self, fault: str, key: str, n_seen: int) -> bool:
        if key in self.select.get(fault, ()):
            return True
        if fault in self.after and n_seen > self.after[fault]:
            return True
        rate = self.rates.get(fault, 0.0)
        return rate > 0 and _unit(fault, key) < rate

    def status_fault(self, key: str, attempt: int, n_seen: int) -> str | None:
        for f in STATUS_FAULTS:
            if self._hit(f, key, n_seen):
                return f
        if attempt <= self.fail_first_n:
            for f in TRANSIENT_FAULTS + STREAM_FAULTS:
                if self._hit(f, key, n_seen):
                    return f
        return None

    def quality_faults(self, key: str, n_seen: int) -> set[str]:
        return {f for f in QUALITY_FAULTS if self._hit(f, key, n_seen)}


async def fault_response(
    plan: FaultPlan, request: web.Request, fault: str, ok_body: Callable[[], bytes], message_extra: str = ""
) -> web.StreamResponse | None:
    """The response for a status/transient fault, or None for the 'timeout' fault after its sleep (answer normally).

    `ok_body` gives the success body, for the faults that damage one (no_choices, bad_json, cut_body).
    """
    p = plan
    if fault == "timeout":
        await asyncio.sleep(p.timeout_sleep_s)
        return None
    if fault == "http_429":
        return error_response(
            429,
            "Rate limit exceeded",
            {"error_type": "rate_limit_exceeded", "provider_code": "rate_limited"},
            headers={"Retry-After": _fmt_retry_after(p.retry_after_s)},
        )
    if fault in ("http_500", "http_502", "http_503"):
        code = int(fault[-3:])
        headers = {"Retry-After": _fmt_retry_after(p.retry_after_s)} if code == 503 else None
        return error_response(
            code,
            {500: "Internal Server Error", 502: "Provider returned error", 503: "No available providers"}[code],
            None,
            headers,
        )
    if fault == "http_401":
        return error_response(401, "No auth credentials found" + message_extra, {"error_type": "authentication"})
    if fault == "http_402":
        return error_response(
            402,
            "Insufficient credits. Add more using https://openrouter.ai/credits" + message_extra,
            {"error_type": "payment_required"},
        )
    if fault == "error_200":
        return web.json_response(
            {
                "error": {
                    "code": 502,
                    "message": "Provider returned error" + message_extra,
                    "metadata": {"provider_name": "Simulated", "error_type": "provider_unavailable"},
                }
            },
            status=200,
        )
    full = ok_body()
    if fault == "no_choices":
        obj = json.loads(full)
        obj.pop("choices", None)
        return web.Response(body=json.dumps(obj).encode(), status=200, content_type="application/json")
    if fault == "bad_json":
        return web.Response(body=full[: len(full) // 2], status=200, content_type="application/json")
    if fault == "cut_body":
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        resp.content_length = len(full)
        await resp.prepare(request)
        await resp.write(full[: len(full) // 2])
        if request.transport is not None:
            request.transport.close()
        return resp
    raise AssertionError(fault)


def _fmt_retry_after(v: Any) -> str:
    f = float(v)
    return str(int(f)) if f.is_integer() else f"{f:g}"


def error_response(
    status: int, message: str, metadata: dict[str, Any] | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    """An OpenRouter-style error body (`{"error": {"code", "message", "metadata"?}}`) with that HTTP status."""
    err: dict[str, Any] = {"code": status, "message": message}
    if metadata:
        err["metadata"] = metadata
    return web.json_response({"error": err}, status=status, headers=headers)
