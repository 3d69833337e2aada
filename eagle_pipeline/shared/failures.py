"""Failure classification of HTTP requests (generation's backends, the vLLM hidden-state client): which failures are
retried, which stop the run, and how they are named in the errors table."""

from __future__ import annotations

import email.utils
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# error_class values (the errors table's `error_class` column).
RATE_LIMIT = "rate_limit"  # 429, in-body rate_limit_exceeded, retryable 402 in-flight budget
SERVER_ERROR = "server_error"  # 5xx
TIMEOUT = "timeout"  # client-side timeout or HTTP 408
TRANSIENT_HTTP = "transient_http"  # 409, 425
CONNECTION = "connection"  # reset, body cut mid-transfer
UNREACHABLE = "unreachable"  # no connection made: the host name does not resolve, nothing listens, TLS refused
MALFORMED_BODY = "malformed_body"  # not JSON / not the expected shape
NO_CHOICES = "no_choices"  # 200 without choices and without an error
PROVIDER_ERROR = "provider_error"  # 200 with an `error` body, finish_reason 'error', SGLang abort
EMPTY_COMPLETION = "empty_completion"  # no finish reason and nothing generated ("No content generated")
AUTH = "auth"  # 401, 403 (not moderation)
CREDITS = "credits"  # 402
MODERATION = "moderation"  # 403 with moderation metadata: this prompt, not the key
BAD_REQUEST = "bad_request"  # other 4xx: the request is wrong, retrying will not help
UNKNOWN_MODEL = "unknown_model"  # 404: the server serves no model of that name (every request would fail)
MISSING_TOKEN_IDS = "missing_token_ids"  # vLLM server ignored return_token_ids
CANCELLED = "cancelled"  # the run stopped while this request waited to retry
IMPORT_UNMATCHED = "import_unmatched"  # an imported response matches no prompt
IMPORT_INVALID = "import_invalid"  # an imported line is not a usable response

STOP_AUTH = "auth"
STOP_CREDITS = "credits"
STOP_BUDGET = "budget"
STOP_CIRCUIT = "circuit_breaker"
STOP_UNKNOWN_MODEL = "unknown_model"
STOP_UNREACHABLE = "unreachable"

# vLLM's answer to a model name it does not serve (OpenAIServing._check_model): HTTP 404, error param "model".
_UNKNOWN_MODEL_MESSAGE = re.compile(r"model .* does not exist", re.IGNORECASE)
_UNKNOWN_MODEL_HINT = (
    "the server serves no model of the name this backend's `model` sends. Start vLLM with "
    "`--served-model-name <that name>` (without it, a model served from a local directory is named by its path), "
    "or set the backend's `model` to a name GET /v1/models lists"
)

_RETRYABLE_STATUS = {408, 409, 425, 429}


@dataclass
class RequestFailure(Exception):
    """One failed attempt, classified."""

    error_class: str
    message: str
    retryable: bool
    http_status: int | None = None
    retry_after_s: float | None = None
    stop_reason: str | None = None  # set for failures that must stop the whole run (auth, credits)

    def __str__(self) -> str:
        status = f" HTTP {self.http_status}" if self.http_status is not None else ""
        return f"{self.error_class}{status}: {self.message}"


def classify_status(
    status: int, message: str, *, retry_after_s: float | None = None, error_obj: Any = None
) -> RequestFailure:
    """Classify a non-2xx HTTP status, or an in-body error code, into a RequestFailure."""
    meta = error_obj.get("metadata") if isinstance(error_obj, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    if status == 429:
        return RequestFailure(RATE_LIMIT, message, True, status, retry_after_s)
    if status == 408:
        return RequestFailure(TIMEOUT, message, True, status, retry_after_s)
    if status in _RETRYABLE_STATUS:
        return RequestFailure(TRANSIENT_HTTP, message, True, status, retry_after_s)
    if status >= 500:
        return RequestFailure(SERVER_ERROR, message, True, status, retry_after_s)
    if status == 401:
        return RequestFailure(AUTH, message, False, status, stop_reason=STOP_AUTH)
    if status == 403:
        # OpenRouter uses 403 for guardrail/moderation flags on one prompt; that must not stop the run.
        if meta.get("reasons") or meta.get("flagged_input") or meta.get("error_type") == "content_policy_violation":
            return RequestFailure(MODERATION, message, False, status)
        return RequestFailure(AUTH, message, False, status, stop_reason=STOP_AUTH)
    if status == 404 and (
        (isinstance(error_obj, dict) and error_obj.get("param") == "model") or _UNKNOWN_MODEL_MESSAGE.search(message)
    ):
        return RequestFailure(
            UNKNOWN_MODEL, f"{message} ({_UNKNOWN_MODEL_HINT})", False, status, stop_reason=STOP_UNKNOWN_MODEL
        )
    if status == 402:
        # The in-flight spend budget is the one retryable 402 (wire_formats §1.6).
        if meta.get("limit_source") == "openrouter_in_flight_budget":
            return RequestFailure(RATE_LIMIT, message, True, status, retry_after_s)
        return RequestFailure(CREDITS, message, False, status, stop_reason=STOP_CREDITS)
    return RequestFailure(BAD_REQUEST, message, False, status)


def classify_body_error(error_obj: Any, http_status: int) -> RequestFailure:
    """An `error` object inside a response body (OpenRouter sends these with HTTP 200)."""
    if not isinstance(error_obj, dict):
        return RequestFailure(PROVIDER_ERROR, truncate(str(error_obj)), True, http_status)
    message = truncate(str(error_obj.get("message") or error_obj.get("detail") or "error"))
    code = error_obj.get("code")
    retry_after = None
    avail = error_obj.get("availability")
    if isinstance(avail, dict):
        retry_after = _as_float(avail.get("retry_after"))
        if avail.get("retryable") is False:
            return RequestFailure(BAD_REQUEST, message, False, http_status)
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    if isinstance(code, int) and 400 <= code < 600:
        f = classify_status(code, message, retry_after_s=retry_after, error_obj=error_obj)
        if f.error_class in (SERVER_ERROR, TRANSIENT_HTTP):
            f.error_class = PROVIDER_ERROR  # an upstream failure reported inside a 200
        f.http_status = http_status
        return f
    return RequestFailure(PROVIDER_ERROR, message, True, http_status, retry_after)


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header: delta-seconds (fractions tolerated) or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        dt = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if dt is None:
        return None
    return max(0.0, dt.timestamp() - (time.time() if now is None else now))


def _as_float(v: Any) -> float | None:
    try:
        return float(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def truncate(s: str, n: int = 500) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


_BEARER = re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]+")


class Redactor:
    """Removes secret values (and any bearer token) from text before it is logged or stored."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        # Very short values would redact innocent text; real keys are long.
        self.secrets = tuple(s for s in secrets if s and len(s) >= 6)

    def __call__(self, text: str | None) -> str | None:
        if not text:
            return text
        for s in self.secrets:
            if s in text:
                text = text.replace(s, "***")
        if "earer" in text:
            text = _BEARER.sub(r"\1***", text)
        return text
