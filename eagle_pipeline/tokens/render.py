"""Prompt rendering through the tokenizer's own chat template, with jinja2 configured like transformers.

A template that reads `tools_ts_str` (Kimi-K2.5 and later) gets what Moonshot's Python tokenizer gives it: the tools
with their keys sorted recursively and, from them, the TypeScript declarations of `tool_declarations.py` (or, where a
schema is outside that format, no `tools_ts_str`, so the template renders compact JSON). See docs/tokens.md.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .tokenizer import TargetTokenizer
from .tool_declarations import ToolDeclarationError, sort_keys_deep, typescript_tool_declarations

logger = logging.getLogger(__name__)

# Names under which APIs return a message's reasoning, in the order the project prefers them when a message holds
# several: `reasoning` (what OpenRouter and our responses table call it) before `thinking`. Templates read one of them
# (Kimi and Qwen3 `reasoning_content`, Kimi-K2.6 also `reasoning`, gpt-oss `thinking`), so the chosen text is given
# under every name. transformers 5 orders these names differently (`thinking` before `reasoning`), so on a message with
# both, its own apply_chat_template would render the `thinking` text; this renderer renders `reasoning`.
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


class TemplateRenderError(ValueError):
    """The chat template failed to render (or is missing); the message names the tokenizer."""


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Unlike jinja's built-in, this does not HTML-escape, and it accepts json.dumps' options (as transformers does).
    if separators is not None:
        separators = tuple(separators)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template with transformers' jinja settings (cached per template string)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Drop None-valued keys (templates would print 'None') and give a message's reasoning under every name in
    REASONING_KEYS: the first of them that holds a string wins, so a template renders that text whichever it reads."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TemplateRenderError(f"messages[{i}] is not an object: {m!r}")
        msg = {k: v for k, v in m.items() if v is not None}
        reasoning = next((msg[k] for k in REASONING_KEYS if isinstance(msg.get(k), str)), None)
        if reasoning is not None:
            for key in REASONING_KEYS:
                # A non-string under one of these names (a template's own flag, say) is not reasoning: kept as is.
                if key not in msg or isinstance(msg[key], str):
                    msg[key] = reasoning
        out.append(msg)
    return out


@functools.lru_cache(maxsize=256)
def _moonshot_tools(tools_json: str) -> tuple[list[Any], str | None]:
    # Cached per distinct tool list: a dataset offers the same tools on every row, and the warning is said once.
    tools = sort_keys_deep(json.loads(tools_json))
    try:
        return tools, typescript_tool_declarations(tools)
    except ToolDeclarationError as exc:
        logger.warning("tool declarations rendered as compact JSON, as Moonshot's tokenizer does here: %s", exc)
        return tools, None


def render_prompt(
    tokenizer: TargetTokenizer,
    messages: Sequence[Mapping[str, Any]] | str,
    tools: Sequence[Mapping[str, Any]] | str | None = None,
    *,
    thinking: bool = True,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> str:
    """Render messages (and tools) with the tokenizer's chat template, generation prompt included.

    `thinking` is passed both as `thinking` (Kimi) and `enable_thinking` (Qwen3); JSON strings are accepted for
    messages and tools.
    """
    if tokenizer.chat_template is None:
        raise TemplateRenderError(f"tokenizer {tokenizer.name!r} ({tokenizer.source}) has no chat template")
    if isinstance(messages, str):
        messages = json.loads(messages)
    if isinstance(tools, str):
        tools = json.loads(tools)
    tool_list: list[Any] | None = list(tools) if tools else None
    context: dict[str, Any] = dict(tokenizer.template_vars)
    if tool_list and "tools_ts_str" in tokenizer.chat_template and "tools_ts_str" not in template_kwargs:
        tool_list, ts = _moonshot_tools(json.dumps(tool_list, ensure_ascii=False))
        if ts is not None:
            context["tools_ts_str"] = ts
    context.update(
        messages=normalize_messages(messages),  # type: ignore[arg-type]
        tools=tool_list,
        add_generation_prompt=add_generation_prompt,
        thinking=thinking,
        enable_thinking=thinking,
    )
    context.update(template_kwargs)
    try:
        return compile_template(tokenizer.chat_template).render(**context)
    except jinja2.exceptions.TemplateError as exc:
        raise TemplateRenderError(f"chat template of {tokenizer.name!r} ({tokenizer.source}) failed: {exc}") from exc


def render_prompt_ids(
    tokenizer: TargetTokenizer,
    messages: Sequence[Mapping[str, Any]] | str,
    tools: Sequence[Mapping[str, Any]] | str | None = None,
    *,
    thinking: bool = True,
    **template_kwargs: Any,
) -> list[int]:
    """`encode_with_specials(render_prompt(...))`: the prompt ids the target sees."""
    return tokenizer.encode_with_specials(
        render_prompt(tokenizer, messages, tools, thinking=thinking, **template_kwargs)
    )
