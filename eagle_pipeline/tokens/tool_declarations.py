"""Kimi-K2.5 tool declarations: OpenAI tool definitions rendered as a TypeScript `namespace functions`.

Moonshot's Python tokenizer builds this string and hands it to the chat template as `tools_ts_str`; the template puts
it in the `tool_declare` system message. Written here from the format (see docs/tokens.md), not from Moonshot's code:

    # Tools

    ## functions
    namespace functions {
    // Get the weather.
    type get_weather = (_: {
      city: string,
      // Default: "C"
      unit?: "C" | "F"
    }) => any;
    }

Object fields are listed required first, then optional, each group by name; descriptions and a few constraints become
`//` comments above the field; `$defs` become `interface` blocks and `$ref` "#" a root `interface parameters`.
A schema outside what the format covers raises `ToolDeclarationError`; the tokenizer then falls back to the template's
compact-JSON rendering, and `render_prompt` does the same.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_INDENT = "  "
_FIELD_SEP = ",\n"
# JSON-schema keys that the format prints as a `// key: value` comment, per scalar or array type.
_CONSTRAINT_KEYS = {
    "string": ("maxLength", "minLength", "pattern"),
    "number": ("maximum", "minimum"),
    "integer": ("maximum", "minimum"),
    "array": ("maxItems", "minItems"),
}
_UNION_NAMES = {
    "string": "string",
    "number": "number",
    "integer": "number",
    "boolean": "boolean",
    "null": "null",
    "object": "{}",
    "array": "Array<any>",
}
_ENUM_TYPE_CHECKS = {
    "string": lambda v: isinstance(v, str),
    "number": lambda v: isinstance(v, (int, float)),
    "integer": lambda v: isinstance(v, int),
    "boolean": lambda v: isinstance(v, bool),
}


class ToolDeclarationError(ValueError):
    """A tool's JSON schema uses something the TypeScript declaration format does not cover."""


def sort_keys_deep(value: Any) -> Any:
    """Dicts with their keys sorted, recursively (Moonshot's tokenizer sorts the tools this way before rendering)."""
    if isinstance(value, Mapping):
        return {k: sort_keys_deep(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [sort_keys_deep(v) for v in value]
    return value


def _comment(text: str, indent: str = "") -> str:
    # Blank lines of a description stay blank (no "// ").
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


@dataclass
class _Type:
    """One parsed schema node. `kind` picks the rendering; the other fields are used by some kinds only."""

    kind: str  # scalar | object | array | enum | any_of | union | ref
    description: Any = ""
    constraints: dict[str, Any] = field(default_factory=dict)
    name: str = ""  # scalar type name, or a ref's interface name
    fields: list[tuple[str, _Type, bool, Any]] = field(default_factory=list)  # (name, type, optional, default)
    extra: Any = None  # object: additionalProperties (None, bool or _Type); array: item type
    options: list[Any] = field(default_factory=list)  # enum values, or any_of / union member types

    def comments(self, indent: str) -> str:
        lines = []
        if self.description:
            lines.append(_comment(self.description, indent))
        if self.constraints:
            lines.append(indent + "// " + ", ".join(f"{k}: {v}" for k, v in sorted(self.constraints.items())))
        return "".join(line + "\n" for line in lines)

    def render(self, indent: str = "") -> str:
        inner = indent + _INDENT
        if self.kind == "scalar":
            return "number" if self.name == "integer" else self.name
        if self.kind == "ref":
            return self.name
        if self.kind == "enum":
            return " | ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in self.options)
        if self.kind == "union":
            return " | ".join(self.options)
        if self.kind == "any_of":
            return " | ".join(t.render(indent) for t in self.options)
        if self.kind == "array":
            item: _Type = self.extra
            notes = item.comments(inner)
            if not notes:
                return f"Array<{item.render(indent)}>"
            rendered = item.render(inner)
            if not isinstance(rendered, str):  # a non-string "type" (Moonshot's tokenizer fails on it here)
                raise ToolDeclarationError(f"array item type {rendered!r} is not a string")
            return f"Array<\n{notes}{inner}{rendered}\n{indent}>"
        # object
        ordered = sorted(self.fields, key=lambda f: (f[2], f[0]))  # required first, each group by name
        parts = [_render_field(name, typ, optional, default, inner) for name, typ, optional, default in ordered]
        if self.extra is not None:
            if self.extra is True:
                value = "any"
            elif self.extra is False:
                value = "never"
            elif isinstance(self.extra, _Type):
                value = self.extra.render(inner)
            else:
                raise ToolDeclarationError(f"additionalProperties must be a boolean or a schema, got {self.extra!r}")
            parts.append(f"{inner}[k: string]: {value}")
        if not parts:
            return "{}"
        return "{\n" + _FIELD_SEP.join(parts) + "\n" + indent + "}"


def _render_field(name: str, typ: _Type, optional: bool, default: Any, indent: str) -> str:
    notes = typ.comments(indent)
    if default is not None:
        # Numbers and booleans print as Python writes them (True, 1.0); everything else as JSON.
        shown = repr(default) if isinstance(default, (int, float, bool)) else json.dumps(default, ensure_ascii=False)
        notes += f"{indent}// Default: {shown}\n"
    return f"{notes}{indent}{name}{'?' if optional else ''}: {typ.render(indent)}"


class _Parser:
    """Parses one function's parameter schema, collecting `$defs` and noting a self reference (`$ref: "#"`)."""

    def __init__(self) -> None:
        self.definitions: dict[str, Any] = {}
        self.self_referenced = False

    def parse(self, schema: Any) -> _Type:
        if isinstance(schema, bool):
            return _Type("scalar", name="any" if schema else "null")
        if not isinstance(schema, Mapping):
            raise ToolDeclarationError(f"a schema must be an object or a boolean, got {schema!r}")
        if "$ref" in schema:
            return self._ref(schema)
        if "anyOf" in schema:
            return _Type("any_of", schema.get("description", ""), options=[self.parse(s) for s in schema["anyOf"]])
        if "enum" in schema:
            return _enum(schema)
        if "type" in schema:
            kind = schema["type"]
            if isinstance(kind, list):
                unknown = [k for k in kind if k not in _UNION_NAMES]
                if unknown:
                    raise ToolDeclarationError(f"unsupported type(s) {unknown} in a type list")
                return _Type("union", schema.get("description", ""), options=[_UNION_NAMES[k] for k in kind])
            if kind == "object":
                return self.parse_object(schema)
            if kind == "array":
                items = schema.get("items")
                item = self.parse(items) if items else _Type("scalar", name="any")
                return _Type("array", schema.get("description", ""), _constraints(schema, "array"), extra=item)
            return _Type("scalar", schema.get("description", ""), _constraints(schema, kind), name=kind)
        if not schema:
            return _Type("scalar", name="any")
        raise ToolDeclarationError(f"schema has none of $ref, anyOf, enum or type: {dict(schema)!r}")

    def parse_object(self, schema: Mapping[str, Any]) -> _Type:
        node = _Type("object", schema.get("description", ""))
        if not schema:
            return node
        defs = schema.get("$defs")
        if defs:
            if not isinstance(defs, Mapping):
                raise ToolDeclarationError(f"$defs must be an object, got {defs!r}")
            self.definitions.update(defs)
        extra = schema.get("additionalProperties")
        node.extra = self.parse(extra) if isinstance(extra, Mapping) else extra
        if "properties" not in schema:
            return node
        props = schema["properties"]
        if not isinstance(props, Mapping):
            raise ToolDeclarationError(f"properties must be an object, got {props!r}")
        required = set(schema.get("required", []))
        for name, prop in props.items():
            default = prop.get("default") if isinstance(prop, Mapping) else None
            node.fields.append((name, self.parse(prop), name not in required, default))
        return node

    def _ref(self, schema: Mapping[str, Any]) -> _Type:
        ref = schema["$ref"]
        if ref == "#":
            self.self_referenced = True
            name = "parameters"
        elif isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref.split("/")[-1]
            if name not in self.definitions:
                raise ToolDeclarationError(f"$ref {ref!r} names no entry of $defs")
            target = self.definitions[name]
            if not isinstance(target, Mapping):
                raise ToolDeclarationError(f"$defs entry {name!r} is not an object")
            if target.get("$self_ref"):  # a definition marked as the root stands for the parameters themselves
                name = "parameters"
        else:
            raise ToolDeclarationError(f"unsupported $ref {ref!r} (only '#' and '#/$defs/...')")
        return _Type("ref", schema.get("description", ""), name=name)


def _constraints(schema: Mapping[str, Any], kind: str) -> dict[str, Any]:
    keys = _CONSTRAINT_KEYS.get(kind, ()) if isinstance(kind, str) else ()
    return {k: schema[k] for k in keys if k in schema}


def _enum(schema: Mapping[str, Any]) -> _Type:
    values = schema["enum"]
    declared = schema.get("type")
    if isinstance(declared, list):
        # One type, or one type and "null".
        if len(declared) == 1:
            declared = declared[0]
        elif len(declared) == 2 and "null" in declared:
            declared = declared[1] if declared[0] == "null" else declared[0]
        else:
            raise ToolDeclarationError(f"enum with type {declared} is not supported")
    check = _ENUM_TYPE_CHECKS.get(declared) if isinstance(declared, str) else None
    if check is not None:
        for v in values:
            if v is not None and not check(v):
                raise ToolDeclarationError(f"enum value {v!r} is not of type {declared}")
    return _Type("enum", schema.get("description", ""), options=list(values))


def _function(function: Mapping[str, Any]) -> str:
    parser = _Parser()
    params = parser.parse_object(function.get("parameters") or {})
    blocks = []
    root = None
    if parser.self_referenced:
        # A recursive schema: the parameters become a named interface, fields in their given order.
        root = "parameters"
        body = _FIELD_SEP.join(_render_field(n, t, o, d, _INDENT) for n, t, o, d in params.fields)
        blocks.append(f"interface parameters {{\n{body}\n}}" if body else "interface parameters {}")
    for name, schema in list(parser.definitions.items()):
        rendered = parser.parse(schema).render()
        described = schema.get("description", "")
        blocks.append((_comment(described) + "\n" if described else "") + f"interface {name} {rendered}")
    parts = ["\n".join(blocks)]
    if function.get("description"):
        parts.append(_comment(function["description"]))
    parts.append(f"type {function.get('name', 'function')} = (_: {root or params.render()}) => any;")
    return "\n".join(p for p in parts if p)


def typescript_tool_declarations(tools: Sequence[Mapping[str, Any]] | None) -> str:
    """The `tools_ts_str` for OpenAI-format `tools`; "" when there is no function tool.

    Raises ToolDeclarationError when a schema is outside the format (the caller then renders compact JSON).
    """
    functions = []
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            raise ToolDeclarationError(f"a tool must be an object, got {tool!r}")
        if tool.get("type") != "function" or not tool.get("function"):
            continue  # other tool types are not declared
        try:
            functions.append(_function(tool["function"]))
        except ToolDeclarationError:
            raise
        except (AttributeError, KeyError, TypeError, ValueError, RecursionError) as exc:
            name = tool["function"].get("name") if isinstance(tool["function"], Mapping) else None
            raise ToolDeclarationError(f"tool {name!r}: {type(exc).__name__}: {exc}") from exc
    if not functions:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"
