"""Backend and sampling specifications: the inputs of a generation run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

BACKEND_KINDS = ("openrouter", "vllm", "sglang", "simulated", "import")

# Kinds whose rows come from a live HTTP endpoint (import reads files instead).
HTTP_KINDS = ("openrouter", "vllm", "sglang", "simulated")


@dataclass(frozen=True)
class BackendSpec:
    """Where responses come from and how hard to push it.

    `api_key_env` names an environment variable; the key itself never appears in a spec, a row or a log.
    `endpoint` is a base URL (`https://openrouter.ai/api/v1`, `http://host:8000/v1`, `http://host:30000`);
    for kind 'simulated' it may be None: a SimulatedOpenRouterServer is started on loopback for the run,
    configured by `simulated` (constructor keyword arguments, e.g. latency_s, faults).
    """

    name: str
    kind: str
    endpoint: str | None = None
    model: str = ""
    concurrency: int | None = None  # None: 2000 for openrouter/simulated, 256 for self-hosted
    rpm: float | None = None
    provider: dict[str, Any] = field(default_factory=dict)
    api_key_env: str | None = None
    timeout_s: float = 600.0
    max_retries: int = 6
    backoff_base_s: float = 2.0
    backoff_max_s: float = 120.0
    circuit_breaker_failures: int = 50
    price_per_m_prompt: float | None = None
    price_per_m_completion: float | None = None
    import_paths: tuple[str, ...] = ()
    extra_body: dict[str, Any] = field(default_factory=dict)
    simulated: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in BACKEND_KINDS:
            raise ValueError(f"backend {self.name!r}: kind must be one of {BACKEND_KINDS}, got {self.kind!r}")
        if self.kind in ("openrouter", "vllm", "sglang") and not self.endpoint:
            raise ValueError(f"backend {self.name!r}: kind {self.kind!r} needs an endpoint")
        if self.kind == "import" and not self.import_paths:
            raise ValueError(f"backend {self.name!r}: kind 'import' needs import_paths")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"backend {self.name!r}: concurrency must be >= 1")
        if self.rpm is not None and self.rpm <= 0:
            raise ValueError(f"backend {self.name!r}: rpm must be > 0")
        if self.max_retries < 0 or self.circuit_breaker_failures < 1 or self.timeout_s <= 0:
            raise ValueError(f"backend {self.name!r}: max_retries >= 0, circuit_breaker_failures >= 1, timeout_s > 0")
        # Accept a list from YAML but keep the frozen spec hash-friendly where possible.
        object.__setattr__(self, "import_paths", tuple(str(p) for p in self.import_paths))

    @property
    def effective_concurrency(self) -> int:
        if self.concurrency is not None:
            return self.concurrency
        return 2000 if self.kind in ("openrouter", "simulated") else 256

    @property
    def source(self) -> str:
        """The `source` column value of rows this backend produces."""
        return self.kind

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["import_paths"] = list(self.import_paths)
        d["concurrency"] = self.effective_concurrency
        # Callables (token counters) may sit in `simulated`; keep the dict JSON-friendly.
        d["simulated"] = {k: (v if _jsonable(v) else repr(v)) for k, v in self.simulated.items()}
        return d


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling settings sent with every request; `to_dict()` is what goes into sample ids and `sampling_json`."""

    temperature: float = 1.0
    top_p: float = 0.95
    seed: int | None = None
    max_tokens: int = 16384
    thinking: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not 0.0 < self.top_p <= 1.0 or self.temperature < 0:
            raise ValueError("need 0 < top_p <= 1 and temperature >= 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _jsonable(v: Any) -> bool:
    if v is None or isinstance(v, (str, int, float, bool)):
        return True
    if isinstance(v, (list, tuple)):
        return all(_jsonable(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _jsonable(x) for k, x in v.items())
    return False
