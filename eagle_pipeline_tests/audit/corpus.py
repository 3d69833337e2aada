"""Synthetic, valid token-samples tables built with the real reconstruction code, and row-level corruptions."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from eagle_pipeline.tokens import TOKEN_SAMPLES_SCHEMA, reconstruct_output, render_prompt_ids

SENTENCES = [
    "Let me think about this step by step.",
    "The user wants a short answer, so I will keep it brief.",
    "First, compute 17 * 23 = 391; then add 9 to get 400.",
    "我需要先理解问题，然后给出答案。",
    "東京は日本の首都です。",
    "Résumé: naïve café owners façade — “quoted” text…",
    "Emoji test: 🚀🔥 and a family 👨‍👩‍👧‍👦 plus flags 🇫🇷🇯🇵.",
    "def f(x):\n    return x ** 2  # square\n",
    "```python\nprint('hello, world')\n```",
    "Numbers: 3.14159, 2,718, 1e-9, 0xFF, 1234567890.",
    "Tabs\tand  double  spaces   and trailing spaces   ",
    "\n\nTwo blank lines above.\n",
    "Литературный русский текст с ударениями.",
    "عربي: مرحبا بالعالم",
    "Mixed 中文 and English words in one 句子.",
    "A literal template marker: <|im_end|> should stay text.",
    "Reasoning tags as text: <think> and </think> are just strings here.",
    "Tool markup as text: <|tool_calls_section_begin|><|tool_call_begin|>",
    "Math: ∑_{i=1}^{n} i = n(n+1)/2, ∀x ∈ ℝ.",
    "URL https://example.com/path?q=1&r=2#frag and email a.b@example.org",
    "It's, they're, we've, I'm, you'll, he'd.",
    "Ends without punctuation",
    " leading space",
    "ALL CAPS HEADLINE WITH NUMBERS 2024",
    'JSON inline: {"key": [1, 2, {"nested": null}]}',
]

TOOL_NAMES = ["get_weather", "search", "run_code", "lookup_user", "翻译"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The {name} tool.",
            "parameters": {
                "type": "object",
                "required": ["query"],
                "properties": {
                    "query": {"type": "string", "description": "What to look for."},
                    "n": {"type": "integer", "minimum": 0, "default": 10},
                    "flags": {"type": "array", "items": {}},
                },
            },
        },
    }
    for name in TOOL_NAMES
]


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(SENTENCES) for _ in range(rng.randint(lo, hi)))


def _tool_calls(rng: random.Random, k: int) -> list[dict[str, Any]]:
    calls = []
    for i in range(k):
        name = rng.choice(TOOL_NAMES)
        args = {"query": _text(rng, 1, 2), "n": rng.randint(0, 99), "flags": [True, None, 1.5]}
        calls.append(
            {
                "id": f"functions.{name}:{i}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=rng.random() < 0.5)},
            }
        )
    return calls


def build_clean_table(tok: Any, pids: Any, n: int, seed: int = 0) -> pa.Table:
    """`n` valid rows: two datasets (B1 without tools, B2 with tools), thinking on/off, tool calls, CJK/emoji,
    literal special strings, returned and reconstructed ids, mixed providers; usage mostly exact, some null.
    Reconstructed rows carry `output_text_hash` from the reconstruction; returned rows carry null. Prompts are
    rendered through the tokenizer's chat template (with tool declarations in B2); the provider's prompt count
    agrees, or is null."""
    rng = random.Random(seed)
    prompt_rng = random.Random(seed + 1)  # separate, so the outputs stay what they were before prompts were added
    rows: dict[str, list[Any]] = {name: [] for name in TOKEN_SAMPLES_SCHEMA.names}
    for i in range(n):
        tools_ds = i % 2 == 1
        thinking = rng.random() < 0.85
        calls = _tool_calls(rng, rng.choice([1, 1, 2, 3])) if tools_ds and rng.random() < 0.5 else None
        reasoning = _text(rng, 1, 8) if thinking else None
        content = "" if calls and rng.random() < 0.5 else _text(rng, 1, 6)
        rec = reconstruct_output(tok, pids, reasoning=reasoning, content=content, tool_calls=calls, thinking=thinking)
        usage: int | None = len(rec.ids)
        u = rng.random()
        if u < 0.1:
            usage = None
        elif u < 0.2:
            usage += rng.choice([-1, 1])  # providers sometimes count one token differently: within tolerance
        backend = rng.choice(["openrouter", "vllm"])
        rows["sample_id"].append(f"{'B2' if tools_ds else 'B1'}-{i:05d}")
        rows["dataset"].append("B2" if tools_ds else "B1")
        rows["source"].append(backend)
        rows["backend"].append(backend)
        rows["provider"].append(rng.choice(["Moonshot", "Together", None]) if backend == "openrouter" else None)
        messages = [{"role": "user", "content": _text(prompt_rng, 1, 3)}]
        prompt = render_prompt_ids(tok, messages, TOOLS if tools_ds else None, thinking=thinking)
        rows["prompt_ids"].append(prompt)
        rows["usage_prompt_tokens"].append(None if prompt_rng.random() < 0.1 else len(prompt))
        rows["output_ids"].append(rec.ids)
        origin = "returned" if backend == "vllm" and rng.random() < 0.5 else "reconstructed"
        rows["ids_origin"].append(origin)
        # As reconstruct_table does: reconstructed rows carry the digest of their source text, returned rows none.
        rows["output_text_hash"].append(rec.text_hash if origin == "reconstructed" else None)
        rows["finish_reason"].append("tool_calls" if calls else "stop")
        rows["usage_completion_tokens"].append(usage)
        rows["thinking"].append(thinking)
        rows["dataset_has_tools"].append(tools_ds)
        rows["n_tool_calls"].append(rec.n_tool_calls)
        rows["literal_special"].append(rec.literal_special)
        rows["prompt_key"].append(f"k{i}")
    return pa.table(rows, schema=TOKEN_SAMPLES_SCHEMA)


def mutate(
    table: pa.Table, rows: list[int], fn: Callable[[list[int], int], list[int]], **columns: Callable[[Any, int], Any]
) -> pa.Table:
    """A copy of `table` with output_ids of `rows` replaced by fn(ids, row) and other columns by columns[name](value, row)."""
    chosen = set(rows)
    data = table.to_pydict()
    data["output_ids"] = [fn(list(ids), r) if r in chosen else ids for r, ids in enumerate(data["output_ids"])]
    for name, f in columns.items():
        data[name] = [f(v, r) if r in chosen else v for r, v in enumerate(data[name])]
    return pa.table(data, schema=table.schema)
