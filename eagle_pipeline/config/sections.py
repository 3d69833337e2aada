"""The sections of the pipeline configuration, one typed settings class each (the tables of docs/configuration.md).

A stage's own sections are defined by the stage, and imported from there: `generation` is `generation.run.options.
GenerationSettings`, `hidden_states` (with `.vllm`, `.torchrun`, `.drafters[i]`) is `hidden_states.settings.
HiddenStatesConfig`, `audit` and `merge` are the stages' `AuditSettings` and `MergeSettings`. The sections no stage owns
(target, datasets[i], pools) are defined here. `eagle_pipeline.config` assembles them into `PipelineConfig` and loads
the file; import them from there. Each is a `shared.spec_model.SpecBase`: its fields' types and bounds are the checks,
and `rule_problems` the rules across fields.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, PlainValidator, ValidationInfo
from pydantic import field_validator as _field_validator
from pydantic.dataclasses import dataclass

from eagle_pipeline.audit.spec import AuditSettings, audit_settings_problems
from eagle_pipeline.generation.plan.turns import LAST_TURN, REGENERATE_MODES
from eagle_pipeline.generation.spec import DEFAULT_MAX_TOKENS, SamplingOptions, SamplingSpec
from eagle_pipeline.merge.manifest import MergeSettings, merge_settings_problems
from eagle_pipeline.prompts.formats import PromptFormat
from eagle_pipeline.shared.spec_model import (
    NULL_IS_DEFAULT,
    SPEC_CONFIG,
    Bool,
    Float,
    Int,
    ResolvedPath,
    RuleProblems,
    SpecBase,
    Str,
    resolve_path,
)
from eagle_pipeline.tokens.profiles import PROFILES


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


# A dataset's `regenerate`: generation.plan.turns' modes, spelled once there.
Regenerate = Literal[REGENERATE_MODES]  # type: ignore[valid-type]


@dataclass(frozen=True, config=SPEC_CONFIG)
class DatasetConfig(SpecBase):
    """One prompt dataset (one Dagster partition) and how its responses are sampled."""

    label = "dataset"

    name: Str
    # A file, or a folder (Parquet files, a save_to_disk dataset). Whether it is there is asked when the dataset runs
    # (`PipelineConfig.prompts_problem`), not when the file loads: one missing file must not take down the code
    # location, the other datasets, or `plan`, which reads no prompts.
    prompts: ResolvedPath
    domain: Str
    backend: Str
    prompts_format: PromptFormat = Field("auto", alias="format")  # how `prompts` is laid out (prompts.formats)
    tools: Bool = False
    limit: Annotated[Int, Field(ge=1)] | None = None  # None: every prompt
    max_tokens: Annotated[Int, Field(ge=1)] = DEFAULT_MAX_TOKENS
    sampling_options: SamplingOptions = Field(default_factory=SamplingOptions, alias="sampling")
    budget_usd: Annotated[Float, Field(ge=0)] | None = None
    # last_turn: one new answer after the prompt's history; all_turns: every assistant turn regenerated on-policy
    regenerate: Regenerate = LAST_TURN

    @_field_validator("name")
    @classmethod
    def _name_chars(cls, value: str) -> str:
        if not value.replace("_", "").replace("-", "").isalnum():
            raise ValueError("use letters, digits, '-' and '_' only (it becomes a partition key and a file name)")
        return value

    @property
    def sampling(self) -> SamplingSpec:
        """The sampling sent with every request and hashed into the sample ids."""
        return SamplingSpec(**dataclasses.asdict(self.sampling_options), max_tokens=self.max_tokens)


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


# The `audit` section: the audit's own settings class, checked by the audit's own validation.
AuditSection = Annotated[AuditSettings, PlainValidator(_audit_settings)]


def _merge_settings(value: Any, info: ValidationInfo) -> MergeSettings:
    """The `merge` section is the merge's own MergeSettings: its one validation, each problem at its key."""
    if value is None:
        return MergeSettings()
    if isinstance(value, Mapping) and info.context and info.context.get(NULL_IS_DEFAULT):
        value = {k: v for k, v in value.items() if v is not None}
    problems = merge_settings_problems(value)
    if problems:
        raise RuleProblems("merge", problems)
    return value if isinstance(value, MergeSettings) else MergeSettings.from_dict(value)


# The `merge` section: the merge's own settings class (and the draft vocabulary's size), checked by its validation.
MergeSection = Annotated[MergeSettings, PlainValidator(_merge_settings)]
