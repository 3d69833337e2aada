"""The pipeline configuration: one YAML file naming datasets, backends, target tokenizer and model, data root.

`load_config()` reads `$EAGLE_PIPELINE_CONFIG` or the repository's `pipeline.yaml`, validates everything at once and
raises one `ConfigError` that lists every problem with its path in the file (e.g. `datasets[2].backend`).
Relative paths resolve against the directory of the config file. API keys are never in the file: a backend names
the environment variable that holds its key.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from eagle_pipeline.generation.spec import BACKEND_KINDS, BackendSpec, SamplingSpec

CONFIG_ENV = "EAGLE_PIPELINE_CONFIG"
DATA_ROOT_ENV = "EAGLE_DATA_ROOT"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "pipeline.yaml"

GATE_ACTIONS = ("block", "filter", "warn")
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


class ConfigError(ValueError):
    """The configuration file is invalid; `problems` lists each one with its path in the file."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s) in the pipeline configuration:\n{lines}")


@dataclass(frozen=True)
class DatasetConfig:
    name: str
    prompts: Path
    domain: str
    tools: bool
    backend: str
    limit: int | None
    sampling: SamplingSpec
    budget_usd: float | None = None


@dataclass(frozen=True)
class TargetConfig:
    tokenizer: str
    profile: str = "kimi-k2.5"
    model_config: str | None = None  # config.json of the target, for the extraction plan


@dataclass(frozen=True)
class GenerationSettings:
    budget_usd: float | None = None
    commit_every_rows: int = 500
    commit_every_s: float = 10.0
    progress_every_s: float = 5.0


@dataclass(frozen=True)
class AuditConfig:
    actions: dict[str, str] = field(default_factory=dict)
    billing_aggregate_bound: float = 0.005
    billing_row_abs_tolerance: int | None = None
    billing_row_rel_tolerance: float | None = None
    prompt_row_abs_tolerance: int | None = None
    max_examples: int = 5


@dataclass(frozen=True)
class MergeConfig:
    seed: int = 0
    weights: dict[str, float] = field(default_factory=dict)
    caps: dict[str, int] = field(default_factory=dict)
    dedup: bool = True
    eval_fraction: float = 0.0
    rows_per_shard: int = 10_000
    draft_vocab_size: int = 32_000


@dataclass(frozen=True)
class HiddenStatesConfig:
    model: str = "tiny-random"  # or a local transformers model directory
    family: str = "deepseek_v3"
    seed: int = 0
    shard_size: int = 256
    aux_layers: tuple[int, ...] | None = None
    max_tokens_per_batch: int = 8192
    device: str = "auto"
    disk_budget_gb: float | None = None
    max_shards: int = 64


@dataclass(frozen=True)
class PipelineConfig:
    source: Path
    data_root: Path
    target: TargetConfig
    backends: dict[str, BackendSpec]
    datasets: dict[str, DatasetConfig]
    generation: GenerationSettings
    audit: AuditConfig
    merge: MergeConfig
    hidden_states: HiddenStatesConfig

    @property
    def dataset_names(self) -> list[str]:
        return list(self.datasets)

    def config_hash(self) -> str:
        """A short hash of the whole configuration (paths included), recorded in manifests."""
        return hashlib.sha256(json.dumps(_jsonable(self), sort_keys=True).encode()).hexdigest()[:16]


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return {k: _jsonable(getattr(obj, k)) for k in obj.__dataclass_fields__}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def config_path() -> Path:
    """The configuration file in force: `$EAGLE_PIPELINE_CONFIG`, else the repository's pipeline.yaml."""
    return Path(os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG)


def load_config(path: str | os.PathLike | None = None) -> PipelineConfig:
    """Load and validate the pipeline configuration; raise ConfigError listing every problem."""
    p = Path(path) if path is not None else config_path()
    if not p.exists():
        raise ConfigError(str(p), ["file not found"])
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(str(p), [f"{where}invalid YAML: {getattr(exc, 'problem', exc)}"]) from exc
    return parse_config(raw, source=p)


def parse_config(raw: Any, *, source: Path) -> PipelineConfig:
    """Validate a parsed YAML document into a PipelineConfig."""
    v = _Validator()
    base = source.resolve().parent
    if not isinstance(raw, dict):
        raise ConfigError(str(source), ["top level: expected a mapping"])
    v.unknown(raw, "", {"data_root", "target", "backends", "datasets", "generation", "audit", "merge", "hidden_states"})

    data_root_raw = os.environ.get(DATA_ROOT_ENV) or v.get(
        raw, "data_root", str, "", required=True, default=".eagle-data"
    )
    data_root = _resolve(base, data_root_raw)

    t = v.section(raw, "target")
    target = TargetConfig(
        tokenizer=v.get(t, "tokenizer", str, "target", required=True, default="demo"),
        profile=v.get(t, "profile", str, "target", default="kimi-k2.5"),
        model_config=v.get(t, "model_config", str, "target", default=None),
    )
    v.unknown(t, "target", {"tokenizer", "profile", "model_config"})

    backends: dict[str, BackendSpec] = {}
    braw = v.section(raw, "backends", required=True)
    for name, b in braw.items():
        path = f"backends.{name}"
        if not isinstance(b, dict):
            v.problem(path, "expected a mapping")
            continue
        allowed = set(BackendSpec.__dataclass_fields__) - {"name"}
        v.unknown(b, path, allowed)
        kind = v.get(b, "kind", str, path, required=True, default="simulated")
        if kind not in BACKEND_KINDS:
            v.problem(f"{path}.kind", f"must be one of {list(BACKEND_KINDS)}, got {kind!r}")
        endpoint = v.get(b, "endpoint", str, path, default=None)
        if kind in ("openrouter", "vllm", "sglang") and not endpoint:
            v.problem(f"{path}.endpoint", f"required for kind {kind!r}")
        api_key_env = v.get(b, "api_key_env", str, path, default=None)
        if kind == "openrouter" and not api_key_env:
            v.problem(f"{path}.api_key_env", "required for kind 'openrouter' (the NAME of the env var holding the key)")
        if api_key_env and (api_key_env.startswith("sk-") or not api_key_env.replace("_", "").isalnum()):
            v.problem(f"{path}.api_key_env", "must be the name of an environment variable, never the key itself")
        provider = v.get(b, "provider", dict, path, default={}) or {}
        for k in provider:
            if k not in PROVIDER_KEYS:
                v.problem(
                    f"{path}.provider.{k}", f"unknown provider-routing key; expected one of {list(PROVIDER_KEYS)}"
                )
        import_paths = v.get(b, "import_paths", list, path, default=[]) or []
        if kind == "import" and not import_paths:
            v.problem(f"{path}.import_paths", "required for kind 'import'")
        concurrency = v.get(b, "concurrency", int, path, default=2000 if kind == "openrouter" else 256)
        if concurrency is not None and concurrency < 1:
            v.problem(f"{path}.concurrency", "must be >= 1")
        fields = dict(
            name=name,
            kind=kind,
            model=v.get(b, "model", str, path, required=kind != "import", default=""),
            endpoint=endpoint,
            concurrency=concurrency,
            rpm=v.get(b, "rpm", (int, float), path, default=None),
            provider=provider,
            api_key_env=api_key_env,
            timeout_s=float(v.get(b, "timeout_s", (int, float), path, default=600.0)),
            max_retries=v.get(b, "max_retries", int, path, default=8),
            backoff_base_s=float(v.get(b, "backoff_base_s", (int, float), path, default=2.0)),
            backoff_max_s=float(v.get(b, "backoff_max_s", (int, float), path, default=120.0)),
            circuit_breaker_failures=v.get(b, "circuit_breaker_failures", int, path, default=50),
            price_per_m_prompt=v.get(b, "price_per_m_prompt", (int, float), path, default=None),
            price_per_m_completion=v.get(b, "price_per_m_completion", (int, float), path, default=None),
            import_paths=tuple(str(_resolve(base, x)) for x in import_paths),
            extra_body=v.get(b, "extra_body", dict, path, default={}) or {},
            simulated=v.get(b, "simulated", dict, path, default={}) or {},
        )
        if kind in BACKEND_KINDS:
            try:
                backends[name] = BackendSpec(**fields)
            except ValueError as exc:  # already reported above in most cases; keep any the spec adds
                if not any(p.startswith(path) for p in v.problems):
                    v.problem(path, str(exc))

    datasets: dict[str, DatasetConfig] = {}
    draw = v.get(raw, "datasets", list, "", required=True, default=[]) or []
    if not draw:
        v.problem("datasets", "at least one dataset is required")
    for i, d in enumerate(draw):
        path = f"datasets[{i}]"
        if not isinstance(d, dict):
            v.problem(path, "expected a mapping")
            continue
        v.unknown(
            d, path, {"name", "prompts", "domain", "tools", "backend", "limit", "max_tokens", "sampling", "budget_usd"}
        )
        name = v.get(d, "name", str, path, required=True, default=f"dataset{i}")
        if name in datasets:
            v.problem(f"{path}.name", f"duplicate dataset name {name!r}")
        if not name.replace("_", "").replace("-", "").isalnum():
            v.problem(
                f"{path}.name", "use letters, digits, '-' and '_' only (it becomes a partition key and a file name)"
            )
        prompts = _resolve(base, v.get(d, "prompts", str, path, required=True, default=""))
        if not prompts.is_file():
            v.problem(f"{path}.prompts", f"file not found: {prompts}")
        backend = v.get(d, "backend", str, path, required=True, default="")
        if backend and backend not in braw:
            v.problem(f"{path}.backend", f"unknown backend {backend!r}; defined: {sorted(braw)}")
        limit = v.get(d, "limit", int, path, default=None)
        if limit is not None and limit < 1:
            v.problem(f"{path}.limit", "must be >= 1 (or omitted for all prompts)")
        s = v.get(d, "sampling", dict, path, default={}) or {}
        v.unknown(s, f"{path}.sampling", set(SamplingSpec.__dataclass_fields__) - {"max_tokens"})
        max_tokens = v.get(d, "max_tokens", int, path, default=2048)
        if max_tokens is not None and max_tokens < 1:
            v.problem(f"{path}.max_tokens", "must be >= 1")
        sampling = SamplingSpec(
            temperature=float(v.get(s, "temperature", (int, float), f"{path}.sampling", default=0.6)),
            top_p=float(v.get(s, "top_p", (int, float), f"{path}.sampling", default=0.95)),
            seed=v.get(s, "seed", int, f"{path}.sampling", default=0),
            max_tokens=max_tokens or 1,
            thinking=bool(v.get(s, "thinking", bool, f"{path}.sampling", default=True)),
        )
        datasets[name] = DatasetConfig(
            name=name,
            prompts=prompts,
            domain=v.get(d, "domain", str, path, required=True, default=""),
            tools=bool(v.get(d, "tools", bool, path, default=False)),
            backend=backend,
            limit=limit,
            sampling=sampling,
            budget_usd=v.get(d, "budget_usd", (int, float), path, default=None),
        )

    g = v.section(raw, "generation")
    v.unknown(g, "generation", set(GenerationSettings.__dataclass_fields__))
    generation = GenerationSettings(
        budget_usd=v.get(g, "budget_usd", (int, float), "generation", default=None),
        commit_every_rows=v.get(g, "commit_every_rows", int, "generation", default=500),
        commit_every_s=float(v.get(g, "commit_every_s", (int, float), "generation", default=10.0)),
        progress_every_s=float(v.get(g, "progress_every_s", (int, float), "generation", default=5.0)),
    )

    a = v.section(raw, "audit")
    v.unknown(a, "audit", set(AuditConfig.__dataclass_fields__))
    actions = v.get(a, "actions", dict, "audit", default={}) or {}
    for gate, action in actions.items():
        if action not in GATE_ACTIONS:
            v.problem(f"audit.actions.{gate}", f"must be one of {list(GATE_ACTIONS)}, got {action!r}")
    bound = float(v.get(a, "billing_aggregate_bound", (int, float), "audit", default=0.005))
    if not 0 <= bound < 1:
        v.problem("audit.billing_aggregate_bound", "must be a fraction in [0, 1)")
    audit = AuditConfig(
        actions=actions,
        billing_aggregate_bound=bound,
        billing_row_abs_tolerance=v.get(a, "billing_row_abs_tolerance", int, "audit", default=None),
        billing_row_rel_tolerance=v.get(a, "billing_row_rel_tolerance", (int, float), "audit", default=None),
        prompt_row_abs_tolerance=v.get(a, "prompt_row_abs_tolerance", int, "audit", default=None),
        max_examples=v.get(a, "max_examples", int, "audit", default=5),
    )
    for problem in _audit_problems(audit):
        v.problem("audit", problem)

    m = v.section(raw, "merge")
    v.unknown(m, "merge", set(MergeConfig.__dataclass_fields__))
    eval_fraction = float(v.get(m, "eval_fraction", (int, float), "merge", default=0.0))
    if not 0 <= eval_fraction < 1:
        v.problem("merge.eval_fraction", "must be in [0, 1)")
    weights = v.get(m, "weights", dict, "merge", default={}) or {}
    caps = v.get(m, "caps", dict, "merge", default={}) or {}
    for key, mapping in (("weights", weights), ("caps", caps)):
        for ds in mapping:
            if ds not in datasets:
                v.problem(f"merge.{key}.{ds}", f"unknown dataset; defined: {list(datasets)}")
    merge = MergeConfig(
        seed=v.get(m, "seed", int, "merge", default=0),
        weights={k: float(x) for k, x in weights.items()},
        caps={k: int(x) for k, x in caps.items()},
        dedup=bool(v.get(m, "dedup", bool, "merge", default=True)),
        eval_fraction=eval_fraction,
        rows_per_shard=v.get(m, "rows_per_shard", int, "merge", default=10_000),
        draft_vocab_size=v.get(m, "draft_vocab_size", int, "merge", default=32_000),
    )

    h = v.section(raw, "hidden_states")
    v.unknown(h, "hidden_states", set(HiddenStatesConfig.__dataclass_fields__))
    aux = v.get(h, "aux_layers", list, "hidden_states", default=None)
    family = v.get(h, "family", str, "hidden_states", default="deepseek_v3")
    if family not in ("deepseek_v3", "llama"):
        v.problem("hidden_states.family", f"must be 'deepseek_v3' or 'llama', got {family!r}")
    model = v.get(h, "model", str, "hidden_states", default="tiny-random")
    hidden = HiddenStatesConfig(
        model=model if model == "tiny-random" else str(_resolve(base, model)),
        family=family,
        seed=v.get(h, "seed", int, "hidden_states", default=0),
        shard_size=v.get(h, "shard_size", int, "hidden_states", default=256),
        aux_layers=tuple(int(x) for x in aux) if aux else None,
        max_tokens_per_batch=v.get(h, "max_tokens_per_batch", int, "hidden_states", default=8192),
        device=v.get(h, "device", str, "hidden_states", default="auto"),
        disk_budget_gb=v.get(h, "disk_budget_gb", (int, float), "hidden_states", default=None),
        max_shards=v.get(h, "max_shards", int, "hidden_states", default=64),
    )

    if v.problems:
        raise ConfigError(str(source), v.problems)
    return PipelineConfig(
        source=source.resolve(),
        data_root=data_root,
        target=target,
        backends=backends,
        datasets=datasets,
        generation=generation,
        audit=audit,
        merge=merge,
        hidden_states=hidden,
    )


def audit_settings_dict(audit: AuditConfig) -> dict[str, Any]:
    """The audit section as `AuditSettings.from_dict` takes it (unset tolerances keep the audit's defaults)."""
    d: dict[str, Any] = {
        "actions": dict(audit.actions),
        "billing_aggregate_bound": audit.billing_aggregate_bound,
        "max_examples": audit.max_examples,
    }
    if audit.billing_row_abs_tolerance is not None:
        d["billing_row_abs_tolerance"] = audit.billing_row_abs_tolerance
    if audit.billing_row_rel_tolerance is not None:
        d["billing_row_rel_tolerance"] = audit.billing_row_rel_tolerance
    if audit.prompt_row_abs_tolerance is not None:
        d["prompt_row_abs_tolerance"] = audit.prompt_row_abs_tolerance
    return d


def _audit_problems(audit: AuditConfig) -> list[str]:
    """Gate names, origins and actions are checked by the audit itself, so the two never disagree."""
    from eagle_pipeline.audit import AuditSettings, AuditSettingsError

    try:
        AuditSettings.from_dict(audit_settings_dict(audit))
    except AuditSettingsError as exc:
        lines = [ln.strip()[2:] for ln in str(exc).splitlines() if ln.strip().startswith("- ")]
        return lines or [str(exc)]
    return []


def _resolve(base: Path, value: str) -> Path:
    p = Path(os.path.expandvars(os.path.expanduser(value)))
    return p if p.is_absolute() else (base / p).resolve()


class _Validator:
    def __init__(self) -> None:
        self.problems: list[str] = []

    def problem(self, path: str, message: str) -> None:
        self.problems.append(f"{path}: {message}")

    def section(self, raw: dict, key: str, required: bool = False) -> dict:
        value = raw.get(key)
        if value is None:
            if required:
                self.problem(key, "required section is missing")
            return {}
        if not isinstance(value, dict):
            self.problem(key, f"expected a mapping, got {type(value).__name__}")
            return {}
        return value

    def unknown(self, mapping: dict, path: str, allowed: set[str]) -> None:
        for key in mapping:
            if key not in allowed:
                self.problem(f"{path}.{key}" if path else str(key), f"unknown key; expected one of {sorted(allowed)}")

    def get(
        self, mapping: dict, key: str, types: Any, path: str, *, required: bool = False, default: Any = None
    ) -> Any:
        full = f"{path}.{key}" if path else key
        if key not in mapping or mapping[key] is None:
            if required:
                self.problem(full, "required")
            return default
        value = mapping[key]
        types_t = types if isinstance(types, tuple) else (types,)
        if isinstance(value, bool) and bool not in types_t:
            self.problem(full, f"expected {'/'.join(t.__name__ for t in types_t)}, got bool")
            return default
        if not isinstance(value, types_t):
            self.problem(
                full, f"expected {'/'.join(t.__name__ for t in types_t)}, got {type(value).__name__} {value!r}"
            )
            return default
        return value
