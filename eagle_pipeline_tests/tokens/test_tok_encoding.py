"""Encoding paths agree with each other and with tiktoken: batch/threads, numpy arrays, specials, surrogates."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from eagle_pipeline.tokens import ids_contain_literal_special
from eagle_pipeline.tokens.tokenizer import TargetTokenizer, literal_alternation


@pytest.fixture(params=["kimi", "demo"])
def tok(request) -> TargetTokenizer:
    return request.getfixturevalue(request.param)


def _mixed_texts(tok: TargetTokenizer, n: int, seed: int = 5) -> list[str]:
    rng = random.Random(seed)
    specials = sorted(tok.special_tokens)
    words = ["Hello", " world", "中文", "🙂", "\n\n", "  ", "<|", "|>", "[", "]", "<think", ">", "é", "x" * 40, " 123"]
    out = []
    for _ in range(n):
        parts = [rng.choice(specials) if rng.random() < 0.2 else rng.choice(words) for _ in range(rng.randint(0, 30))]
        out.append("".join(parts))
    return out


def test_encode_with_specials_equals_tiktoken_all(tok):
    enc = tok._backend.enc
    for text in _mixed_texts(tok, 300):
        assert tok.encode_with_specials(text) == enc.encode(text, allowed_special="all"), text


def test_batch_threads_arrays_agree(tok):
    texts = _mixed_texts(tok, 200, seed=9) + ["long " * 3000, ""]  # > 32k chars in all: the threaded path
    assert sum(map(len, texts)) > 40_000
    seq = [tok._backend.enc.encode_ordinary(t) for t in texts]
    assert tok.encode_ordinary_batch(texts) == seq
    arrays = tok.encode_ordinary_arrays(texts)
    assert [a.tolist() for a in arrays] == seq
    assert all(a.dtype == np.int32 for a in arrays)
    arrays2, flags = tok.encode_ordinary_arrays_flagged(texts)
    assert [a.tolist() for a in arrays2] == seq
    assert flags == [tok.contains_special_string(t) for t in texts]
    assert any(flags) and not all(flags)


def test_lone_surrogate_is_replaced_consistently(tok):
    text = "a\ud800b"
    expected = tok._backend.enc.encode_ordinary(text)
    assert tok.encode_ordinary(text) == expected
    assert tok.encode_ordinary_arrays([text])[0].tolist() == expected
    assert tok.decode(expected) == "a\ufffdb"


def test_literal_alternation_prefers_longest():
    pat = re.compile(literal_alternation(["<a", "<ab>", "<a>", "[x]"]))
    assert pat.findall("<a> <ab> <a [x] <abc") == ["<a>", "<ab>", "<a", "[x]", "<a"]
    assert re.compile(literal_alternation([])).search("anything") is None


def test_ids_contain_literal_special(tok):
    eot = tok.special_tokens["<|im_end|>"]
    clean = tok.encode_ordinary("plain text") + [eot]
    assert not ids_contain_literal_special(tok, clean)
    typed = tok.encode_ordinary("it ends with <|im_") + tok.encode_ordinary("end|> ok") + [eot]
    assert ids_contain_literal_special(tok, typed)
    # A special string split by a real special id is not one literal string.
    split = tok.encode_ordinary("<|im_") + [eot] + tok.encode_ordinary("end|>")
    assert not ids_contain_literal_special(tok, split)
    assert not ids_contain_literal_special(tok, [])
