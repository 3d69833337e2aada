"""Texts over 25,000 characters: special tokens are recognised before Kimi's long-text cuts (issue 14.4), in prompts
and in reconstructed outputs, checked against tiktoken run directly on the pieces Moonshot's tokenizer would make."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pyarrow as pa
import pytest

from eagle_pipeline.tokens import KIMI_K25, reconstruct_output, reconstruct_table, render_prompt_ids
from eagle_pipeline.tokens.tokenizer import TargetTokenizer

from .test_tok_kimi import _reference_split

IM_END = 163586


def _added_tokens(kimi_dir) -> list[str]:
    """The strings Moonshot's tokenizer registers as added tokens, read from the config file itself."""
    cfg = json.loads((kimi_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    return [entry["content"] for entry in cfg["added_tokens_decoder"].values()]


def _moonshot_ids(tok: TargetTokenizer, added: list[str], text: str) -> list[int]:
    """Moonshot's `tokenizer(text)`: split at the added tokens (HF's trie), then each piece between them is cut by
    the 400k-window / 25k-run rule and every part goes to tiktoken with all specials allowed."""
    enc = tok._backend.enc
    pattern = re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
    ids: list[int] = []
    for i, piece in enumerate(pattern.split(text)):
        if i % 2:
            ids.append(tok.special_tokens[piece])
        elif piece:
            for part in _reference_split(piece):
                ids.extend(enc.encode(part, allowed_special="all"))
    return ids


def _whole_text_cut_ids(tok: TargetTokenizer, text: str) -> list[int]:
    """The route that was wrong: cut the whole text first, recognise specials afterwards (Moonshot's bare encode)."""
    return [i for part in _reference_split(text) for i in tok._backend.enc.encode(part, allowed_special="all")]


def _long_texts(seed: int = 3) -> list[str]:
    """Runs just under, at and over 25,000 chars with special tokens placed so that they straddle, touch or sit
    beside a 25,000-char cut of the whole text; whitespace runs; a 400,000-char window edge; reserved specials."""
    rng = random.Random(seed)
    specials = ["<|im_end|>", "</think>", "<|im_middle|>", "<|tool_call_begin|>", "<|reserved_token_163589|>"]
    texts = []
    for n in (24_995, 25_000, 25_001, 50_003):
        for sp in specials:
            for shift in (-len(sp) + 1, -3, 0, 1):
                head = "x" * (n + shift)
                texts.append(head + sp + "y" * rng.randint(0, 30_000) + sp + "z")
    texts.append("a" * 24_996 + "<|im_end|>" + " " * 26_000 + "<|im_end|>" + "b" * 10)
    texts.append(" " * 24_998 + "</think>" + " " * 30_000)
    texts.append(("word " * 79_999) + "<|im_end|>" + "q" * 30_000 + "<|im_user|>tail")  # crosses 400,000 chars
    texts.append("<|im_user|>user<|im_middle|>" + "y" * 24_969 + "<|im_end|>")
    return texts


def test_the_reported_prompt_keeps_its_end_of_turn(kimi, kimi_dir):
    ids = render_prompt_ids(kimi, [{"role": "user", "content": "y" * 24_969}])
    assert IM_END in ids
    assert ids[-4:] == [163588, 69702, 163601, 163606]  # <|im_assistant|>assistant<|im_middle|><think>
    text = "<|im_user|>user<|im_middle|>" + "y" * 24_969 + "<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    assert ids == _moonshot_ids(kimi, _added_tokens(kimi_dir), text)


def test_encode_with_specials_equals_moonshot_on_long_texts(kimi, kimi_dir):
    added = _added_tokens(kimi_dir)
    texts = _long_texts()
    differs_from_whole_text_cut = 0
    for text in texts:
        expected = _moonshot_ids(kimi, added, text)
        assert kimi.encode_with_specials(text) == expected, (len(text), text[24_980:25_030])
        differs_from_whole_text_cut += expected != _whole_text_cut_ids(kimi, text)
    # The battery does reach the old bug: on many texts cutting first gives other ids.
    assert differs_from_whole_text_cut > len(texts) // 4


def test_demo_tokenizer_splits_at_specials_first_too(demo):
    text = "x" * 24_995 + "<|im_end|>" + "y" * 100
    ids = demo.encode_with_specials(text)
    assert ids.count(demo.special_tokens["<|im_end|>"]) == 1
    assert demo.decode(ids) == text


@pytest.mark.parametrize("n", [24_990, 24_999, 25_000, 25_001, 25_010, 60_000])
def test_reconstructed_outputs_are_encoded_piece_by_piece(kimi, kimi_dir, n):
    """Output ids are built from the text pieces between structural tokens, each cut on its own, so they equal
    Moonshot's tokenizer run on the whole output text, structural tokens included."""
    reasoning = "r" * n
    content = "c" * (n + 3) + " end"
    calls = [
        {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": '{"a":"' + "v" * n + '"}'}}
    ]
    rec = reconstruct_output(kimi, KIMI_K25, reasoning=reasoning, content=content, tool_calls=calls)
    text = (
        reasoning
        + "</think>"
        + content
        + "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
        + calls[0]["function"]["arguments"]
        + "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
    )
    assert rec.ids == _moonshot_ids(kimi, _added_tokens(kimi_dir), text)
    assert rec.ids == kimi.encode_with_specials(text)
    assert kimi.decode(rec.ids) == text and not rec.literal_special
    # The table path encodes the same pieces as numpy arrays, in worker threads.
    arrays, flags = kimi.encode_ordinary_arrays_flagged([reasoning, content])
    enc = kimi._backend.enc
    for piece, arr in zip([reasoning, content], arrays):
        assert arr.dtype == np.int32
        assert arr.tolist() == [i for part in _reference_split(piece) for i in enc.encode_ordinary(part)]
    assert flags == [False, False]


def test_token_samples_table_of_long_prompts_and_outputs(kimi, kimi_dir):
    """The pipeline's path (reconstruct_table): a prompt whose rendered text has a run of about 25,000 characters
    keeps its special tokens, and the output ids equal reconstruct_output's."""
    messages = [{"role": "user", "content": "y" * 24_969}]
    reasoning, content = "r" * 25_004, "c" * 24_998
    responses = pa.table(
        {
            "sample_id": ["s0"],
            "dataset": ["B1"],
            "source": ["openrouter"],
            "backend": ["openrouter"],
            "messages_json": [json.dumps(messages)],
            "reasoning": [reasoning],
            "content": [content],
            "finish_reason": ["stop"],
        }
    )
    row = reconstruct_table(responses, kimi, KIMI_K25, dataset_has_tools=False).to_pylist()[0]
    text = "<|im_user|>user<|im_middle|>" + "y" * 24_969 + "<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    assert row["prompt_ids"] == _moonshot_ids(kimi, _added_tokens(kimi_dir), text) and IM_END in row["prompt_ids"]
    expected = reconstruct_output(kimi, KIMI_K25, reasoning=reasoning, content=content, tool_calls=None).ids
    assert row["output_ids"] == expected
    assert expected == _moonshot_ids(kimi, _added_tokens(kimi_dir), reasoning + "</think>" + content + "<|im_end|>")
