"""The base of every typed settings class (backend, sampling, configuration sections): one definition, one default.

Settings classes are frozen pydantic dataclasses: the Python API constructs them directly (`BackendSpec(...)`), the
YAML loader validates the file's mappings into the same classes, so both paths share every type, bound and default.
Scalars are strict (`"8"` is not an int, `true` is not a number); a float accepts an int.

Rules across fields live in one classmethod, `rule_problems(data)`, written to tolerate raw, possibly invalid input:
pydantic runs a class's own after-validator only when all of its fields are valid, so when a file fails, the
configuration loader also calls `rule_problems` on the raw mapping of every settings object in it, and one error lists
every problem (once). `validation_problems` and `describe_problems` turn a failed validation into those lines
(`datasets[1].max_tokens: expected int, got str 'many' (line 9)`).
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Self

import yaml
from pydantic import BeforeValidator, ConfigDict, Strict, ValidationError, ValidationInfo, model_validator
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


def field_value(obj: Any, key: str) -> Any:
    """A field of a validated settings object or a key of the raw mapping it was validated from."""
    return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)


def _resolved(value: Any, info: ValidationInfo) -> Any:
    return resolve_path(value, info) if isinstance(value, (str, os.PathLike)) else value


# A path field of a settings class, resolved by `resolve_path` (relative to the configuration file's directory).
ResolvedPath = Annotated[Path, BeforeValidator(_resolved)]


def validation_problems(root: type, exc: ValidationError, raw: Any) -> list[Problem]:
    """Every problem of `raw`, which failed validation into `root`, as (location, message) pairs.

    pydantic's errors in this project's words, and the `rule_problems` of every settings object in `raw` (rules run
    by pydantic only where all fields were valid); a problem found both ways is listed once.
    """
    problems = [p for err in exc.errors() for p in _problems_of(root, err)]
    return list(dict.fromkeys(problems + _rules_of(root, raw, ())))


def describe_problems(problems: list[Problem], document: yaml.Node | None) -> list[str]:
    """`path.to[0].key: message (line N)`, in the order of the YAML document the data came from."""
    lines = _LineIndex(document)
    found = sorted(problems, key=lambda p: lines.line_of(p[0]) or 0)
    return [_describe(loc, msg, lines) for loc, msg in found]


def _problems_of(root: type, err: Any) -> list[Problem]:
    """One pydantic error as (location, message) pairs."""
    loc: Loc = tuple(err["loc"])
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    if kind == "value_error" and isinstance(ctx.get("error"), RuleProblems):
        return [(loc + sub, msg) for sub, msg in ctx["error"].problems]
    if loc and loc[-1] == "[key]":
        return [(loc[:-1], "a key here must be a string")]
    if kind == "missing":
        section = _is_section(_type_at(root, loc))
        return [(loc, "required section is missing" if section else "required")]
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        return [(loc, f"unknown key; expected one of {_keys_at(root, loc[:-1])}")]
    if kind in _TYPE_NAMES:
        got = type(value).__name__ if isinstance(value, bool) else f"{type(value).__name__} {value!r}"
        return [(loc, f"expected {_TYPE_NAMES[kind]}, got {got}")]
    if kind in _BOUNDS:
        op, key = _BOUNDS[kind]
        return [(loc, f"must be {op} {ctx[key]}")]
    if kind in ("enum", "literal_error"):
        return [(loc, f"must be one of {ctx.get('expected')}, got {value!r}")]
    if kind == "too_short":
        return [(loc, f"at least {ctx.get('min_length')} entry is required")]
    if kind == "value_error":
        return [(loc, str(ctx.get("error", err["msg"])))]
    return [(loc, err["msg"])]


_TYPE_NAMES = {
    "int_type": "int",
    "int_from_float": "int",
    "float_type": "int/float",
    "string_type": "str",
    "bool_type": "bool",
    "dict_type": "a mapping",
    "dataclass_type": "a mapping",
    "dataclass_args_type": "a mapping",
    "list_type": "a list",
    "tuple_type": "a list",
    "path_type": "a path",
}
_BOUNDS = {
    "greater_than": (">", "gt"),
    "greater_than_equal": (">=", "ge"),
    "less_than": ("<", "lt"),
    "less_than_equal": ("<=", "le"),
}


def _unwrap(tp: Any) -> Any:
    """The type itself: Annotated and Optional peeled off."""
    while True:
        if typing.get_origin(tp) is Annotated:
            tp = typing.get_args(tp)[0]
        elif typing.get_origin(tp) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def _is_section(tp: Any) -> bool:
    tp = _unwrap(tp)
    return typing.get_origin(tp) in (dict, list) or (isinstance(tp, type) and dataclasses.is_dataclass(tp))


def _fields(cls: type) -> dict[str, Any]:
    """The keys a settings class takes in the file (aliases where set) -> their types."""
    if not hasattr(cls, "__pydantic_fields__"):  # a plain dataclass validated by a function of its own
        return {f.name: f.type for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    fields = cls.__pydantic_fields__
    return {(f.alias or name): f.annotation for name, f in fields.items() if f.init is not False}


def _type_at(tp: Any, loc: Loc) -> Any:
    """The declared type at `loc` below `tp` (None where the path leaves the declared types)."""
    for part in loc:
        tp = _unwrap(tp)
        origin = typing.get_origin(tp)
        if origin is dict:
            tp = typing.get_args(tp)[1]
        elif origin in (list, tuple):
            tp = typing.get_args(tp)[0]
        elif isinstance(tp, type) and isinstance(part, str):
            tp = _fields(tp).get(part)
        else:
            return None
    return tp


def _keys_at(root: type, loc: Loc) -> list[str]:
    tp = _unwrap(_type_at(root, loc))
    return sorted(_fields(tp)) if isinstance(tp, type) else []


def _rules_of(tp: Any, value: Any, loc: Loc) -> list[Problem]:
    """`rule_problems` of every settings object in raw data, at its location."""
    tp = _unwrap(tp)
    origin = typing.get_origin(tp)
    out: list[Problem] = []
    if isinstance(tp, type) and issubclass(tp, SpecBase) and isinstance(value, Mapping):
        out += [(loc + sub, msg) for sub, msg in tp.rule_problems(value)]
        for key, sub_tp in _fields(tp).items():
            if key in value:
                out += _rules_of(sub_tp, value[key], loc + (key,))
    elif origin is dict and isinstance(value, Mapping):
        out += [p for k, v in value.items() for p in _rules_of(typing.get_args(tp)[1], v, loc + (k,))]
    elif origin is list and isinstance(value, list):
        out += [p for i, v in enumerate(value) for p in _rules_of(typing.get_args(tp)[0], v, loc + (i,))]
    return out


def _describe(loc: Loc, message: str, lines: _LineIndex) -> str:
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "top level"
    line = lines.line_of(loc)
    return f"{path}: {message}" + (f" (line {line})" if line else "")


class _LineIndex:
    """Line numbers of the YAML nodes, by path: the deepest node of the path that exists in the file."""

    def __init__(self, root: yaml.Node | None):
        self.root = root

    def line_of(self, loc: Loc) -> int | None:
        node = self.root
        if node is None:
            return None
        for part in loc:
            child = None
            if isinstance(node, yaml.MappingNode):
                child = next((v for k, v in node.value if getattr(k, "value", None) == str(part)), None)
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
                child = node.value[part]
            if child is None:
                break
            node = child
        return node.start_mark.line + 1
