"""Backend and sampling specifications: the inputs of a generation run.

These classes are also the `backends.<name>` and `datasets[i].sampling` sections of the pipeline configuration
(`eagle_pipeline.config` validates the YAML into them), so the Python API and the YAML file share one set of
defaults. docs/configuration.md lists them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any

from pydantic import Field, ValidationInfo, field_validator
from pydantic.dataclasses import dataclass

from eagle_pipeline.shared.spec_model import SPEC_CONFIG, Bool, Float, Int, Problem, SpecBase, Str, resolve_path

DEFAULT_MAX_TOKENS = 2048  # completion budget (reasoning included); the dataset-level `max_tokens` of the YAML
# How each request's seed is derived from the dataset's (`SamplingSpec.request_seed`); recorded in every row's
# `sampling_json` as `request_seed`, so rows sent under another scheme (one seed for every request) can be told apart.
REQUEST_SEED_SCHEME = "blake2b64(seed:sample_id) & 0x7fffffff"
STREAMS_PER_PROCESS = 500  # streams in flight per worker process when `stream_processes` is unset

PROVIDER_KEYS = (
    "order",
    "only",
    "ignore",
    "allow_fallbacks",
    "quantizations",
    "require_parameters",
    "data_collection",
    "sort",
)


class BackendKind(StrEnum):
    """Where a backend's responses come from; the value is also the `source` column of its rows."""

    OPENROUTER = "openrouter"
    VLLM = "vllm"
    SGLANG = "sglang"
    SIMULATED = "simulated"  # the project's loopback server speaking OpenRouter's wire format
    IMPORT = "import"  # response files of earlier runs

    @property
    def is_http(self) -> bool:
        """Rows come from a live HTTP endpoint (import reads files instead)."""
        return self is not BackendKind.IMPORT

    @property
    def speaks_openrouter(self) -> bool:
        """Requests use OpenRouter's body (reasoning, provider routing) and app headers."""
        return self in (BackendKind.OPENROUTER, BackendKind.SIMULATED)

    @property
    def needs_endpoint(self) -> bool:
        """A real server: the spec must name its endpoint (a simulated backend without one starts its own)."""
        return self in (BackendKind.OPENROUTER, BackendKind.VLLM, BackendKind.SGLANG)

    @property
    def default_concurrency(self) -> int:
        """Requests in flight when `concurrency` is unset: OpenRouter takes thousands; a self-hosted server less."""
        return 2000 if self is BackendKind.OPENROUTER else 256

    @property
    def can_stream(self) -> bool:
        """The wire format has a streamed (server-sent events) form the client reads."""
        return self in (BackendKind.OPENROUTER, BackendKind.SIMULATED, BackendKind.VLLM)

    @property
    def default_stream(self) -> bool:
        """`stream` when unset: on for OpenRouter (a silent connection is cut by gateways and upstreams after
        ~2-10 minutes, and a cut request is still billed), off for vLLM (a self-hosted server on a local network
        has no such gateway, and the non-streamed body is cheaper to parse)."""
        return self in (BackendKind.OPENROUTER, BackendKind.SIMULATED)


@dataclass(frozen=True, config=SPEC_CONFIG)
class BackendSpec(SpecBase):
    """Where responses come from and how hard to push it.

    `api_key_env` names an environment variable; the key itself never appears in a spec, a row or a log.
    `endpoint` is a base URL (`https://openrouter.ai/api/v1`, `http://host:8000/v1`, `http://host:30000`);
    for kind 'simulated' it may be None: a SimulatedOpenRouterServer is started on loopback for the run,
    configured by `simulated` (constructor keyword arguments, e.g. latency_s, faults).
    """

    label = "backend"

    name: Str
    kind: BackendKind
    endpoint: Str | None = None
    model: Str = ""
    concurrency: Annotated[Int, Field(ge=1)] | None = None  # None: kind.default_concurrency
    rpm: Annotated[Float, Field(gt=0)] | None = None
    provider: dict[str, Any] = dataclasses.field(default_factory=dict)
    api_key_env: Str | None = None
    stream: Bool | None = None  # None: kind.default_stream
    # Child processes that read and assemble streamed answers; None: one per STREAMS_PER_PROCESS in flight.
    stream_processes: Annotated[Int, Field(ge=0)] | None = None
    timeout_s: Annotated[Float, Field(gt=0)] = 600.0  # connect, and each read: not the whole request
    max_request_s: Annotated[Float, Field(gt=0)] | None = None  # optional overall cap per attempt
    max_keepalive_only_s: Annotated[Float, Field(gt=0)] | None = (
        1800.0  # a stream with only keep-alives this long fails
    )
    max_retries: Annotated[Int, Field(ge=0)] = 8
    backoff_base_s: Annotated[Float, Field(ge=0)] = 2.0
    backoff_max_s: Annotated[Float, Field(ge=0)] = 120.0
    circuit_breaker_failures: Annotated[Int, Field(ge=1)] = 50
    price_per_m_prompt: Annotated[Float, Field(ge=0)] | None = None
    price_per_m_completion: Annotated[Float, Field(ge=0)] | None = None
    import_paths: tuple[Str, ...] = ()
    extra_body: dict[str, Any] = dataclasses.field(default_factory=dict)
    simulated: dict[str, Any] = dataclasses.field(default_factory=dict)

    @field_validator("import_paths", mode="before")
    @classmethod
    def _paths(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, (list, tuple)) and all(isinstance(p, str) or hasattr(p, "__fspath__") for p in value):
            return tuple(str(resolve_path(p, info)) for p in value)
        return value

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        if value and (value.startswith("sk-") or not value.replace("_", "").isalnum()):
            raise ValueError("must be the name of an environment variable, never the key itself")
        return value

    @classmethod
    def rule_problems(cls, data: Mapping[str, Any]) -> list[Problem]:
        problems: list[Problem] = []
        kind = data.get("kind")
        if kind in set(BackendKind):  # else the field reports it
            kind = BackendKind(kind)
            if kind.needs_endpoint and not data.get("endpoint"):
                problems.append((("endpoint",), f"required for kind '{kind}'"))
            if kind is BackendKind.IMPORT and not data.get("import_paths"):
                problems.append((("import_paths",), "required for kind 'import'"))
            if data.get("stream") is True and not kind.can_stream:
                problems.append((("stream",), f"kind '{kind}' has no streamed form; only openrouter, simulated, vllm"))
            streams = data.get("stream") if data.get("stream") is not None else kind.default_stream
            if data.get("stream_processes") and not streams:
                problems.append((("stream_processes",), "carries streamed answers only; set `stream: true`"))
        provider = data.get("provider")
        if isinstance(provider, Mapping):
            for key in provider:
                if key not in PROVIDER_KEYS:
                    problems.append(
                        (("provider", key), f"unknown provider-routing key; expected one of {list(PROVIDER_KEYS)}")
                    )
        return problems

    @property
    def effective_concurrency(self) -> int:
        return self.concurrency if self.concurrency is not None else self.kind.default_concurrency

    @property
    def effective_stream(self) -> bool:
        return self.stream if self.stream is not None else self.kind.default_stream

    def stream_processes_for(self, in_flight: int) -> int:
        """Worker processes that read and assemble streamed answers at `in_flight` requests (0: the run's own event
        loop; always 0 without streaming; never more than the requests in flight).

        Unset: one per `STREAMS_PER_PROCESS` in flight, at most one per usable CPU (the run's own process then needs
        ~0.2 ms of CPU per streamed answer). A streamed answer costs ~1 ms of client CPU in one event loop, which
        therefore keeps up with ~1,000 answers/s at most, and real streams arrive a token or a few per chunk
        (docs/generation.md, Worker processes for streams).
        """
        if not self.effective_stream:
            return 0
        n = self.stream_processes
        if n is None:
            n = min(_usable_cpus(), in_flight // STREAMS_PER_PROCESS)
        return max(0, min(n, in_flight))

    @property
    def source(self) -> str:
        """The `source` column value of rows this backend produces."""
        return self.kind.value

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["kind"] = self.kind.value
        d["import_paths"] = list(self.import_paths)
        d["concurrency"] = self.effective_concurrency
        d["stream"] = self.effective_stream
        # Callables (token counters) may sit in `simulated`; keep the dict JSON-friendly.
        d["simulated"] = {k: (v if _jsonable(v) else repr(v)) for k, v in self.simulated.items()}
        return d


@dataclass(frozen=True, config=SPEC_CONFIG)
class SamplingOptions(SpecBase):
    """The sampling settings of a dataset's `sampling:` mapping (its completion budget is the dataset's `max_tokens`)."""

    label = "sampling"

    temperature: Annotated[Float, Field(ge=0)] = 0.6
    top_p: Annotated[Float, Field(gt=0, le=1)] = 0.95
    seed: Int | None = 0  # None: no seed is sent
    thinking: Bool = True


@dataclass(frozen=True, config=SPEC_CONFIG)
class SamplingSpec(SamplingOptions):
    """Sampling settings sent with every request; `to_dict()` is what goes into sample ids and `sampling_json`."""

    max_tokens: Annotated[Int, Field(ge=1)] = DEFAULT_MAX_TOKENS

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def request_seed(self, sample_id: str) -> int | None:
        """The seed sent with the request of `sample_id` (None: no seed is sent).

        One seed for every request of a dataset draws the same sampling noise for every prompt (a small model then
        gives every prompt the same answer); this one differs per sample and is the same on every run and retry:
        the first 8 bytes of blake2b(f"{seed}:{sample_id}") as a little-endian integer, cut to 31 bits so that every
        server takes it. A turn of a regenerated conversation has its own sample id (`{conversation}-t{turn}`), so
        its own seed. Sample ids, which hash `to_dict()`, do not change.
        """
        if self.seed is None:
            return None
        digest = hashlib.blake2b(f"{self.seed}:{sample_id}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") & 0x7FFFFFFF

    def provenance_dict(self) -> dict[str, Any]:
        """What a generated row records as its `sampling_json`: `to_dict()` and, when seeded, how each request's
        seed was derived from `seed` (REQUEST_SEED_SCHEME)."""
        d = self.to_dict()
        if self.seed is not None:
            d["request_seed"] = REQUEST_SEED_SCHEME
        return d


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may run on (a container's or taskset's share)
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _jsonable(v: Any) -> bool:
    if v is None or isinstance(v, (str, int, float, bool)):
        return True
    if isinstance(v, (list, tuple)):
        return all(_jsonable(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _jsonable(x) for k, x in v.items())
    return False
