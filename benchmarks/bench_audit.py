"""Audit throughput on one core: every gate but round_trip over a large synthetic table, and the decoding gates
(round_trip, and text_agreement again) over real encoded text.

    EAGLE_KIMI_TOKENIZER_DIR=../shared/tokenizers/kimi-k2 .venv/bin/python benchmarks/bench_audit.py [--tokens 64e6]

Prints figures; it is not a test. Uses the real Kimi tokenizer when $EAGLE_KIMI_TOKENIZER_DIR is set, else the demo
tokenizer. The process pins itself to one CPU so tiktoken's batch threads cannot hide behind extra cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle_pipeline.audit import GATE_NAMES, run_audit
from eagle_pipeline.tokens import get_profile, resolve_tokenizer
from eagle_pipeline.tokens.text_hash import ids_text_hashes, text_hash_int64, token_hash_table

LOOPING_GATES = ("round_trip",)


def _pin_one_core() -> str:
    try:
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        return f"pinned to CPU {cpu}"
    except (AttributeError, OSError):
        return "could not pin to one CPU"


def _table(
    lengths: np.ndarray,
    values: np.ndarray,
    *,
    thinking: np.ndarray,
    has_tools: bool,
    n_calls: np.ndarray,
    digests: list[int | None] | None = None,
) -> pa.Table:
    n = lengths.size
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    out = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    finish = np.where(n_calls > 0, "tool_calls", "stop").astype(object)
    return pa.table(
        {
            "sample_id": pa.array([f"bench-{i}" for i in range(n)]),
            "dataset": pa.array(["B1"] * n),
            "source": pa.array(["simulated"] * n),
            "backend": pa.array(np.where(np.arange(n) % 2, "vllm", "openrouter").tolist()),
            "provider": pa.array(np.where(np.arange(n) % 3, "p1", "p2").tolist()),
            # 64-token prompts, counted alike by the provider (prompt_agreement reads only their lengths).
            "prompt_ids": pa.ListArray.from_arrays(
                pa.array(np.arange(n + 1, dtype=np.int32) * 64), pa.array(np.ones(n * 64, dtype=np.int32))
            ),
            "output_ids": out,
            "ids_origin": pa.array(["reconstructed"] * n),
            "finish_reason": pa.array(finish.tolist()),
            "usage_completion_tokens": pa.array(lengths.astype(np.int64)),
            "usage_prompt_tokens": pa.array(np.full(n, 64, dtype=np.int64)),
            "thinking": pa.array(thinking),
            "dataset_has_tools": pa.array([has_tools] * n),
            "n_tool_calls": pa.array(n_calls.astype(np.int32)),
            "literal_special": pa.array([False] * n),
            "prompt_key": pa.array(["k"] * n),
            "output_text_hash": pa.array(digests if digests is not None else [None] * n, pa.int64()),
        }
    )


def synthetic_vectorised(tok, ids, total_tokens: int, seed: int = 0) -> pa.Table:
    """Valid structure built in numpy: random ordinary ids, </think>, content, a tool section on 5% of rows, eot;
    text hashes for every row."""
    rng = np.random.default_rng(seed)
    n_ordinary = min(tok.special_tokens.values())
    mean = 2048
    n = max(int(total_tokens // mean), 1)
    lengths = rng.integers(256, 2 * mean - 256, n)
    tool_tail = np.array(
        [ids.tool_section_begin_id, ids.tool_call_begin_id]
        + tok.encode_ordinary("functions.search:0")
        + [ids.tool_arg_begin_id]
        + tok.encode_ordinary('{"query": "weather in Paris"}')
        + [ids.tool_call_end_id, ids.tool_section_end_id, ids.eot_id],
        dtype=np.int32,
    )
    n_calls = (rng.random(n) < 0.05).astype(np.int64)
    thinking = rng.random(n) < 0.9
    values = rng.integers(0, n_ordinary, int(lengths.sum()), dtype=np.int32)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    values[ends - 1] = ids.eot_id
    close_at = starts + rng.integers(1, lengths // 2)
    values[close_at[thinking]] = ids.think_close_id
    for r in np.flatnonzero(n_calls):  # ~5% of rows; a Python loop over rows is fine for building
        values[ends[r] - tool_tail.size : ends[r]] = tool_tail
    # Random ids have no source text: their hashes come from the ids, so text_agreement does its full work here
    # (whether it is right is tested in eagle_pipeline_tests, against hashes of decoded text).
    offsets = np.concatenate([[0], ends])
    digests = ids_text_hashes(values, offsets, token_hash_table(tok)).view(np.int64).tolist()
    return _table(lengths, values, thinking=thinking, has_tools=True, n_calls=n_calls, digests=digests)


def synthetic_text(tok, ids, total_tokens: int, seed: int = 1) -> pa.Table:
    """Realistic canonical rows (real encoded text, with its text digest) for the round-trip and text gates."""
    rng = np.random.default_rng(seed)
    words = [
        "the",
        "model",
        "reasons",
        "about",
        "tokens",
        "and",
        "bytes",
        "while",
        "the",
        "drafter",
        "learns",
        "to",
        "predict",
        "the",
        "next",
        "step",
        "quickly",
        "数据",
        "模型",
        "推理",
        "速度",
        "🙂",
        "café",
        "naïve",
        "ünïcode",
        "12345",
        "(x+y)^2",
        "=",
        "x^2",
        "+",
        "2xy",
        "+",
        "y^2;",
        "print('hello,",
        "world')",
    ]
    lengths, parts, thinking, digests = [], [], [], []
    total = 0
    while total < total_tokens:
        reasoning = " ".join(rng.choice(words, rng.integers(50, 400)))
        content = " ".join(rng.choice(words, rng.integers(20, 200)))
        row = tok.encode_ordinary(reasoning) + [ids.think_close_id] + tok.encode_ordinary(content) + [ids.eot_id]
        parts.append(np.asarray(row, dtype=np.int32))
        lengths.append(len(row))
        thinking.append(True)
        digests.append(text_hash_int64(f"{reasoning}</think>{content}<|im_end|>"))
        total += len(row)
    n = len(lengths)
    return _table(
        np.asarray(lengths),
        np.concatenate(parts),
        thinking=np.asarray(thinking),
        has_tools=True,
        n_calls=np.zeros(n, np.int64),
        digests=digests,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=64e6, help="tokens in the vectorised-gate table")
    parser.add_argument("--round-trip-tokens", type=float, default=2e6, help="tokens in the round-trip / text table")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(_pin_one_core())
    tok = resolve_tokenizer(os.environ.get("EAGLE_KIMI_TOKENIZER_DIR") or None)
    ids = get_profile("kimi-k2.5").resolve(tok)
    print(f"tokenizer: {tok.name} ({tok.kind}), vocab {tok.vocab_size}")

    t0 = time.perf_counter()
    table = synthetic_vectorised(tok, ids, int(args.tokens))
    n_tok = int(pa.compute.list_value_length(table["output_ids"]).to_numpy().sum())
    print(f"built {table.num_rows:,} rows / {n_tok:,} tokens in {time.perf_counter() - t0:.1f}s")

    vector_gates = [g for g in GATE_NAMES if g not in LOOPING_GATES]
    best = float("inf")
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        report = run_audit(table, tok, ids, gates=vector_gates)
        best = min(best, time.perf_counter() - t0)
    per_token = {"vectorised": best / n_tok}
    bad = {r.name: r.failing for r in report.results if r.failing}
    print(
        f"vectorised gates ({len(vector_gates)}, all together): {best:.3f}s -> {n_tok / best / 1e6:,.0f}M tokens/s"
        f"  (failures on valid data: {bad or 'none'})"
    )
    for gate in vector_gates:
        t0 = time.perf_counter()
        run_audit(table, tok, ids, gates=[gate])
        dt = time.perf_counter() - t0
        print(f"  {gate:<26} alone (incl. shared scan): {dt:.3f}s -> {n_tok / dt / 1e6:,.0f}M tokens/s")
    del table

    t0 = time.perf_counter()
    text_table = synthetic_text(tok, ids, int(args.round_trip_tokens))
    n_rt = int(pa.compute.list_value_length(text_table["output_ids"]).to_numpy().sum())
    print(f"built round-trip table: {text_table.num_rows:,} rows / {n_rt:,} tokens in {time.perf_counter() - t0:.1f}s")
    tok.fingerprint()  # computed once per tokenizer (for the report); not part of a gate's cost
    best_rt = float("inf")
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        report = run_audit(text_table, tok, ids, gates=["round_trip"])
        best_rt = min(best_rt, time.perf_counter() - t0)
    per_token["round_trip"] = best_rt / n_rt
    print(
        f"round_trip: {best_rt:.2f}s -> {n_rt / best_rt / 1e6:,.2f}M tokens/s "
        f"(failing: {report.result('round_trip').failing})"
    )
    best = float("inf")
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        report = run_audit(text_table, tok, ids, gates=["text_agreement"])
        best = min(best, time.perf_counter() - t0)
    res = report.result("text_agreement")
    per_token["text_agreement"] = best / n_rt
    print(
        f"text_agreement: {best:.2f}s -> {n_rt / best / 1e6:,.2f}M tokens/s "
        f"(checked {res.checked}, failing {res.failing})"
    )
    # The bound: re-encoding is inherent to the gate, so it cannot beat the tokenizer's own encode speed.
    texts = [tok.decode(ids_) for ids_ in text_table.column("output_ids").to_pylist()]
    raw = float("inf")
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        tok.encode_ordinary_batch(texts)
        raw = min(raw, time.perf_counter() - t0)
    print(
        f"  reference: {tok.kind} encode_ordinary_batch alone on the same text: {n_rt / raw / 1e6:,.2f}M tokens/s;"
        f" round_trip runs at {raw / best_rt:.2f}x of it (an exact re-encode cannot beat the encoder)"
    )

    # The headline: seconds per token add up across the gates of one audit.
    target = 100e6
    print("summary, one core (target >= 100M tokens/s):")
    for label, parts in (
        (f"every gate but round_trip ({len(vector_gates)})", ["vectorised"]),
        ("every gate (whole audit)", ["vectorised", "round_trip"]),
    ):
        rate = 1 / sum(per_token[p] for p in parts)
        print(f"  {label:<28} {rate / 1e6:>10,.2f}M tokens/s  {'meets' if rate >= target else 'MISSES'} the target")


if __name__ == "__main__":
    main()
