"""The pipeline configuration: one YAML file naming datasets, backends, target tokenizer and model, data root.

`load_config()` reads `$EAGLE_PIPELINE_CONFIG` or the repository's `pipeline.yaml`, validates everything at once and
raises one `ConfigError` that lists every problem with its path in the file and its line (e.g.
`datasets[2].backend: unknown backend 'nope'; ... (line 14)`). Relative paths resolve against the directory of the
config file. API keys are never in the file: a backend names the environment variable that holds its key.

Every section is a typed settings class (`eagle_pipeline.shared.spec_model`), defined by its stage
(`generation.run.options`, `hidden_states.settings`, `audit.spec`, `merge.manifest`) or, for the sections no stage owns,
in `config.sections` (importable from here); the backends and the sampling are the very classes of the Python API
(`BackendSpec`, `SamplingSpec`), and the audit section is the audit's own `AuditSettings`, so each setting has one type,
one check and one default whichever way it is given. This module holds the whole file (`PipelineConfig`, its rules
across sections) and its loading.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from eagle_pipeline.audit.spec import AuditSettings
from eagle_pipeline.config.sections import AuditSection, DatasetConfig, MergeSection, PoolsConfig, TargetConfig
from eagle_pipeline.generation.plan.turns import ALL_TURNS, NO_TURN_KINDS
from eagle_pipeline.generation.run.options import GenerationSettings
from eagle_pipeline.generation.spec import BackendKind, BackendSpec
from eagle_pipeline.hidden_states.settings import HiddenStatesConfig
from eagle_pipeline.merge.manifest import MergeSettings
from eagle_pipeline.shared.spec_model import (
    BASE_DIR,
    NULL_IS_DEFAULT,
    SPEC_CONFIG,
    Problem,
    ResolvedPath,
    SpecBase,
    Str,
    describe_problems,
    field_value,
    validation_problems,
)

__all__ = [
    "CONFIG_ENV",
    "DATA_ROOT_ENV",
    "DEFAULT_CONFIG",
    "INSTALLED_CONFIG",
    "REPO_ROOT",
    "ConfigError",
    "DatasetConfig",
    "PipelineConfig",
    "PoolsConfig",
    "TargetConfig",
    "config_path",
    "load_config",
    "parse_config",
]

CONFIG_ENV = "EAGLE_PIPELINE_CONFIG"
DATA_ROOT_ENV = "EAGLE_DATA_ROOT"
REPO_ROOT = Path(__file__).resolve().parents[2]
# A checkout's pipeline.yaml; an installed wheel has none there and uses the copy it ships (pyproject data-files).
INSTALLED_CONFIG = Path(sys.prefix) / "share" / "eagle-pipeline" / "pipeline.yaml"
DEFAULT_CONFIG = REPO_ROOT / "pipeline.yaml" if (REPO_ROOT / "pipeline.yaml").exists() else INSTALLED_CONFIG


class ConfigError(ValueError):
    """The configuration file is invalid; `problems` lists each one with its path in the file."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s) in the pipeline configuration:\n{lines}")


@dataclass(frozen=True, config=SPEC_CONFIG)
class PipelineConfig(SpecBase):
    """The whole configuration file, validated; `source` is the file it came from."""

    label = "configuration"

    target: TargetConfig
    backends: dict[Str, BackendSpec]
    dataset_list: Annotated[list[DatasetConfig], Field(min_length=1, alias="datasets")]
    data_root: Annotated[ResolvedPath, Field(validate_default=True)] = Path(".eagle-data")
    generation: GenerationSettings = GenerationSettings()
    audit: AuditSection = dataclasses.field(default_factory=AuditSettings)
    merge: MergeSection = dataclasses.field(default_factory=MergeSettings)
    hidden_states: HiddenStatesConfig = HiddenStatesConfig()
    pools: PoolsConfig = PoolsConfig()
    source: Path = dataclasses.field(init=False, default=Path())

    @classmethod
    def rule_problems(cls, data: Mapping[str, Any]) -> list[Problem]:
        """References across sections, and what the file must say about a backend beyond what its spec needs."""
        problems: list[Problem] = []
        backends = data.get("backends")
        for name, b in backends.items() if isinstance(backends, Mapping) else ():
            kind = field_value(b, "kind")
            if kind in set(BackendKind) and kind != BackendKind.IMPORT and not field_value(b, "model"):
                problems.append((("backends", name, "model"), "required"))
            if kind == BackendKind.OPENROUTER and not field_value(b, "api_key_env"):
                msg = "required for kind 'openrouter' (the NAME of the env var holding the key)"
                problems.append((("backends", name, "api_key_env"), msg))
        datasets = data.get("datasets")
        names: list[str] = []
        for i, d in enumerate(datasets if isinstance(datasets, list) else ()):
            name, backend = field_value(d, "name"), field_value(d, "backend")
            if isinstance(name, str):
                if name in names:
                    problems.append((("datasets", i, "name"), f"duplicate dataset name {name!r}"))
                else:
                    names.append(name)
            if isinstance(backend, str) and backend and isinstance(backends, Mapping) and backend not in backends:
                problems.append(
                    (("datasets", i, "backend"), f"unknown backend {backend!r}; defined: {sorted(backends)}")
                )
            elif (
                field_value(d, "regenerate") == ALL_TURNS
                and field_value(field_value(backends, str(backend)), "kind") in NO_TURN_KINDS
            ):
                msg = f"'all_turns' needs a chat backend (openrouter, vllm, simulated); {backend!r} is not one"
                problems.append((("datasets", i, "regenerate"), msg))
        merge = data.get("merge")
        for key in ("weights", "caps"):
            table = field_value(merge, key)
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

    def prompts_problem(self, name: str) -> str | None:
        """`datasets[i].prompts: file not found: PATH (line N)` when dataset `name`'s prompts are not there, as a
        ConfigError names a problem; None when they are. The file is not read: a malformed one is refused, naming
        its line, when the dataset's prompts are loaded (`prompts.load_prompt_file`)."""
        i = self.dataset_names.index(name)
        where = self.dataset_list[i].prompts
        if where.exists():
            return None
        text = self.source.read_text() if self.source.is_file() else None
        document = yaml.compose(text, Loader=yaml.SafeLoader) if text else None
        return describe_problems([(("datasets", i, "prompts"), f"file not found: {where}")], document)[0]

    def config_hash(self) -> str:
        """A short hash of the whole configuration (paths included), recorded in manifests."""
        return hashlib.sha256(json.dumps(_jsonable(self), sort_keys=True).encode()).hexdigest()[:16]


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
