"""The transformers backend and the qwen3 profile, on a tiny byte-level BPE built offline in a temp directory.

The tokenizer carries Qwen3's structural tokens (<|im_start|>, <|im_end|> as special; <think>, </think>, <tool_call>,
</tool_call> as non-special added tokens, as in Qwen3) and a ChatML template written here in Qwen3's output format.
"""

from __future__ import annotations

import json

import pytest

from eagle_pipeline.tokens import (
    ModelProfile,
    TokenizerLoadError,
    get_profile,
    load_tokenizer,
    reconstruct_output,
    reconstruct_table,
    render_prompt,
    render_prompt_ids,
    resolve_tokenizer,
)
from eagle_pipeline.tokens.text_hash import text_hash_int64

# Written for this test: ChatML with Qwen3's assistant-turn layout (reasoning block, then content, then
# "\n"-separated <tool_call> blocks) and its thinking switch in the generation prompt.
QWEN_STYLE_TEMPLATE = """
{%- for m in messages -%}
  {%- if m['role'] == 'assistant' -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if m.get('reasoning_content') is not none -%}
      {{- '<think>\\n' ~ m['reasoning_content'].strip('\\n') ~ '\\n</think>\\n\\n' -}}
    {%- endif -%}
    {{- m.get('content') or '' -}}
    {%- for tc in m.get('tool_calls') or [] -%}
      {%- if (loop.first and m.get('content')) or not loop.first -%}{{- '\\n' -}}{%- endif -%}
      {%- set f = tc['function'] -%}
      {{- '<tool_call>\\n{"name": "' ~ f['name'] ~ '", "arguments": ' -}}
      {{- f['arguments'] if f['arguments'] is string else f['arguments'] | tojson -}}
      {{- '}\\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\\n' -}}
  {%- else -%}
    {{- '<|im_start|>' ~ m['role'] ~ '\\n' ~ m['content'] ~ '<|im_end|>\\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n' -}}
  {%- if enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}
{%- endif -%}
"""

CORPUS = [
    "The weather in Paris is sunny today, and the temperature is 18 degrees.",
    'def get_weather(city): return {"city": city, "unit": "celsius"}',
    "Let me think step by step about the question before I answer it.",
    "你好，世界。🙂 Ünïcode text with accents.",
]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    core.train_from_iterator(CORPUS * 20, trainer=trainer)
    core.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    )
    core.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>", "<think>", "</think>")]
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = QWEN_STYLE_TEMPLATE
    d = tmp_path_factory.mktemp("tiny-qwen3")
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    return load_tokenizer(qwen_dir)


def test_loads_as_transformers(qwen, qwen_dir):
    assert qwen.kind == "transformers" and qwen.source == str(qwen_dir)
    assert {"<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"} <= set(qwen.special_tokens)
    assert qwen.vocab_size == max(qwen.special_tokens.values()) + 1
    assert qwen.chat_template and "<tool_call>" in qwen.chat_template
    assert resolve_tokenizer(str(qwen_dir)).fingerprint() == qwen.fingerprint()


def test_ordinary_vs_special_encoding(qwen):
    text = "think <think> and <|im_end|> here"
    with_specials = qwen.encode_with_specials(text)
    assert qwen.special_tokens["<think>"] in with_specials and qwen.special_tokens["<|im_end|>"] in with_specials
    ordinary = qwen.encode_ordinary(text)
    assert not qwen.is_special_id(ordinary).any()
    assert qwen.decode(ordinary) == text == qwen.decode(with_specials)
    assert qwen.encode_ordinary_batch([text, "Paris"]) == [ordinary, qwen.encode_ordinary("Paris")]
    assert qwen.decode_bytes(qwen.encode_ordinary("é🙂")) == "é🙂".encode()
    assert qwen.decode_bytes(with_specials) == text.encode()


def test_qwen3_profile_resolution(qwen, demo):
    ids = get_profile("qwen3").resolve(qwen)
    assert ids.tool_section_begin_id is None and ids.tool_arg_begin_id is None
    assert ids.tool_call_begin_id == qwen.special_tokens["<tool_call>"]
    assert ids.think_open_id == qwen.special_tokens["<think>"] and ids.eot_id == qwen.special_tokens["<|im_end|>"]
    assert set(ids.structural_ids) == {
        qwen.special_tokens[t] for t in ("<think>", "</think>", "<|im_end|>", "<tool_call>", "</tool_call>")
    }
    # The Kimi profile resolves (think/eot exist) but has no tool tokens here: tool calls then fail clearly.
    kimi_on_qwen = get_profile("kimi-k2.5").resolve(qwen)
    assert kimi_on_qwen.tool_section_begin_id is None and kimi_on_qwen.eot_id == ids.eot_id
    call = [{"id": "a", "function": {"name": "f", "arguments": "{}"}}]
    with pytest.raises(ValueError, match="lacks the Kimi tool-call tokens"):
        reconstruct_output(qwen, kimi_on_qwen, reasoning="", content="", tool_calls=call)
    with pytest.raises(ValueError, match="lacks the tool-call tokens"):
        reconstruct_output(demo, "qwen3", reasoning="", content="", tool_calls=call)
    with pytest.raises(KeyError, match="not a special token"):
        ModelProfile(name="odd", eot="<|endoftext|>").resolve(demo)


TURNS = [
    ("reasoning+content", True, {"reasoning_content": "weather first", "content": "It is sunny."}),
    (
        "reasoning+tools",
        True,
        {
            "reasoning_content": "call it",
            "content": "Checking.",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}},
            ],
        },
    ),
    (
        "tools, no content",
        True,
        {
            "reasoning_content": "",
            "content": "",
            "tool_calls": [{"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}],
        },
    ),
    ("thinking off", False, {"content": "Sunny."}),
]


@pytest.mark.parametrize("label,thinking,turn", TURNS, ids=[t[0] for t in TURNS])
def test_qwen3_reconstruction_matches_template(qwen, label, thinking, turn):
    history = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = render_prompt(qwen, history, thinking=thinking)
    assert not prompt.endswith("<think>")
    full = render_prompt(
        qwen, history + [{"role": "assistant", **turn}], add_generation_prompt=False, thinking=thinking
    )
    if not thinking:
        # The template only writes the empty think block in the generation prompt; put the turn after it.
        full = (
            prompt
            + full[len(render_prompt(qwen, history, add_generation_prompt=False)) + len("<|im_start|>assistant\n") :]
        )
    assert full.startswith(prompt)
    rec = reconstruct_output(
        qwen,
        "qwen3",
        reasoning=turn.get("reasoning_content"),
        content=turn.get("content"),
        tool_calls=turn.get("tool_calls"),
        thinking=thinking,
    )
    assert rec.n_tool_calls == len(turn.get("tool_calls", []))
    # The rendered turn ends with "<|im_end|>\n": the model stops at <|im_end|>, the "\n" belongs to the template.
    assert qwen.encode_with_specials(full) == render_prompt_ids(
        qwen, history, thinking=thinking
    ) + rec.ids + qwen.encode_ordinary("\n")
    # The text digest is the rendered turn's text (without the template's trailing "\n"), and the ids decode to it.
    turn_text = full[len(prompt) : -1]
    assert rec.text_hash == text_hash_int64(turn_text)
    assert rec.text_hash == text_hash_int64(qwen.decode_bytes(rec.ids))
    if thinking:
        assert rec.ids[0] == qwen.special_tokens["<think>"]


def test_qwen3_table(qwen):
    import pyarrow as pa

    calls = json.dumps([{"id": "a", "function": {"name": "get_weather", "arguments": "{}"}}])
    table = pa.table(
        {
            "sample_id": ["q1", "q2"],
            "dataset": ["B2", "B2"],
            "source": ["openrouter"] * 2,
            "backend": ["or"] * 2,
            "messages_json": [json.dumps([{"role": "user", "content": "hi"}])] * 2,
            "tools_json": pa.array([None, None], pa.string()),
            "reasoning": ["r", None],
            "content": ["c", ""],
            "tool_calls_json": pa.array([None, calls], pa.string()),
            "thinking": [True, False],
        }
    )
    out = reconstruct_table(table, qwen, "qwen3", dataset_has_tools=True).to_pylist()
    assert out[0]["output_ids"] == reconstruct_output(qwen, "qwen3", reasoning="r", content="c", tool_calls=None).ids
    assert out[1]["n_tool_calls"] == 1 and out[1]["output_ids"][0] == qwen.special_tokens["<tool_call>"]
    assert out[1]["prompt_ids"] == render_prompt_ids(qwen, [{"role": "user", "content": "hi"}], thinking=False)
    for row in out:
        assert row["output_text_hash"] == text_hash_int64(qwen.decode_bytes(row["output_ids"]))


def test_transformers_errors_name_the_spec(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerLoadError, match=str(tmp_path)):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerLoadError, match="no-such-org/no-such-model"):
        load_tokenizer("no-such-org/no-such-model")  # offline: never downloads
