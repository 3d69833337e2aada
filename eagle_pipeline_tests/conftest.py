"""Shared fixtures. The real Kimi tokenizer is read from $EAGLE_KIMI_TOKENIZER_DIR (set by .ci/run and the Makefile)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

KIMI_ENV = "EAGLE_KIMI_TOKENIZER_DIR"


def kimi_tokenizer_dir() -> Path | None:
    value = os.environ.get(KIMI_ENV)
    if value and (Path(value) / "tiktoken.model").exists():
        return Path(value)
    return None


@pytest.fixture(scope="session")
def kimi_dir() -> Path:
    d = kimi_tokenizer_dir()
    if d is None:
        pytest.skip(f"real Kimi tokenizer not available: set {KIMI_ENV} to a directory holding tiktoken.model")
    return d
