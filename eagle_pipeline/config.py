"""The pipeline configuration: one YAML file naming datasets, backends, target tokenizer and model, data root.

`load_config()` reads `$EAGLE_PIPELINE_CONFIG` or the repository's `pipeline.yaml`, validates everything at once and
raises one `ConfigError` that lists every problem with its path in the file and its line (e.g.
`datasets[2].backend: unknown backend 'nope'; ... (line 14)`). Relative paths resolve against the directory of the
config file. API keys are never in the file: a backend names the environment variable that holds its key.

Every section is a typed settings class (`eagle_pipeline.spec_model`); the backends and the sampling are the very
classes of the Python API (`BackendSpec`, `SamplingSpec`), and the audit section is the audit's own `AuditSettings`,
so each setting has one type, one check and one default whichever way it is given.

Why this module is long: it is the whole file's schema, one class per section (the tables of docs/configuration.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BeforeValidator, Field, PlainValidator, TypeAdapter, ValidationError, ValidationInfo
from pydantic import field_validator as _field_validator
from pydantic.dataclasses import dataclass

from eagle_pipeline.audit.spec import AuditSettings, audit_settings_problems
from eagle_pipeline.generation.answer_log import DEFAULT_FLUSH_S
from eagle_pipeline.generation.spec import (
    DEFAULT_MAX_TOKENS,
    BackendKind,
    BackendSpec,
    SamplingOptions,
    SamplingSpec,
)
from eagle_pipeline.generation.turns import NO_TURN_KINDS
from eagle_pipeline.merge.core import MergeSettings
from eagle_pipeline.prompt_formats import PromptFormat
from eagle_pipeline.spec_model import (
    BASE_DIR,
    NULL_IS_DEFAULT,
    SPEC_CONFIG,
    Bool,
    Float,
    Int,
    Problem,
    RuleProblems,
    SpecBase,
    Str,
    describe_problems,
    resolve_path,
    validation_problems,
)
from eagle_pipeline.tokens.profiles import PROFILES

CONFIG_ENV = "EAGLE_PIPELINE_CONFIG"
DATA_ROOT_ENV = "EAGLE_DATA_ROOT"
REPO_ROOT = Path(__file__).resolve().parent.parent
# A checkout's pipeline.yaml; an installed wheel has none there and uses the copy it ships (pyproject data-files).
INSTALLED_CONFIG = Path(sys.prefix) / "share" / "eagle-pipeline" / "pipeline.yaml"
DEFAULT_CONFIG = REPO_ROOT / "pipeline.yaml" if (REPO_ROOT / "pipeline.yaml").exists() else INSTALLED_CONFIG

_MERGE_DEFAULTS = MergeSettings()


class ConfigError(ValueError):
    """The configuration file is invalid; `problems` lists each one with its path in the file."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s) in the pipeline configuration:\n{lines}")


def _resolved(value: Any, info: ValidationInfo) -> Any:
    return resolve_path(value, info) if isinstance(value, (str, os.PathLike)) else value


ResolvedPath = Annotated[Path, BeforeValidator(_resolved)]


@dataclass(frozen=True, config=SPEC_CONFIG)
class TargetConfig(SpecBase):
    """The target model: its tokenizer, its response layout (profile) and its shape for the extraction plan."""

    label = "target"

    tokenizer: Str
    profile: Str = "kimi-k2.5"
    model_config: Str | None = None  # config.json of the target, for the extraction plan; None: built-in Kimi-K2.5

    @_field_validator("tokenizer")
    @classmethod
    def _tokenizer(cls, value: str, info: ValidationInfo) -> str:
        if value == "demo" or value.startswith("env:"):
            if value == "env:":
                raise ValueError("'env:' needs a variable name, e.g. env:EAGLE_KIMI_TOKENIZER_DIR")
            return value
        path = resolve_path(value, info)
        if path.exists():
            return str(path)
        if Path(os.path.expanduser(value)).is_absolute():
            raise ValueError(f"directory not found: {path}")
        return value  # a hub id

    @_field_validator("profile")
    @classmethod
    def _known_profile(cls, value: str) -> str:
        if value not in PROFILES:
            raise ValueError(f"unknown model profile {value!r}; known: {sorted(PROFILES)}")
        return value

    @_field_validator("model_config")
    @classmethod
    def _resolve(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else str(resolve_path(value, info))


@dataclass(frozen=True, config=SPEC_CONFIG)
class DatasetConfig(SpecBase):
    """One prompt dataset (one Dagster partition) and how its responses are sampled."""

    label = "dataset"

    name: Str
    prompts: ResolvedPath
    domain: Str
    backend: Str
    prompts_format: PromptFormat = Field("auto", alias="format")  # how `prompts` is laid out (prompt_formats)
    tools: Bool = False
    limit: Annotated[Int, Field(ge=1)] | None = None  # None: every prompt
    max_tokens: Annotated[Int, Field(ge=1)] = DEFAULT_MAX_TOKENS
    sampling_options: SamplingOptions = Field(default_factory=SamplingOptions, alias="sampling")
    budget_usd: Annotated[Float, Field(ge=0)] | None = None
    # last_turn: one new answer after the prompt's history; all_turns: every assistant turn regenerated on-policy
    regenerate: Literal["last_turn", "all_turns"] = "last_turn"

    @_field_validator("name")
    @classmethod
    def _name_chars(cls, value: str) -> str:
        if not value.replace("_", "").replace("-", "").isalnum():
            raise ValueError("use letters, digits, '-' and '_' only (it becomes a partition key and a file name)")
        return value

    @_field_validator("prompts")
    @classmethod
    def _prompts_exist(cls, value: Path) -> Path:
        if not value.exists():  # a file, or a folder (Parquet files, a save_to_disk dataset)
            raise ValueError(f"file not found: {value}")
        return value

    @property
    def sampling(self) -> SamplingSpec:
        """The sampling sent with every request and hashed into the sample ids."""
        return SamplingSpec(**dataclasses.asdict(self.sampling_options), max_tokens=self.max_tokens)


@dataclass(frozen=True, config=SPEC_CONFIG)
class GenerationSettings(SpecBase):
    """Run-wide generation settings: commit cadence, answer-log interval, progress, the budget of all datasets."""

    label = "generation"

    budget_usd: Annotated[Float, Field(ge=0)] | None = None
    commit_every_rows: Annotated[Int, Field(ge=1)] = 500
    commit_every_s: Annotated[Float, Field(ge=0)] = 10.0
    # Durability only (what a kill -9 can lose), never the rows: not part of any sample id or fingerprint.
    answer_log_s: Annotated[Float, Field(gt=0)] = DEFAULT_FLUSH_S
    progress_every_s: Annotated[Float, Field(ge=0)] = 30.0


@dataclass(frozen=True, config=SPEC_CONFIG)
class MergeConfig(SpecBase):
    """The merge (defaults: `eagle_pipeline.merge.MergeSettings`) and the draft vocabulary."""

    label = "merge"

    seed: Int = _MERGE_DEFAULTS.seed
    weights: dict[Str, Float] = dataclasses.field(default_factory=dict)
    caps: dict[Str, Int] = dataclasses.field(default_factory=dict)
    dedup: Bool = _MERGE_DEFAULTS.dedup
    eval_fraction: Annotated[Float, Field(ge=0, lt=1)] = _MERGE_DEFAULTS.eval_fraction
    rows_per_shard: Annotated[Int, Field(ge=1)] = _MERGE_DEFAULTS.rows_per_shard
    loss_on: Literal["last_turn", "all_turns"] = "last_turn"
    draft_vocab_size: Annotated[Int, Field(ge=1)] = 32_000

    def settings(self) -> MergeSettings:
        """The settings `merge_datasets` takes."""
        return MergeSettings(
            seed=self.seed,
            weights=dict(self.weights),
            caps=dict(self.caps),
            dedup=self.dedup,
            eval_fraction=self.eval_fraction,
            rows_per_shard=self.rows_per_shard,
            loss_on=self.loss_on,
        )


@dataclass(frozen=True, config=SPEC_CONFIG)
class VLLMEngineConfig(SpecBase):
    """`hidden_states.vllm`: the running `vllm serve` servers the `vllm` engine sends shards to."""

    label = "hidden_states.vllm"

    endpoints: tuple[Str, ...] = ()  # base URLs, or 'simulated' (a loopback double serving tiny-random)
    storage_path: Str = "/dev/shm/hidden_states"  # the connector's shared_storage_path, as this process sees it
    concurrency: Annotated[Int, Field(ge=1)] = 8  # requests in flight per endpoint
    timeout_s: Annotated[Float, Field(gt=0)] = 600.0
    max_retries: Annotated[Int, Field(ge=0)] = 4
    gpus_per_server: Annotated[Int, Field(ge=1)] = 8  # each server's TP size: the plan and `vllm-command`

    @_field_validator("endpoints")
    @classmethod
    def _base_urls(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for e in value:
            if not (e == "simulated" or e.startswith(("http://", "https://"))):
                raise ValueError(f"expected http(s):// base URLs or 'simulated', got {e!r}")
        return value

    @_field_validator("storage_path")
    @classmethod
    def _resolve_storage(cls, value: str, info: ValidationInfo) -> str:
        return str(resolve_path(value, info))


@dataclass(frozen=True, config=SPEC_CONFIG)
class TorchrunConfig(SpecBase):
    """`hidden_states.torchrun`: one shard per torchrun world of `tp_size` processes (transformers' DistributedConfig)."""

    label = "hidden_states.torchrun"

    tp_size: Annotated[Int, Field(ge=1)] = 2
    ep_size: Annotated[Int, Field(ge=1)] | None = None

    @classmethod
    def rule_problems(cls, data: Mapping[str, Any]) -> list[Problem]:
        tp, ep = data.get("tp_size", 2), data.get("ep_size")
        if isinstance(tp, int) and isinstance(ep, int) and ep not in (1, tp):  # transformers: tp | ep | tp (no FSDP)
            return [(("ep_size",), f"must be 1 or tp_size ({tp}): transformers splits the experts over the world")]
        return []


@dataclass(frozen=True, config=SPEC_CONFIG)
class HiddenStatesConfig(SpecBase):
    """Hidden-state extraction: the model run, its shards, batching and disk budget."""

    label = "hidden_states"

    model: Str = "tiny-random"  # or a local transformers model directory
    family: Literal["deepseek_v3", "llama"] = "deepseek_v3"
    seed: Int = 0
    shard_size: Annotated[Int, Field(ge=1)] = 256
    aux_layers: tuple[Int, ...] | None = None  # None (or empty): low/mid/high
    max_tokens_per_batch: Annotated[Int, Field(ge=1)] = 8192
    progress_every_s: Annotated[Float, Field(ge=0)] = 30.0  # a shard's progress reports (log line + observation)
    device: Str = "auto"
    disk_budget_gb: Annotated[Float, Field(ge=0)] | None = None
    # A finished shard extracted under other settings: refuse (naming what differs) or redo (old files kept aside).
    on_settings_change: Literal["refuse", "redo"] = "refuse"
    # Teacher-agreement audit: None = decide from provenance (no for tiny-random or simulated texts) / the audit's
    # default threshold (hidden_states.audit.DEFAULT_MIN_TOP1).
    texts_by_extraction_model: Bool | None = None
    teacher_min_top1: Annotated[Float, Field(ge=0, le=1)] | None = None
    # Where the states live: the project's shards, or a trainer's own files written by extraction (no copy).
    layout: Literal["shards", "specforge", "speculators"] = "shards"
    trainer_layouts: tuple[Literal["specforge", "speculators"], ...] = ("specforge", "speculators")  # derived copies
    # in_process: the model loaded in the shard run; vllm: HTTP clients of vLLM extract_hidden_states servers;
    # torchrun: one tensor-parallel transformers world per shard (docs/hidden_states.md §10-13).
    engine: Literal["in_process", "vllm", "torchrun"] = "in_process"
    vllm: VLLMEngineConfig = VLLMEngineConfig()
    torchrun: TorchrunConfig = TorchrunConfig()

    @classmethod
    def rule_problems(cls, data: Mapping[str, Any]) -> list[Problem]:
        problems: list[Problem] = []
        if data.get("engine") == "vllm" and not _get(data.get("vllm"), "endpoints"):
            problems.append((("vllm", "endpoints"), "required for engine 'vllm': base URLs of running servers"))
        if data.get("layout", "shards") != "shards" and data.get("engine", "in_process") != "in_process":
            problems.append((("layout",), "a trainer layout is written by the in_process engine only (for now)"))
        return problems

    @_field_validator("model")
    @classmethod
    def _resolve_model(cls, value: str, info: ValidationInfo) -> str:
        return value if value == "tiny-random" else str(resolve_path(value, info))

    @_field_validator("aux_layers")
    @classmethod
    def _empty_is_default(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        return value or None


@dataclass(frozen=True, config=SPEC_CONFIG)
class PoolsConfig(SpecBase):
    """Dagster concurrency pools and their limits: set on the instance when it has none (docs/operations.md)."""

    label = "pools"

    llm_api: Annotated[Int, Field(ge=1)] = 4  # dataset runs generating at once
    gpu: Annotated[Int, Field(ge=1)] = 1  # hidden-state shards extracting at once (the GPUs of the host)

    def limits(self) -> dict[str, int]:
        return {"llm_api": self.llm_api, "gpu": self.gpu}


def _audit_settings(value: Any, info: ValidationInfo) -> AuditSettings:
    """The `audit` section is the audit's own AuditSettings: its one validation, each problem at its key."""
    if value is None:
        return AuditSettings()
    if isinstance(value, AuditSettings):
        return value
    if isinstance(value, Mapping) and info.context and info.context.get(NULL_IS_DEFAULT):
        value = {k: v for k, v in value.items() if v is not None}
    problems = audit_settings_problems(value)
    if problems:
        # The path names the key already: "billing_aggregate_bound must be in ..." reads "must be in ..." there.
        raise RuleProblems(
            "audit", [(p.path, p.message.removeprefix(f"{p.path[-1]} ") if p.path else p.message) for p in problems]
        )
    return AuditSettings.from_dict(value)


@dataclass(frozen=True, config=SPEC_CONFIG)
class PipelineConfig(SpecBase):
    """The whole configuration file, validated; `source` is the file it came from."""

    label = "configuration"

    target: TargetConfig
    backends: dict[Str, BackendSpec]
    dataset_list: Annotated[list[DatasetConfig], Field(min_length=1, alias="datasets")]
    data_root: Annotated[ResolvedPath, Field(validate_default=True)] = Path(".eagle-data")
    generation: GenerationSettings = GenerationSettings()
    audit: Annotated[AuditSettings, PlainValidator(_audit_settings)] = dataclasses.field(default_factory=AuditSettings)
    merge: MergeConfig = MergeConfig()
    hidden_states: HiddenStatesConfig = HiddenStatesConfig()
    pools: PoolsConfig = PoolsConfig()
    source: Path = dataclasses.field(init=False, default=Path())

    @classmethod
    def rule_problems(cls, data: Mapping[str, Any]) -> list[Problem]:
        """References across sections, and what the file must say about a backend beyond what its spec needs."""
        problems: list[Problem] = []
        backends = data.get("backends")
        for name, b in backends.items() if isinstance(backends, Mapping) else ():
            kind = _get(b, "kind")
            if kind in set(BackendKind) and kind != BackendKind.IMPORT and not _get(b, "model"):
                problems.append((("backends", name, "model"), "required"))
            if kind == BackendKind.OPENROUTER and not _get(b, "api_key_env"):
                msg = "required for kind 'openrouter' (the NAME of the env var holding the key)"
                problems.append((("backends", name, "api_key_env"), msg))
        datasets = data.get("datasets")
        names: list[str] = []
        for i, d in enumerate(datasets if isinstance(datasets, list) else ()):
            name, backend = _get(d, "name"), _get(d, "backend")
            if isinstance(name, str):
                if name in names:
                    problems.append((("datasets", i, "name"), f"duplicate dataset name {name!r}"))
                else:
                    names.append(name)
            if isinstance(backend, str) and backend and isinstance(backends, Mapping) and backend not in backends:
                problems.append(
                    (("datasets", i, "backend"), f"unknown backend {backend!r}; defined: {sorted(backends)}")
                )
            elif _get(d, "regenerate") == "all_turns" and _get(_get(backends, str(backend)), "kind") in NO_TURN_KINDS:
                msg = f"'all_turns' needs a chat backend (openrouter, vllm, simulated); {backend!r} is not one"
                problems.append((("datasets", i, "regenerate"), msg))
        merge = data.get("merge")
        for key in ("weights", "caps"):
            table = _get(merge, key)
            for ds in table if isinstance(table, Mapping) else ():
                if ds not in names:
                    problems.append((("merge", key, ds), f"unknown dataset; defined: {names}"))
        return problems

    @property
    def datasets(self) -> dict[str, DatasetConfig]:
        """The datasets by name, in file order."""
        return {d.name: d for d in self.dataset_list}

    @property
    def dataset_names(self) -> list[str]:
        return [d.name for d in self.dataset_list]

    def config_hash(self) -> str:
        """A short hash of the whole configuration (paths included), recorded in manifests."""
        return hashlib.sha256(json.dumps(_jsonable(self), sort_keys=True).encode()).hexdigest()[:16]


def _get(obj: Any, key: str) -> Any:
    """A field of a validated settings object or a key of the raw mapping it was validated from."""
    return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
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


def load_config(path: str | os.PathLike[str] | None = None) -> PipelineConfig:
    """Load and validate the pipeline configuration; raise ConfigError listing every problem."""
    p = Path(path) if path is not None else config_path()
    if not p.exists():
        raise ConfigError(str(p), ["file not found"])
    text = p.read_text()
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(str(p), [f"{where}invalid YAML: {getattr(exc, 'problem', exc)}"]) from exc
    return parse_config(raw, source=p, text=text)


def parse_config(raw: Any, *, source: Path, text: str | None = None) -> PipelineConfig:
    """Validate a parsed YAML document into a PipelineConfig; raise ConfigError listing every problem.

    `text`, the document itself, lets each problem name its line.
    """
    if not isinstance(raw, dict):
        raise ConfigError(str(source), ["top level: expected a mapping"])
    problems: list[Problem] = []
    raw = dict(raw)
    if os.environ.get(DATA_ROOT_ENV):
        raw["data_root"] = os.environ[DATA_ROOT_ENV]
    if isinstance(raw.get("backends"), dict):
        # A backend's name is its key in the file.
        backends = {}
        for name, b in raw["backends"].items():
            if isinstance(b, dict) and "name" in b:
                problems.append((("backends", name, "name"), "unknown key; a backend's name is its key under backends"))
            backends[name] = {**b, "name": name} if isinstance(b, dict) else b
        raw["backends"] = backends
    context = {BASE_DIR: source.resolve().parent, NULL_IS_DEFAULT: True}
    try:
        cfg = _ADAPTER.validate_python(raw, context=context)
    except ValidationError as exc:
        problems += validation_problems(PipelineConfig, exc, raw)
    else:
        if not problems:
            object.__setattr__(cfg, "source", source.resolve())
            return cfg
    raise ConfigError(
        str(source), describe_problems(problems, yaml.compose(text, Loader=yaml.SafeLoader) if text else None)
    )


_ADAPTER = TypeAdapter(PipelineConfig)
