"""Reconstruction of output ids from API text, its agreement with the chat template, and the token-samples table."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from eagle_pipeline.prompts import normalized_prompt_key
from eagle_pipeline.tokens import (
    IDS_RECONSTRUCTED,
    IDS_RETURNED,
    TOKEN_SAMPLES_SCHEMA,
    get_profile,
    reconstruct_output,
    reconstruct_table,
    render_prompt,
    render_prompt_ids,
)
from eagle_pipeline.tokens.samples import RENDER_FIELDS
from eagle_pipeline.tokens.text_hash import text_hash_int64
from eagle_pipeline.tokens.tokenizer import TargetTokenizer


@pytest.fixture(params=["kimi", "demo"])
def tok(request) -> TargetTokenizer:
    return request.getfixturevalue(request.param)


def sp(tok: TargetTokenizer, name: str) -> int:
    return tok.special_tokens[name]


def sha(data: bytes | str) -> int:
    """The text hash the reconstruction records (named for the sha256 it replaced)."""
    return text_hash_int64(data)


def test_facts_pin(kimi):
    rec = reconstruct_output(kimi, "kimi-k2.5", reasoning="Let me think.", content="Hello!", tool_calls=None)
    assert rec.ids == [9413, 1019, 2704, 13, 163607, 19180, 0, 163586]
    assert not rec.literal_special and rec.n_tool_calls == 0
    # The digest is that of the text laid out with the structural strings, and the ids decode to exactly it.
    assert rec.text_hash == sha("Let me think.</think>Hello!<|im_end|>") == sha(kimi.decode_bytes(rec.ids))
    # One id off by one is still canonical BPE for this text's neighbour, but it no longer decodes to the text.
    off = list(rec.ids)
    off[1] += 1
    assert kimi.decode(off[:4]) == "Let un think." and kimi.encode_ordinary("Let un think.") == off[:4]
    assert sha(kimi.decode_bytes(off)) != rec.text_hash


def test_profile_object_and_ids_are_interchangeable(tok):
    prof = get_profile("kimi-k2.5")
    kw = dict(reasoning="r", content="c", tool_calls=None)
    assert reconstruct_output(tok, prof, **kw) == reconstruct_output(tok, prof.resolve(tok), **kw)


def test_thinking_off_and_empty(tok):
    close, eot = sp(tok, "</think>"), sp(tok, "<|im_end|>")
    rec = reconstruct_output(tok, "kimi-k2.5", reasoning="ignored", content="Answer.", tool_calls=None, thinking=False)
    assert rec.ids == tok.encode_ordinary("Answer.") + [eot]
    assert rec.text_hash == sha("Answer.<|im_end|>")  # thinking off: the reasoning is not part of the output
    empty = reconstruct_output(tok, "kimi-k2.5", reasoning=None, content=None, tool_calls=None)
    assert empty.ids == [close, eot] and empty.text_hash == sha("</think><|im_end|>")
    empty = reconstruct_output(tok, "kimi-k2.5", reasoning=None, content=None, tool_calls=None, thinking=False)
    assert empty.ids == [eot] and empty.text_hash == sha("<|im_end|>")


def test_kimi_tool_section(tok):
    calls = [
        {
            "id": "functions.get_weather:0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {
            "type": "function",
            "function": {"name": "lookup", "arguments": {"q": "café", "n": [1, 2]}},
        },  # no id, dict args
    ]
    rec = reconstruct_output(tok, "kimi-k2.5", reasoning="need tools", content="", tool_calls=calls)
    expected_text = (
        "need tools</think><|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        '<|tool_call_begin|>functions.lookup:1<|tool_call_argument_begin|>{"q": "café", "n": [1, 2]}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
    )
    assert rec.ids == tok.encode_with_specials(expected_text)
    assert rec.n_tool_calls == 2 and not rec.literal_special
    assert tok.decode(rec.ids) == expected_text
    assert rec.text_hash == sha(expected_text) == sha(tok.decode_bytes(rec.ids))


def test_malformed_tool_call_is_reported(tok):
    with pytest.raises(ValueError, match="no function name"):
        reconstruct_output(tok, "kimi-k2.5", reasoning="", content="", tool_calls=[{"function": {"arguments": "{}"}}])


ADVERSARIAL = {
    "cjk": ("让我想想。日本語もある。한국어", "答案是四十二。"),
    "emoji": ("thinking 🤔👨‍👩‍👧 🇫🇷", "done ✅ ❤️‍🔥"),
    "long_whitespace": (" " * 30_000 + "x\n\n\n\t\t " + "\n" * 5000, "a" + " " * 40_000 + "b"),
    "literal_specials": (
        "I should write <think> and </think> literally",
        "The template ends turns with <|im_end|> and [EOS].",
    ),
    "empty_content": ("reasoning only", ""),
    "whitespace_content": ("r", " \n\t  \n"),
    "combining": ("e\u0301 n\u0303 \u200b zero\u200dwidth", "ǅ ʰ ٣٤٥ ５"),
    "huge_reasoning": (
        "".join(f"Step {i}: consider case {i % 7} and verify 中文 {i * 31 % 997}. 🙂\n" for i in range(4000)),
        "Final.",
    ),
}


@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
def test_adversarial_roundtrip(tok, case):
    reasoning, content = ADVERSARIAL[case]
    close, eot = sp(tok, "</think>"), sp(tok, "<|im_end|>")
    rec = reconstruct_output(tok, "kimi-k2.5", reasoning=reasoning, content=content, tool_calls=None)
    # Layout: ordinary(reasoning) </think> ordinary(content) <|im_end|>, nothing else special.
    assert rec.ids == tok.encode_ordinary(reasoning) + [close] + tok.encode_ordinary(content) + [eot]
    assert int(tok.is_special_id(rec.ids).sum()) == 2
    assert tok.decode(rec.ids) == reasoning + "</think>" + content + "<|im_end|>"
    assert tok.decode_bytes(rec.ids) == (reasoning + "</think>" + content + "<|im_end|>").encode()
    assert rec.literal_special == (case == "literal_specials")
    assert rec.text_hash == sha(reasoning + "</think>" + content + "<|im_end|>") == sha(tok.decode_bytes(rec.ids))


def test_huge_reasoning_size():
    assert len(ADVERSARIAL["huge_reasoning"][0].encode()) > 200_000


def test_literal_special_strings_agree_with_the_digest(tok):
    """Literal special strings in the text are ordinary tokens; those tokens decode to exactly the literal string,
    so the ids still agree with the text digest (which holds the literal string's UTF-8)."""
    literal = "<|im_end|>"
    content = f"Chat templates end a turn with {literal}; reasoning closes with </think>; also [EOS] and <think>."
    rec = reconstruct_output(
        tok, "kimi-k2.5", reasoning="Quote </think> and <|tool_call_begin|> as text.", content=content, tool_calls=None
    )
    assert rec.literal_special
    close, eot = sp(tok, "</think>"), sp(tok, "<|im_end|>")
    assert int(tok.is_special_id(rec.ids).sum()) == 2 and rec.ids.count(close) == 1 and rec.ids[-1] == eot
    # The ordinary run of the literal string decodes to the same bytes as the string itself.
    lit_ids = tok.encode_ordinary(literal)
    assert len(lit_ids) > 1 and not tok.is_special_id(lit_ids).any()
    assert tok.decode_bytes(lit_ids) == literal.encode() == tok.decode_bytes([eot])
    content_ids = rec.ids[rec.ids.index(close) + 1 : -1]
    assert tok.decode_bytes(content_ids) == content.encode()
    expected = "Quote </think> and <|tool_call_begin|> as text.</think>" + content + "<|im_end|>"
    assert rec.text_hash == sha(expected) == sha(tok.decode_bytes(rec.ids))


def test_digest_of_text_the_encoder_cannot_hold(tok):
    """A lone surrogate (possible after json.loads) is encoded as U+FFFD, so the digest hashes U+FFFD too."""
    rec = reconstruct_output(tok, "kimi-k2.5", reasoning="a\ud800b", content="c", tool_calls=None)
    assert tok.decode_bytes(rec.ids) == "a\ufffdb</think>c<|im_end|>".encode()
    assert rec.text_hash == sha(tok.decode_bytes(rec.ids))


def test_literal_special_in_tool_text(tok):
    calls = [{"id": "c:0", "function": {"name": "echo", "arguments": '{"s": "<|tool_call_end|>"}'}}]
    rec = reconstruct_output(tok, "kimi-k2.5", reasoning="", content="", tool_calls=calls)
    assert rec.literal_special
    assert rec.ids.count(sp(tok, "<|tool_call_end|>")) == 1  # only the structural one


# -- consistency with the chat template ------------------------------------------------------------------------------------

TURNS = [
    (
        "thinking, tool calls",
        True,
        {
            "reasoning_content": "I need the weather. Then the time.",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "functions.get_time:1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": {"tz": "Europe/Paris", "fmt": "ü"}},
                },
            ],
        },
    ),
    (
        "thinking, tool call, no content",
        True,
        {
            "reasoning_content": "中文推理 🙂",
            "content": "",
            "tool_calls": [
                {
                    "id": "functions.search:0",
                    "type": "function",
                    "function": {"name": "search", "arguments": '{"q": "x y"}'},
                }
            ],
        },
    ),
    (
        "no thinking, tool call",
        False,
        {
            "content": "Calling.",
            "tool_calls": [
                {"id": "functions.search:0", "type": "function", "function": {"name": "search", "arguments": "{}"}}
            ],
        },
    ),
    ("answer without reasoning", True, {"content": "Plain answer.\n\nWith paragraphs."}),
    ("answer, thinking off", False, {"content": "Short."}),
]


@pytest.mark.parametrize("label,thinking,turn", TURNS, ids=[t[0] for t in TURNS])
def test_reconstruction_matches_template_rendering(tok, label, thinking, turn):
    """Render [user, assistant turn] with the template; the turn's ids after the generation prompt are ours."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    history = [
        {"role": "system", "content": "You are Kimi."},
        {"role": "user", "content": "Weather and time in Paris?"},
    ]
    prompt = render_prompt(tok, history, tools, thinking=thinking)
    full = render_prompt(
        tok, history + [{"role": "assistant", **turn}], tools, thinking=thinking, add_generation_prompt=False
    )
    assert full.startswith(prompt)
    rec = reconstruct_output(
        tok,
        "kimi-k2.5",
        reasoning=turn.get("reasoning_content"),
        content=turn.get("content"),
        tool_calls=turn.get("tool_calls"),
        thinking=thinking,
    )
    assert tok.encode_with_specials(full) == render_prompt_ids(tok, history, tools, thinking=thinking) + rec.ids
    assert rec.n_tool_calls == len(turn.get("tool_calls", []))


# -- the token-samples table -------------------------------------------------------------------------------------------------


def _responses(tok: TargetTokenizer) -> pa.Table:
    msgs = json.dumps([{"role": "user", "content": "Weather in  PARIS?"}])
    msgs2 = json.dumps([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    tools = json.dumps([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])
    calls = json.dumps(
        [
            {
                "id": "functions.get_weather:0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ]
    )
    returned_out = tok.encode_with_specials("think</think>Hi there<|im_end|>")
    returned_tool = tok.encode_with_specials(
        "t</think><|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
    )
    literal_out = tok.encode_ordinary("say <|im_end|>") + [sp(tok, "</think>"), sp(tok, "<|im_end|>")]
    rows = [
        # sample_id, messages, tools, reasoning, content, tool_calls, prompt_ids, output_ids, thinking
        ("s-recon", msgs, None, "Let me think.", "Sunny.", None, None, None, True),
        ("s-tools", msgs, tools, "need tool", "", calls, None, None, True),
        ("s-nothink", msgs2, None, None, "Hello <|im_end|>", None, None, None, False),
        ("s-ret", msgs2, None, "think", "Hi there", None, [1, 2, 3], returned_out, True),
        ("s-ret-noprompt", msgs, None, None, None, calls, None, returned_tool, True),
        ("s-ret-literal", msgs2, None, None, None, None, [5], literal_out, True),
    ]
    cols = list(zip(*rows))
    n = len(rows)
    return pa.table(
        {
            "sample_id": pa.array(cols[0]),
            "dataset": pa.array(["B1"] * n),
            "messages_json": pa.array(cols[1]),
            "tools_json": pa.array(cols[2], pa.string()),
            "source": pa.array(["openrouter", "openrouter", "simulated", "vllm", "sglang", "vllm"]),
            "backend": pa.array(["or", "or", "sim", "v", "s", "v"]),
            "provider": pa.array(["moonshotai", None, None, None, None, None], pa.string()),
            "reasoning": pa.array(cols[3], pa.string()),
            "content": pa.array(cols[4], pa.string()),
            "tool_calls_json": pa.array(cols[5], pa.string()),
            "prompt_token_ids": pa.array(cols[6], pa.list_(pa.int32())),
            "output_token_ids": pa.array(cols[7], pa.list_(pa.int32())),
            "finish_reason": pa.array(["stop", "tool_calls", "stop", "stop", "tool_calls", None], pa.string()),
            "usage_completion_tokens": pa.array([8, None, 3, 5, 9, 1], pa.int64()),
            "thinking": pa.array(cols[8]),
            "raw_response_json": pa.array(["{}"] * n),  # ignored
        }
    )


def test_reconstruct_table(tok):
    resp = _responses(tok)
    out = reconstruct_table(resp, tok, "kimi-k2.5", dataset_has_tools=True)
    # Rows whose prompt ids the server returned add the comparison with the project's render (RENDER_FIELDS).
    assert out.schema.equals(pa.schema([*TOKEN_SAMPLES_SCHEMA, *RENDER_FIELDS]))
    rows = {r["sample_id"]: r for r in out.to_pylist()}
    src = {r["sample_id"]: r for r in resp.to_pylist()}
    assert list(rows) == [r["sample_id"] for r in resp.to_pylist()]
    for sid, row in rows.items():
        s = src[sid]
        messages = json.loads(s["messages_json"])
        assert row["prompt_key"] == normalized_prompt_key(messages)
        assert row["dataset_has_tools"] is True
        assert (
            row["finish_reason"] == s["finish_reason"]
            and row["usage_completion_tokens"] == s["usage_completion_tokens"]
        )
        assert (row["dataset"], row["source"], row["backend"], row["provider"]) == (
            s["dataset"],
            s["source"],
            s["backend"],
            s["provider"],
        )
        ours = render_prompt_ids(tok, messages, json.loads(s["tools_json"] or "null"), thinking=s["thinking"])
        if s["prompt_token_ids"] is not None:
            assert row["prompt_ids"] == s["prompt_token_ids"]
            # The server's ids here are made up, so they differ from the render from the first id on.
            assert ours[0] not in (1, 5) and row["prompt_render_diff"] == 0 and row["rendered_prompt_ids"] == ours
        else:
            assert row["prompt_ids"] == ours
            assert row["prompt_render_diff"] is None and row["rendered_prompt_ids"] is None
        if s["output_token_ids"] is not None:
            assert row["ids_origin"] == IDS_RETURNED and row["output_ids"] == s["output_token_ids"]
            # The server's text fields are not the exact decoding of its ids: no digest.
            assert row["output_text_hash"] is None
        else:
            calls = json.loads(s["tool_calls_json"]) if s["tool_calls_json"] else None
            rec = reconstruct_output(
                tok,
                "kimi-k2.5",
                reasoning=s["reasoning"],
                content=s["content"],
                tool_calls=calls,
                thinking=s["thinking"],
            )
            assert row["ids_origin"] == IDS_RECONSTRUCTED and row["output_ids"] == rec.ids
            assert row["literal_special"] == rec.literal_special and row["n_tool_calls"] == rec.n_tool_calls
            assert row["output_text_hash"] == rec.text_hash == sha(tok.decode_bytes(row["output_ids"]))
    assert rows["s-tools"]["n_tool_calls"] == 1
    assert rows["s-ret-noprompt"]["n_tool_calls"] == 1  # counted from the returned ids
    assert rows["s-nothink"]["thinking"] is False and rows["s-nothink"]["literal_special"] is True
    assert sp(tok, "</think>") not in rows["s-nothink"]["output_ids"]
    assert rows["s-ret-literal"]["literal_special"] is True and rows["s-ret"]["literal_special"] is False
    assert rows["s-recon"]["output_text_hash"] == sha("Let me think.</think>Sunny.<|im_end|>")
    assert rows["s-nothink"]["output_text_hash"] == sha("Hello <|im_end|><|im_end|>")  # literal, then the real eot
    # The same prompt key for the same prompt text whatever the case/whitespace.
    assert rows["s-recon"]["prompt_key"] == normalized_prompt_key([{"role": "user", "content": "weather in paris?"}])


def test_reconstruct_table_reports_bad_rows(tok):
    resp = _responses(tok)
    bad = resp.set_column(
        resp.schema.get_field_index("tool_calls_json"),
        "tool_calls_json",
        pa.array(["[not json", None, None, None, None, None], pa.string()),
    )
    with pytest.raises(ValueError, match=r"s-recon.*tool_calls_json"):
        reconstruct_table(bad, tok, "kimi-k2.5", dataset_has_tools=False)
    bad = resp.set_column(
        resp.schema.get_field_index("messages_json"),
        "messages_json",
        pa.array(["{}"] + resp.column("messages_json").to_pylist()[1:]),
    )
    with pytest.raises(ValueError, match=r"s-recon.*messages_json"):
        reconstruct_table(bad, tok, "kimi-k2.5", dataset_has_tools=False)
    with pytest.raises(ValueError, match="lacks column"):
        reconstruct_table(resp.drop_columns(["messages_json"]), tok, "kimi-k2.5", dataset_has_tools=False)


def test_reconstruct_table_empty(demo):
    empty = _responses(demo).slice(0, 0)
    out = reconstruct_table(empty, demo, "kimi-k2.5", dataset_has_tools=False)
    assert out.num_rows == 0 and out.schema.equals(TOKEN_SAMPLES_SCHEMA)
