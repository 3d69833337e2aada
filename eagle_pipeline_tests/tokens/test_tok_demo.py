"""The demo tokenizer: deterministic, fast, Kimi's specials and regex, and a template that renders like K2.5's."""

from __future__ import annotations

import time

import pytest

from eagle_pipeline.tokens import (
    DEMO_CHAT_TEMPLATE,
    KIMI_PAT_STR,
    build_demo_tokenizer,
    kimi_special_names,
    render_prompt,
)
from eagle_pipeline.tokens.demo import DEMO_NUM_MERGES, _corpus, train_bpe


def test_demo_identity(demo):
    assert demo.kind == "demo" and demo.name == "demo"
    n_ranks = 256 + DEMO_NUM_MERGES
    assert demo.vocab_size == n_ranks + 256
    names = kimi_special_names()
    assert [demo.special_tokens[n] for n in names] == list(range(n_ranks, n_ranks + 256))
    assert demo.special_tokens["<|im_end|>"] == n_ranks + 2
    assert demo.special_tokens["<think>"] == n_ranks + 22 and demo.special_tokens["</think>"] == n_ranks + 23
    assert demo._backend.pat_str == KIMI_PAT_STR
    assert demo.chat_template == DEMO_CHAT_TEMPLATE
    assert demo.decode_bytes([0]) == b"!"  # GPT-2 byte order, as in Kimi's rank file


def test_demo_deterministic_and_fast(demo):
    build = build_demo_tokenizer.__wrapped__  # the uncached builder, so the shared cached instance stays put
    t0 = time.perf_counter()
    a = build()
    elapsed = time.perf_counter() - t0
    b = build()
    assert a is not b and a is not demo
    assert a.fingerprint() == b.fingerprint() == demo.fingerprint()
    assert a.encode_ordinary(_corpus()[:5000]) == demo.encode_ordinary(_corpus()[:5000])
    assert elapsed < 1.0
    assert build_demo_tokenizer() is build_demo_tokenizer()  # cached


def test_bpe_training_is_order_independent_of_ties():
    # Same corpus twice gives identical ranks; a different corpus gives different merges.
    corpus = _corpus()
    assert train_bpe(corpus, 300) == train_bpe(corpus, 300)
    assert train_bpe(corpus, 300) != train_bpe(corpus[: len(corpus) // 3] + "zzzz qqqq " * 500, 300)


def test_bpe_merges_compress(demo):
    text = "Let me think about the weather in Paris. The answer is 42."
    ids = demo.encode_ordinary(text)
    assert len(ids) < len(text.encode()) / 2.5
    assert demo.decode(ids) == text


def test_demo_specials_roundtrip(demo):
    text = "<|im_assistant|>assistant<|im_middle|><think>reason</think>answer<|im_end|>"
    ids = demo.encode_with_specials(text)
    assert ids[:1] == [demo.special_tokens["<|im_assistant|>"]] and ids[-1] == demo.special_tokens["<|im_end|>"]
    assert demo.decode(ids) == text
    ordinary = demo.encode_ordinary(text)
    assert not demo.is_special_id(ordinary).any() and demo.decode(ordinary) == text


CONVERSATIONS = [
    ([{"role": "system", "content": "You are Kimi."}, {"role": "user", "content": "Hi"}], None),
    ([{"role": "user", "content": "What is 2+2?"}], None),
    (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
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
        ],
        [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Weather <now> & later",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
    ),
    (
        [
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "answer one", "reasoning_content": "dropped in history"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look "},
                    {"type": "image_url", "image_url": {"url": "x"}},
                    {"type": "video", "video": "v"},
                    {"type": "text", "text": "done"},
                ],
            },
            {
                "role": "assistant",
                "content": "calling",
                "reasoning_content": "kept in suffix",
                "tool_calls": [
                    {"id": "call_1", "function": {"name": "f", "arguments": {"a": [1, 2], "b": "é"}}},
                    {"id": "call_2", "function": {"name": "g", "arguments": "{}"}},
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "name": "f", "content": "r1"},
            {"role": "tool", "tool_call_id": "call_2", "content": "r2"},
        ],
        None,
    ),
    (
        [
            {"role": "system", "name": "policy", "content": "Be brief."},
            {"role": "user", "name": "alice", "content": "hello\n\n  world  "},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "functions.search:0", "function": {"name": "search", "arguments": '{"q":"x"}'}}],
            },
            {"role": "tool", "tool_call_id": "functions.search:0", "content": ""},
        ],
        None,
    ),
]


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("case", range(len(CONVERSATIONS)))
def test_demo_template_renders_like_k25(kimi, demo, case, thinking, gen):
    messages, tools = CONVERSATIONS[case]
    ours = render_prompt(demo, messages, tools, thinking=thinking, add_generation_prompt=gen)
    real = render_prompt(kimi, messages, tools, thinking=thinking, add_generation_prompt=gen)
    assert ours == real
