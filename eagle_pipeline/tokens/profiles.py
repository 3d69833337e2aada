"""Model profiles: the structural tokens and output layout of a target model family.

A profile names its tokens as strings; `resolve(tokenizer)` turns them into ids for one tokenizer, so the same
profile works with the real Kimi tokenizer, the demo tokenizer, or any transformers tokenizer carrying those tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .tokenizer import TargetTokenizer

TOOL_FORMATS = ("kimi", "qwen3")


@dataclass(frozen=True)
class ModelProfile:
    """Structural tokens and output layout of a model family.

    The reconstructed output (thinking on) is
    `[think_open if the prompt lacks it] reasoning_prefix + reasoning + reasoning_suffix  think_close
    content_prefix + content  [tool calls]  eot`; with thinking off it is `content [tool calls] eot`.
    """

    name: str
    think_open: str = "<think>"
    think_close: str = "</think>"
    eot: str = "<|im_end|>"
    generation_prompt_ends_with_think_open: bool = True
    tool_format: str = "kimi"
    tool_section_begin: str | None = "<|tool_calls_section_begin|>"
    tool_section_end: str | None = "<|tool_calls_section_end|>"
    tool_call_begin: str | None = "<|tool_call_begin|>"
    tool_call_end: str | None = "<|tool_call_end|>"
    tool_arg_begin: str | None = "<|tool_call_argument_begin|>"
    # Plain text the model writes around its reasoning and before its content (Qwen3: "\n", "\n", "\n\n").
    reasoning_prefix: str = ""
    reasoning_suffix: str = ""
    content_prefix: str = ""

    def __post_init__(self) -> None:
        if self.tool_format not in TOOL_FORMATS:
            raise ValueError(
                f"profile {self.name!r}: tool_format must be one of {TOOL_FORMATS}, got {self.tool_format!r}"
            )

    def resolve(self, tokenizer: TargetTokenizer) -> ProfileIds:
        """Look the profile's token strings up in `tokenizer`; KeyError naming profile and tokenizer if one is missing.

        Tool tokens the tokenizer lacks resolve to None (reconstructing a tool call then fails clearly).
        """

        # Only special (added) tokens count: a marker that merely happens to be one ordinary BPE token is text.
        def need(token: str) -> int:
            if token not in tokenizer.special_tokens:
                raise KeyError(
                    f"profile {self.name!r}: {token!r} is not a special token of tokenizer {tokenizer.name!r} "
                    f"({tokenizer.kind}, {tokenizer.source})"
                )
            return tokenizer.special_tokens[token]

        def maybe(token: str | None) -> int | None:
            return None if token is None else tokenizer.special_tokens.get(token)

        ids = ProfileIds(
            think_open_id=need(self.think_open),
            think_close_id=need(self.think_close),
            eot_id=need(self.eot),
            tool_section_begin_id=maybe(self.tool_section_begin),
            tool_section_end_id=maybe(self.tool_section_end),
            tool_call_begin_id=maybe(self.tool_call_begin),
            tool_call_end_id=maybe(self.tool_call_end),
            tool_arg_begin_id=maybe(self.tool_arg_begin),
            structural_ids=(),
            profile=self,
        )
        structural = (
            ids.think_open_id,
            ids.think_close_id,
            ids.eot_id,
            ids.tool_section_begin_id,
            ids.tool_section_end_id,
            ids.tool_call_begin_id,
            ids.tool_call_end_id,
            ids.tool_arg_begin_id,
        )
        return dataclasses.replace(ids, structural_ids=tuple(i for i in structural if i is not None))


@dataclass(frozen=True)
class ProfileIds:
    """A profile's structural token ids for one tokenizer (tool ids are None where the format has no such token)."""

    think_open_id: int
    think_close_id: int
    eot_id: int
    tool_section_begin_id: int | None
    tool_section_end_id: int | None
    tool_call_begin_id: int | None
    tool_call_end_id: int | None
    tool_arg_begin_id: int | None
    structural_ids: tuple[int, ...]
    profile: ModelProfile


KIMI_K25 = ModelProfile(name="kimi-k2.5")

# Qwen3: the generation prompt is `<|im_start|>assistant\n`, so the model writes `<think>\n...\n</think>\n\n` itself
# (with thinking off the prompt already holds `<think>\n\n</think>\n\n`); tool calls are
# `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` after the content, separated by "\n".
QWEN3 = ModelProfile(
    name="qwen3",
    generation_prompt_ends_with_think_open=False,
    tool_format="qwen3",
    tool_section_begin=None,
    tool_section_end=None,
    tool_call_begin="<tool_call>",
    tool_call_end="</tool_call>",
    tool_arg_begin=None,
    reasoning_prefix="\n",
    reasoning_suffix="\n",
    content_prefix="\n\n",
)

PROFILES: dict[str, ModelProfile] = {p.name: p for p in (KIMI_K25, QWEN3)}


def get_profile(name: str | ModelProfile) -> ModelProfile:
    """A built-in profile by name ('kimi-k2.5', 'qwen3'); a ModelProfile is returned unchanged."""
    if isinstance(name, ModelProfile):
        return name
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown model profile {name!r}; known: {sorted(PROFILES)}") from None
