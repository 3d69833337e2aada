"""Choosing and loading the target tokenizer: a Kimi directory, a transformers directory or hub id, or the demo."""

from __future__ import annotations

import os
from pathlib import Path

from .demo import build_demo_tokenizer
from .kimi import load_kimi_directory
from .tokenizer import TargetTokenizer, TokenizerLoadError


def _load_transformers(spec: str, *, allow_download: bool) -> TargetTokenizer:
    # Imported here, not at the top: transformers takes seconds to import and only this route needs it.
    from .transformers_backend import load_transformers

    return load_transformers(spec, allow_download=allow_download)


def load_tokenizer(spec: str | os.PathLike, *, allow_download: bool = False) -> TargetTokenizer:
    """Load a tokenizer: a directory holding `tiktoken.model` -> the Kimi tiktoken encoding; any other directory or
    a hub id -> transformers AutoTokenizer (local files only unless allow_download=True)."""
    spec_str = str(spec)
    path = Path(spec_str).expanduser()
    if path.is_dir():
        if (path / "tiktoken.model").exists():
            return load_kimi_directory(path)
        return _load_transformers(str(path), allow_download=False)
    if path.exists():
        raise TokenizerLoadError(f"{path}: expected a tokenizer directory, got a file")
    # A hub id is 'name' or 'org/name'; anything else that does not exist is a missing directory.
    if spec_str.startswith((".", "/", "~")) or spec_str.count("/") > 1 or "\\" in spec_str:
        raise TokenizerLoadError(f"{path}: tokenizer directory not found")
    return _load_transformers(spec_str, allow_download=allow_download)


def resolve_tokenizer(spec: str | os.PathLike | None, *, allow_download: bool = False) -> TargetTokenizer:
    """None or 'demo' -> the demo tokenizer; 'env:VAR' -> the directory in $VAR if set and present, else demo;
    anything else -> load_tokenizer(spec). Check `.kind` to see which was chosen."""
    if spec is None or str(spec) == "demo":
        return build_demo_tokenizer()
    spec_str = str(spec)
    if spec_str.startswith("env:"):
        var = spec_str[4:]
        if not var:
            raise TokenizerLoadError("tokenizer spec 'env:' needs a variable name, e.g. env:EAGLE_KIMI_TOKENIZER_DIR")
        value = os.environ.get(var)
        if value and Path(value).expanduser().is_dir():
            return load_tokenizer(Path(value).expanduser(), allow_download=allow_download)
        return build_demo_tokenizer()
    return load_tokenizer(spec_str, allow_download=allow_download)
