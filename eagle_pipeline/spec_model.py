"""The base of every typed settings class (backend, sampling, configuration sections): one definition, one default.

Settings classes are frozen pydantic dataclasses: the Python API constructs them directly (`BackendSpec(...)`), the
YAML loader validates the file's mappings into the same classes, so both paths share every type, bound and default.
Scalars are strict (`"8"` is not an int, `true` is not a number); a float accepts an int.

Rules across fields live in one classmethod, `rule_problems(data)`, written to tolerate raw, possibly invalid input:
pydantic runs a class's own after-validator only when all of its fields are valid, so when a file fails, the
configuration loader also calls `rule_problems` on the raw mapping of every settings object in it, and one error lists
every problem (once).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Self

from pydantic import ConfigDict, Strict, ValidationInfo, model_validator
from pydantic.dataclasses import dataclass

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # strict floats still take ints
Str = Annotated[str, Strict()]
Bool = Annotated[bool, Strict()]

# Keys of the validation context the configuration loader passes.
BASE_DIR = "base_dir"  # relative paths resolve against this directory (the configuration file's)
NULL_IS_DEFAULT = "null_is_default"  # a key set to null in the file takes its default

Loc = tuple[str | int, ...]
Problem = tuple[Loc, str]


class RuleProblems(ValueError):
    """Problems across fields of one settings object; `problems` are (location in the object, message) pairs."""

    def __init__(self, owner: str, problems: list[Problem]):
        self.problems = problems
        text = "; ".join(f"{'.'.join(map(str, loc))}: {msg}" if loc else msg for loc, msg in problems)
        super().__init__(f"{owner}: {text}")


# Every settings class: `@dataclass(frozen=True, config=SPEC_CONFIG)` (pydantic's) over a subclass of SpecBase.
SPEC_CONFIG = ConfigDict(extra="forbid")


@dataclass(frozen=True, config=SPEC_CONFIG)
class SpecBase:
    """Validation shared by every settings class."""

    # Shown in RuleProblems' message, e.g. "backend 'or'"; the `name` field is used when present.
    label: ClassVar[str] = "settings"

    @classmethod
    def rule_problems(cls, data: Mapping[str, Any]) -> list[Problem]:
        """Problems that involve several fields; `data` may be raw input (check types before using a value)."""
        return []

    @model_validator(mode="before")
    @classmethod
    def _nulls_take_defaults(cls, data: Any, info: ValidationInfo) -> Any:
        if info.context and info.context.get(NULL_IS_DEFAULT) and isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @model_validator(mode="after")
    def _check_rules(self) -> Self:
        fields = type(self).__pydantic_fields__  # type: ignore[attr-defined]
        values = {(f.alias or name): getattr(self, name) for name, f in fields.items()}
        problems = type(self).rule_problems(values)
        if problems:
            name = getattr(self, "name", None)
            raise RuleProblems(f"{self.label} {name!r}" if isinstance(name, str) else self.label, problems)
        return self


def resolve_path(value: str | os.PathLike[str], info: ValidationInfo) -> Path:
    """`~` and `$VARS` expanded; a relative path resolved against the configuration file's directory when loading one."""
    p = Path(os.path.expandvars(os.path.expanduser(os.fspath(value))))
    base = (info.context or {}).get(BASE_DIR)
    return p if p.is_absolute() or base is None else (Path(base) / p).resolve()
