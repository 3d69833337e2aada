"""Kimi-K2.5 TypeScript tool declarations (`tools_ts_str`): expected strings written out by hand from the format."""

from __future__ import annotations

import pytest

from eagle_pipeline.tokens.tool_declarations import (
    ToolDeclarationError,
    sort_keys_deep,
    typescript_tool_declarations,
)

HEAD = "# Tools\n\n## functions\nnamespace functions {\n"


def fn(name: str, parameters=None, description=None) -> dict:
    f: dict = {"name": name}
    if description is not None:
        f["description"] = description
    if parameters is not None:
        f["parameters"] = parameters
    return {"type": "function", "function": f}


def test_nested_object():
    # The shape of a public example rendered by Moonshot's tokenizer.
    tools = [
        fn(
            "create_user",
            {
                "type": "object",
                "required": ["user"],
                "properties": {
                    "user": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                    }
                },
            },
            "Create a new user record.",
        )
    ]
    assert typescript_tool_declarations(tools) == (
        HEAD + "// Create a new user record.\ntype create_user = (_: {\n  user: {\n    name: string,\n"
        "    age?: number\n  }\n}) => any;\n}\n"
    )


def test_field_order_comments_constraints_defaults_and_types():
    params = {
        "type": "object",
        "required": ["when", "city"],
        "properties": {
            "unit": {"type": "string", "enum": ["C", "F"], "description": "Temperature unit", "default": "C"},
            "city": {"type": "string", "description": "City name", "minLength": 1, "maxLength": 64},
            "days": {"type": "integer", "minimum": 1, "maximum": 7, "default": 3},
            "tags": {"type": "array", "items": {"type": "string", "description": "A tag"}, "maxItems": 5},
            "when": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "extra": {"type": "object", "additionalProperties": {"type": "number"}},
            "flag": {"type": ["boolean", "null"]},
        },
    }
    tools = [
        fn("get_weather", params, "Get the weather.\n\nUses the metric system."),
        fn("ping"),
        {"type": "web_search"},  # not a function: not declared
    ]
    body = (
        "{\n"
        "  // City name\n  // maxLength: 64, minLength: 1\n  city: string,\n"
        "  when: string | null,\n"
        "  // maximum: 7, minimum: 1\n  // Default: 3\n  days?: number,\n"
        "  extra?: {\n    [k: string]: number\n  },\n"
        "  flag?: boolean | null,\n"
        "  // maxItems: 5\n  tags?: Array<\n    // A tag\n    string\n  >,\n"
        '  // Temperature unit\n  // Default: "C"\n  unit?: "C" | "F"\n'
        "}"
    )
    assert typescript_tool_declarations(tools) == (
        HEAD + "// Get the weather.\n\n// Uses the metric system.\n"
        f"type get_weather = (_: {body}) => any;\n"
        "type ping = (_: {}) => any;\n}\n"
    )


def test_defs_become_interfaces_and_self_reference_names_the_parameters():
    tree = fn(
        "tree",
        {
            "type": "object",
            "required": ["root"],
            "$defs": {
                "Node": {
                    "type": "object",
                    "description": "A node.",
                    "required": ["value"],
                    "properties": {
                        "value": {"type": "number"},
                        "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
                    },
                }
            },
            "properties": {"root": {"$ref": "#/$defs/Node", "description": "The root"}},
        },
    )
    nest = fn(
        "nest",
        {"type": "object", "required": ["z"], "properties": {"z": {"type": "string"}, "a": {"$ref": "#"}}},
        "Nested.",
    )
    assert typescript_tool_declarations([tree, nest]) == (
        HEAD + "// A node.\ninterface Node {\n  value: number,\n  children?: Array<Node>\n}\n"
        "type tree = (_: {\n  // The root\n  root: Node\n}) => any;\n"
        # The root interface keeps the given field order.
        "interface parameters {\n  z: string,\n  a?: parameters\n}\n// Nested.\ntype nest = (_: parameters) => any;\n"
        "}\n"
    )


def test_additional_properties_flags_and_boolean_schemas():
    params = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "anything": True,
            "nothing": False,
            "free": {"type": "object", "additionalProperties": True},
            "n": {"type": "number", "enum": [1, 2.5, None]},
        },
    }
    assert typescript_tool_declarations([fn("f", params)]) == (
        HEAD + "type f = (_: {\n  anything?: any,\n  free?: {\n    [k: string]: any\n  },\n  n?: 1 | 2.5 | None,\n"
        "  nothing?: null,\n  [k: string]: never\n}) => any;\n}\n"
    )


def test_nothing_to_declare():
    assert typescript_tool_declarations([]) == ""
    assert typescript_tool_declarations([{"type": "web_search"}, {"type": "function", "function": {}}]) == ""


@pytest.mark.parametrize(
    "schema, message",
    [
        ({"$ref": "#/definitions/X"}, "unsupported \\$ref"),
        ({"$ref": "#/$defs/Missing"}, "names no entry"),
        ({"title": "no type"}, "none of"),
        ({"type": "integer", "enum": [1, "2"]}, "not of type integer"),
        ({"type": ["string", "date"]}, "unsupported type"),
        ({"type": ["string", "integer"], "enum": ["a"]}, "not supported"),
        ({"type": "object", "additionalProperties": "yes", "properties": {}}, "additionalProperties"),
        ("string", "must be an object"),
    ],
)
def test_schemas_outside_the_format_raise(schema, message):
    with pytest.raises(ToolDeclarationError, match=message):
        typescript_tool_declarations([fn("f", {"type": "object", "properties": {"x": schema}})])


def test_sort_keys_deep():
    assert list(sort_keys_deep({"b": 1, "a": [{"d": 1, "c": 2}]})["a"][0]) == ["c", "d"]
    assert list(sort_keys_deep({"b": 1, "a": 2})) == ["a", "b"]


@pytest.mark.parametrize(
    "params",
    [
        # An array item with a non-string type and a comment: Moonshot's tokenizer cannot join it.
        {"type": "object", "properties": {"a": {"type": "array", "items": {"type": 5, "description": "d"}}}},
        # A $ref to a definition that is not an object.
        {
            "type": "object",
            "$defs": {"A": {"type": "object", "$defs": {"B": True}, "properties": {"x": {"$ref": "#/$defs/B"}}}},
        },
    ],
)
def test_edge_schemas_that_make_the_tokenizer_fall_back(params):
    with pytest.raises(ToolDeclarationError):
        typescript_tool_declarations([fn("f", params)])


def test_deep_nesting_falls_back_instead_of_crashing():
    schema: dict = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(ToolDeclarationError):
        typescript_tool_declarations([fn("f", schema)])


def test_definition_marked_self_ref_names_the_parameters():
    params = {
        "type": "object",
        "$defs": {"X": {"type": "string", "$self_ref": True}},
        "properties": {"a": {"$ref": "#/$defs/X"}},
    }
    assert typescript_tool_declarations([fn("f", params)]) == (
        HEAD + "interface X string\ntype f = (_: {\n  a?: parameters\n}) => any;\n}\n"
    )
