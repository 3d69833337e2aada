"""Prompt rendering through the tokenizer's own chat template, with jinja2 configured like transformers.

For Kimi-K2.5 with tools, Moonshot's Python tokenizer passes a TypeScript-style `tools_ts_str` to the template; we do
not build it, so the template's own fallback (compact JSON of the tools) is rendered instead. See docs/tokens.md.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .tokenizer import TargetTokenizer

# Names under which APIs return a message's reasoning; templates read `reasoning_content`.
_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


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
    """Drop None-valued keys (templates would print 'None') and expose reasoning as `reasoning_content`."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TemplateRenderError(f"messages[{i}] is not an object: {m!r}")
        msg = {k: v for k, v in m.items() if v is not None}
        if "reasoning_content" not in msg:
            for key in _REASONING_KEYS[1:]:
                if isinstance(msg.get(key), str):
                    msg["reasoning_content"] = msg[key]
                    break
        out.append(msg)
    return out


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
    context: dict[str, Any] = dict(tokenizer.template_vars)
    context.update(
        messages=normalize_messages(messages),  # type: ignore[arg-type]
        tools=list(tools) if tools else None,
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
    return tokenizer.encode_with_specials(render_prompt(tokenizer, messages, tools, thinking=thinking, **template_kwargs))
