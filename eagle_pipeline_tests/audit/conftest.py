"""Fixtures: the real Kimi tokenizer and a clean 1,200-row table reconstructed with it (built once per session)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from eagle_pipeline.tokens import build_demo_tokenizer, get_profile, load_tokenizer

from .corpus import build_clean_table


@pytest.fixture(scope="session")
def kimi_tok(kimi_dir):
    return load_tokenizer(kimi_dir)


@pytest.fixture(scope="session")
def kimi_ids(kimi_tok):
    return get_profile("kimi-k2.5").resolve(kimi_tok)


@pytest.fixture(scope="session")
def kimi_clean(kimi_tok, kimi_ids) -> pa.Table:
    return build_clean_table(kimi_tok, kimi_ids, 1200, seed=0)


@pytest.fixture(scope="session")
def demo_tok():
    return build_demo_tokenizer()


@pytest.fixture(scope="session")
def demo_ids(demo_tok):
    return get_profile("kimi-k2.5").resolve(demo_tok)
