"""Prompt rendering through chat templates: FACTS.md §3 pins and the transformers-compatible jinja setup."""

from __future__ import annotations

import json

import pytest

from eagle_pipeline.tokens import TemplateRenderError, render_prompt, render_prompt_ids
from eagle_pipeline.tokens.tokenizer import TargetTokenizer

SYSTEM_HI = [{"role": "system", "content": "You are Kimi."}, {"role": "user", "content": "Hi"}]
PIN_1 = (
    "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think>"
)
TOOL_TURN = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "need tool",
        "tool_calls": [
            {
                "id": "functions.get_weather:0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18C sunny"},
]
PIN_2 = (
    "<|im_assistant|>assistant<|im_middle|><think>need tool</think><|tool_calls_section_begin|><|tool_call_begin|>"
    'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
    "<|im_end|><|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n18C sunny<|im_end|>"
)


@pytest.fixture(params=["kimi", "demo"])
def tok(request) -> TargetTokenizer:
    return request.getfixturevalue(request.param)


def test_pin_system_user(tok):
    assert render_prompt(tok, SYSTEM_HI) == PIN_1
    assert render_prompt(tok, json.dumps(SYSTEM_HI)) == PIN_1  # JSON text is accepted too


def test_pin_tool_turn(tok):
    text = render_prompt(tok, TOOL_TURN)
    assert PIN_2 in text
    assert text.endswith("<|im_assistant|>assistant<|im_middle|><think>")


def test_header_ids(kimi):
    ids = render_prompt_ids(kimi, SYSTEM_HI)
    assert ids[-4:] == [163588, 69702, 163601, 163606]
    assert ids == kimi.encode_with_specials(PIN_1)


def test_thinking_off(tok):
    text = render_prompt(tok, SYSTEM_HI, thinking=False)
    assert text.endswith("<|im_assistant|>assistant<|im_middle|><think></think>")
    suffix = render_prompt(tok, TOOL_TURN, thinking=False)
    assert "<think></think><|tool_calls_section_begin|>" in suffix and "need tool" not in suffix


def test_tools_are_declared_in_typescript_with_keys_sorted(tok):
    # `z` before `a`, required `z`: Moonshot's tokenizer sorts the keys first, so the root interface lists `a` first.
    tools = [
        {
            "type": "function",
            "function": {
                "name": "nest",
                "description": "a < b & 'c' → é",
                "parameters": {
                    "type": "object",
                    "required": ["z"],
                    "properties": {"z": {"type": "string"}, "a": {"$ref": "#"}},
                },
            },
        }
    ]
    text = render_prompt(tok, SYSTEM_HI, tools)
    assert text.startswith(
        "<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {\n"
        "interface parameters {\n  a?: parameters,\n  z: string\n}\n// a < b & 'c' → é\n"
        "type nest = (_: parameters) => any;\n}\n<|im_end|><|im_system|>system<|im_middle|>"
    )


def test_tools_outside_the_typescript_format_fall_back_to_sorted_compact_json(tok, caplog):
    # A property schema without a type: Moonshot's tokenizer gives up on TypeScript and the template renders JSON
    # (of the key-sorted tools, without HTML escaping).
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": "a < b & 'c' → é",
                "parameters": {"type": "object", "properties": {"x": {"title": "X"}}},
            },
        }
    ]
    with caplog.at_level("WARNING"):
        text = render_prompt(tok, SYSTEM_HI, tools)
    assert text.startswith(
        '<|im_system|>tool_declare<|im_middle|>[{"function":{"description":"a < b & \'c\' → é","name":"f",'
        '"parameters":{"properties":{"x":{"title":"X"}},"type":"object"}},"type":"function"}]<|im_end|>'
    )
    # The tokenizer's own string is used when the caller supplies it.
    assert render_prompt(tok, SYSTEM_HI, tools, tools_ts_str="namespace functions {}").startswith(
        "<|im_system|>tool_declare<|im_middle|>namespace functions {}<|im_end|>"
    )


def test_reasoning_alias_and_none_keys(tok):
    base = [{"role": "user", "content": "q"}]
    via_reasoning = base + [
        {
            "role": "assistant",
            "content": "",
            "reasoning": "R",
            "tool_calls": [{"id": "x:0", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "x:0", "content": "ok"},
    ]
    text = render_prompt(tok, via_reasoning)
    assert "<think>R</think>" in text
    via_none = [dict(via_reasoning[1], reasoning=None, reasoning_content=None)]
    text = render_prompt(tok, base + via_none + via_reasoning[2:])
    assert "<think></think>" in text and "None" not in text


def test_reasoning_is_preferred_over_thinking_whichever_name_the_template_reads(tok):
    """A message with both `reasoning` and `thinking` renders its `reasoning` (transformers 5 would render
    `thinking`), under every name a template may read; `reasoning_content` still beats both."""
    turn = {
        "role": "assistant",
        "content": "",
        "reasoning": "R",
        "thinking": "T",
        "tool_calls": [{"id": "x:0", "function": {"name": "f", "arguments": "{}"}}],
    }
    msgs = [{"role": "user", "content": "q"}, turn, {"role": "tool", "tool_call_id": "x:0", "content": "ok"}]
    text = render_prompt(tok, msgs)
    assert "<think>R</think>" in text and "T" not in text.replace("Tool", "")
    per_name = _template_tok(
        "{% for m in messages %}{% if m.role == 'assistant' %}"
        "{{ m.reasoning_content }}|{{ m.reasoning }}|{{ m.thinking }}{% endif %}{% endfor %}"
    )
    assert render_prompt(per_name, msgs, add_generation_prompt=False) == "R|R|R"
    only_thinking = [msgs[0], {k: v for k, v in turn.items() if k != "reasoning"}]
    assert render_prompt(per_name, only_thinking, add_generation_prompt=False) == "T|T|T"
    with_content = [msgs[0], dict(turn, reasoning_content="C")]
    assert render_prompt(per_name, with_content, add_generation_prompt=False) == "C|C|C"
    # A non-string under one of the names is not reasoning and is left alone.
    flagged = [msgs[0], dict(turn, thinking=True)]
    assert render_prompt(per_name, flagged, add_generation_prompt=False) == "R|R|True"


def _template_tok(template: str) -> TargetTokenizer:
    from eagle_pipeline.tokens import build_demo_tokenizer

    d = build_demo_tokenizer()
    return TargetTokenizer(
        name="t",
        kind="demo",
        source="test",
        vocab_size=d.vocab_size,
        special_tokens=d.special_tokens,
        chat_template=template,
        backend=d._backend,
        template_vars=d.template_vars,
    )


def test_jinja_setup_like_transformers():
    tpl = (
        "{% for m in messages %}\n"
        "  {{ m | tojson(indent=2) }}|{{ m | tojson(separators=(',', ':'), sort_keys=true) }}\n"
        "{% endfor %}{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
        "{{ bos_token }}{{ thinking }}{{ enable_thinking }}"
    )
    msgs = [{"role": "user", "content": "<b>&</b>"}]
    text = render_prompt(_template_tok(tpl), msgs, thinking=False)
    # trim_blocks + lstrip_blocks drop the block lines' whitespace; tojson keeps '<' and '&'; break works.
    assert text == (
        "  "
        + json.dumps(msgs[0], indent=2, ensure_ascii=False)
        + "|"
        + json.dumps(msgs[0], separators=(",", ":"), sort_keys=True)
        + "\n01[BOS]FalseFalse"
    )


def test_raise_exception_and_missing_template():
    with pytest.raises(TemplateRenderError, match="only user"):
        render_prompt(_template_tok("{{ raise_exception('only user') }}"), SYSTEM_HI)
    with pytest.raises(TemplateRenderError, match="no chat template"):
        render_prompt(_template_tok(None), SYSTEM_HI)  # type: ignore[arg-type]
