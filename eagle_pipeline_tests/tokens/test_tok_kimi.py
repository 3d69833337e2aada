"""The real Kimi tokenizer built with tiktoken: every FACTS.md pin, the specials, the regex, Kimi's input splitting."""

from __future__ import annotations

import json
import random
import re
import shutil

import numpy as np
import pytest
import regex
import tiktoken

from eagle_pipeline.tokens import (
    KIMI_PAT_STR,
    KIMI_VOCAB_SIZE,
    TokenizerLoadError,
    kimi_special_names,
    load_tokenizer,
    split_like_kimi,
)
from eagle_pipeline.tokens.kimi import read_tiktoken_ranks

# FACTS.md §2, verbatim.
SPECIAL_TABLE = {
    163584: "[BOS]",
    163585: "[EOS]",
    163586: "<|im_end|>",
    163587: "<|im_user|>",
    163588: "<|im_assistant|>",
    163590: "<|start_header_id|>",
    163591: "<|end_header_id|>",
    163593: "[EOT]",
    163594: "<|im_system|>",
    163595: "<|tool_calls_section_begin|>",
    163596: "<|tool_calls_section_end|>",
    163597: "<|tool_call_begin|>",
    163598: "<|tool_call_argument_begin|>",
    163599: "<|tool_call_end|>",
    163601: "<|im_middle|>",
    163602: "<|media_begin|>",
    163603: "<|media_content|>",
    163604: "<|media_end|>",
    163605: "<|media_pad|>",
    163606: "<think>",
    163607: "</think>",
    163838: "[UNK]",
    163839: "[PAD]",
}

ORDINARY_PINS = {
    "Hello": [19180],
    "World": [14350],
    " ": [220],
    "\n": [198],
    "\r\n": [462],
    " leading": [8134],
    " and": [316],
    "assistant": [69702],
    "tool": [20960],
}


def test_identity(kimi):
    assert kimi.kind == "kimi-tiktoken"
    assert kimi.vocab_size == KIMI_VOCAB_SIZE == 163840
    assert len(kimi.special_tokens) == 256
    assert sorted(kimi.special_tokens.values()) == list(range(163584, 163840))
    assert kimi.chat_template and "<|im_assistant|>" in kimi.chat_template
    assert kimi._backend.pat_str == KIMI_PAT_STR


def test_rank_file(kimi_dir):
    ranks = read_tiktoken_ranks(kimi_dir / "tiktoken.model")
    assert len(ranks) == 163584
    by_rank = {r: t for t, r in ranks.items()}
    assert by_rank[0] == b"!"
    assert sorted(len(by_rank[r]) for r in range(256)) == [1] * 256
    assert max(map(len, ranks)) == 256


@pytest.mark.parametrize("text,ids", sorted(ORDINARY_PINS.items()))
def test_ordinary_pins(kimi, text, ids):
    assert kimi.encode_ordinary(text) == ids
    assert kimi.encode_with_specials(text) == ids
    assert kimi.decode(ids) == text


def test_mixed_pins_with_specials(kimi):
    assert kimi.encode_with_specials("abc</think>Hello!<|im_end|>") == [8497, 163607, 19180, 0, 163586]
    assert kimi.encode_with_specials("Let me think.</think>Hello!<|im_end|>") == [
        9413,
        1019,
        2704,
        13,
        163607,
        19180,
        0,
        163586,
    ]
    assert kimi.encode_with_specials("<|im_assistant|>assistant<|im_middle|><think>") == [163588, 69702, 163601, 163606]


def test_specials_are_plain_text_when_ordinary(kimi):
    ids = kimi.encode_ordinary("abc</think>Hello!<|im_end|>")
    assert not kimi.is_special_id(ids).any()
    assert kimi.decode(ids) == "abc</think>Hello!<|im_end|>"


def test_every_special_id(kimi):
    for i, name in SPECIAL_TABLE.items():
        assert kimi.special_tokens[name] == i
        assert kimi.token_id(name) == i
        assert kimi.encode_with_specials(name) == [i]
        assert kimi.decode([i]) == name
    for i in range(163584, 163840):
        if i not in SPECIAL_TABLE:
            name = f"<|reserved_token_{i}|>"
            assert kimi.special_tokens[name] == i
            assert kimi.encode_with_specials(name) == [i]
    # The built-in name table (used by the demo tokenizer) agrees with tokenizer_config.json.
    assert kimi_special_names() == [kimi.decode([163584 + i]) for i in range(256)]


def test_is_special_id_and_token_id(kimi):
    mask = kimi.is_special_id(np.array([0, 19180, 163583, 163584, 163839, 163606]))
    assert mask.tolist() == [False, False, False, True, True, True]
    assert kimi.token_id("Hello") == 19180
    with pytest.raises(KeyError, match="not a single token"):
        kimi.token_id("Hello World, this is not one token")


def test_fingerprint_stable_and_distinct(kimi, kimi_dir, demo):
    fp = kimi.fingerprint()
    assert len(fp) == 64 and fp == load_tokenizer(kimi_dir).fingerprint()
    assert fp != demo.fingerprint()


def test_decode_bytes_partial_utf8(kimi):
    ids = kimi.encode_ordinary("é🙂")
    data = b"".join(kimi.decode_bytes([i]) for i in ids)
    assert data == "é🙂".encode()
    assert kimi.decode_bytes(ids) == "é🙂".encode()


# -- the pre-tokenizer regex: tiktoken's engine (Rust fancy-regex) vs Python `regex` with V1 ----------------------------

_POOL = [
    "aZ",
    "é",
    "ü",
    "ñ",
    "ß",
    "Ø",
    "ǅ",
    "ǈ",
    "ʰ",
    "ʼ",
    "̀",
    "́",
    "ͅ",
    "中",
    "文",
    "字",
    "漢",
    "𠀀",
    "ひ",
    "カ",
    "ー",
    "한",
    "글",
    "Ж",
    "я",
    "Ω",
    "λ",
    "ع",
    "ב",
    "ह",
    "ก",
    "0",
    "7",
    "٣",
    "६",
    "５",
    "Ⅻ",
    "½",
    "²",
    ".",
    ",",
    "!",
    "?",
    "'",
    '"',
    "`",
    "~",
    "@",
    "#",
    "$",
    "%",
    "^",
    "&",
    "*",
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    "<",
    ">",
    "|",
    "/",
    "\\",
    "-",
    "_",
    "+",
    "=",
    ":",
    ";",
    "🙂",
    "👍🏽",
    "👨\u200d👩\u200d👧",
    "🇫🇷",
    "❤️",
    "✨",
] + [
    " ",
    "  ",
    "\t",
    "\n",
    "\r\n",
    "\r",
    "\x0b",
    "\x0c",
    "\x1c",
    "\x85",
    "\u00a0",
    "\u2003",
    "\u3000",
    "\u2028",
    "'s",
    "'S",
    "'ll",
    "'LL",
    "'re",
    "'Ve",
    "'d",
    "'M",
    "'t",
]

_FIXED = [
    "Hello world! Don't stop; it's 3.14159 and 1234567 items.",
    "中文测试：你好，世界！混合English和中文123。",
    "日本語のテキストとカタカナ、ひらがな。한국어 텍스트도.",
    "Ünïcödé àccents and combining: e\u0301 a\u0300 n\u0303, ǅungla ǈ titlecase, ʰmodifier.",
    "emoji 🙂👍🏽 👨‍👩‍👧 🇫🇷🇩🇪 ❤️‍🔥 family",
    "   leading spaces\n\n\n  \t trailing   \r\n\r\nwindows\x0b\x0cend   ",
    "def f(x):\n    return x**2  # comment\n\n\tprint(f'{x!r}')\n",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "WE'RE HERE, they'll go; I'M sure he'd've known. It'S",
    "ABCdefGHI ǄǅǆdžX αΒγΔ ЖжЖ",
    "a&&b [x&&y] &&& 中&&文",
    "٣٤٥ ६७८ １２３ ⅠⅡⅢ ½¾ ²³",
    "tab\tsep\u00a0nbsp\u2003em\u3000ideo\x85nel\u2028ls",
]


def _texts() -> list[str]:
    rng = random.Random(1234)
    out = list(_FIXED)
    for _ in range(400):
        out.append("".join(rng.choice(_POOL) for _ in range(rng.randint(0, 40))))
    return out


def test_pat_str_tiktoken_equals_regex_v1_on_real_vocab(kimi):
    # With Kimi's ranks: tiktoken's own split must give the ids of BPE over the pieces the V1 regex finds.
    pat = regex.compile(KIMI_PAT_STR, flags=regex.V1)
    enc = kimi._backend.enc
    for text in _texts():
        expected = [i for piece in pat.findall(text) for i in enc._encode_single_piece(piece.encode())]
        assert kimi.encode_ordinary(text) == expected, text


def test_pat_str_pieces_identical():
    # A vocabulary holding every V1 piece as one whole token (and nothing else above bytes) makes tiktoken's output
    # spell out its own piece boundaries: it matches only if tiktoken split exactly where the V1 regex did.
    pat = regex.compile(KIMI_PAT_STR, flags=regex.V1)
    texts = _texts()
    pieces_per_text = [[p.encode() for p in pat.findall(t)] for t in texts]
    ranks = {bytes([b]): b for b in range(256)}
    for pieces in pieces_per_text:
        for p in pieces:
            if len(p) > 2 and p not in ranks:  # <= 2-byte pieces could be rebuilt by a merge; keep them as bytes
                ranks[p] = len(ranks)
    enc = tiktoken.Encoding("pieces", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens={})
    n_multi = 0
    for text, pieces in zip(texts, pieces_per_text):
        expected = []
        for p in pieces:
            if p in ranks:
                expected.append(ranks[p])
                n_multi += len(p) > 2
            else:
                expected.extend(p)  # 1-2 byte piece: tiktoken has only byte tokens for it
        assert enc.encode_ordinary(text) == expected, text
    assert n_multi > 500  # the check really exercised whole pieces


def test_han_is_its_own_piece():
    pat = regex.compile(KIMI_PAT_STR, flags=regex.V1)
    assert pat.findall("abc中文def") == ["abc", "中文", "def"]
    assert pat.findall("Ünïcode 日本") == ["Ünïcode", " ", "日本"]


# -- Kimi's pre-splitting of long inputs ----------------------------------------------------------------------------------


def _reference_split(text: str, window: int = 400_000, max_run: int = 25_000) -> list[str]:
    # Char-by-char statement of the rule in FACTS.md §1: windows, then runs longer than max_run are cut.
    out = []
    for w in range(0, len(text), window):
        s = text[w : w + window]
        start, run, prev_space = 0, 0, s[0].isspace() if s else False
        for i, ch in enumerate(s):
            sp = ch.isspace()
            if sp != prev_space:
                run, prev_space = 1, sp
            else:
                run += 1
                if run > max_run:
                    out.append(s[start:i])
                    start, run = i, 1
        out.append(s[start:])
    return out


def test_re_whitespace_is_str_isspace():
    chars = "".join(chr(c) for c in range(0x110000))
    assert re.findall(r"\s", chars) == [c for c in chars if c.isspace()]


@pytest.mark.parametrize(
    "text",
    [
        "short text",
        "a" * 25_000,
        "a" * 25_001,
        "x " + "b" * 60_000 + " y",
        " " * 30_000 + "tail",
        ("word " * 6000) + "\n" * 26_000 + "z" * 51_000,
        ("abc " * 120_000),  # 480k chars: two windows
        "q" * 410_000,
    ],
)
def test_split_like_kimi_matches_reference(text):
    parts = split_like_kimi(text)
    assert "".join(parts) == text
    assert parts == _reference_split(text)


def test_long_runs_encode_per_piece(kimi):
    text = "start " + "z" * 30_000 + " end"
    parts = split_like_kimi(text)
    assert len(parts) == 2
    expected = [i for p in parts for i in kimi._backend.enc.encode_ordinary(p)]
    assert kimi.encode_ordinary(text) == expected
    assert kimi.encode_ordinary_batch([text, "Hello"]) == [expected, [19180]]
    assert kimi.decode(expected) == text


# -- loader errors -------------------------------------------------------------------------------------------------------


def test_missing_config_is_named(tmp_path, kimi_dir):
    shutil.copy(kimi_dir / "tiktoken.model", tmp_path / "tiktoken.model")
    with pytest.raises(TokenizerLoadError, match=r"tokenizer_config\.json"):
        load_tokenizer(tmp_path)


def test_malformed_rank_file_is_named(tmp_path):
    (tmp_path / "tiktoken.model").write_text("IQ== 0\nnot-base64!! 1\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {}}))
    with pytest.raises(TokenizerLoadError, match=r"tiktoken.model:2"):
        load_tokenizer(tmp_path)


def test_gapped_ranks_rejected(tmp_path):
    (tmp_path / "tiktoken.model").write_text("IQ== 0\nIg== 5\n")
    with pytest.raises(TokenizerLoadError, match="contiguous"):
        read_tiktoken_ranks(tmp_path / "tiktoken.model")


def test_added_token_outside_special_range(tmp_path):
    (tmp_path / "tiktoken.model").write_text("IQ== 0\nIg== 1\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"0": {"content": "<x>"}}}))
    with pytest.raises(TokenizerLoadError, match="outside the special range"):
        load_tokenizer(tmp_path)


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(TokenizerLoadError, match="not found"):
        load_tokenizer(tmp_path / "nope" / "kimi")
