"""Target tokenizers, model profiles, chat-template rendering and reconstruction of exact output ids.

No Dagster imports: this is part of the functional core.
"""

from .demo import DEMO_CHAT_TEMPLATE, build_demo_tokenizer
from .kimi import KIMI_PAT_STR, KIMI_VOCAB_SIZE, kimi_special_names, split_like_kimi
from .loading import load_tokenizer, resolve_tokenizer
from .profiles import KIMI_K25, PROFILES, QWEN3, ModelProfile, ProfileIds, get_profile
from .reconstruct import Reconstruction, ids_contain_literal_special, reconstruct_output
from .render import TemplateRenderError, normalize_messages, render_prompt, render_prompt_ids
from .samples import IDS_RECONSTRUCTED, IDS_RETURNED, TOKEN_SAMPLES_SCHEMA, reconstruct_table
from .tokenizer import EncodingMemo, TargetTokenizer, TokenizerLoadError
from .tool_declarations import ToolDeclarationError, typescript_tool_declarations

__all__ = [
    "DEMO_CHAT_TEMPLATE",
    "IDS_RECONSTRUCTED",
    "IDS_RETURNED",
    "KIMI_K25",
    "KIMI_PAT_STR",
    "KIMI_VOCAB_SIZE",
    "PROFILES",
    "QWEN3",
    "TOKEN_SAMPLES_SCHEMA",
    "EncodingMemo",
    "ModelProfile",
    "ProfileIds",
    "Reconstruction",
    "TargetTokenizer",
    "TemplateRenderError",
    "TokenizerLoadError",
    "ToolDeclarationError",
    "build_demo_tokenizer",
    "get_profile",
    "ids_contain_literal_special",
    "kimi_special_names",
    "load_tokenizer",
    "normalize_messages",
    "reconstruct_output",
    "reconstruct_table",
    "render_prompt",
    "render_prompt_ids",
    "resolve_tokenizer",
    "split_like_kimi",
    "typescript_tool_declarations",
]
