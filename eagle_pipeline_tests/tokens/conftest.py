"""Fixtures for the tokens tests: the real Kimi tokenizer (skipped without it) and the demo tokenizer."""

from __future__ import annotations

import pytest

from eagle_pipeline.tokens import TargetTokenizer, build_demo_tokenizer, load_tokenizer


@pytest.fixture(scope="session")
def kimi(kimi_dir) -> TargetTokenizer:
    return load_tokenizer(kimi_dir)


@pytest.fixture(scope="session")
def demo() -> TargetTokenizer:
    return build_demo_tokenizer()
