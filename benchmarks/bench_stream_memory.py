"""Memory and CPU of assembling long streamed answers: decoding in batches vs once at the end (prints figures).

    .venv/bin/python benchmarks/bench_stream_memory.py            # 50 in flight x ~10 MB streams
    .venv/bin/python benchmarks/bench_stream_memory.py --quick    # 20 in flight x ~5 MB

Each mode runs in its own process (peak RSS is a high-water mark): `in_flight` `ChatStreamAssembler`s are fed one
precomputed OpenRouter-format stream (a long reasoning answer: ~300 bytes of JSON per delta, a keep-alive every 200
chunks) in 16 KiB network reads, round-robin, as concurrent streams arrive; each body is then assembled and written
back as JSON, as the pipeline stores it. "one batch" is `batch_bytes=inf` (every byte kept, decoded at the end: the
assembler before batching); "batched" is the default. It prints the peak RSS above the process's baseline (the
shared stream bytes excluded), client CPU per response, and the same for the short ~31 KB answer of
`bench_generation.py` (which never reaches a batch) to show the short-body cost unchanged.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

READ = 16 * 1024


def _long_stream(mb: float) -> bytes:
    env = (
        b'data: {"id":"gen-1767225600-aBcDeFgHiJkLmNoPqRsT","provider":"Moonshot AI","model":"moonshotai/kimi-k2.5",'
        b'"object":"chat.completion.chunk","created":1767225600,"choices":[{"index":0,"delta":'
    )
    tail = b',"finish_reason":null,"native_finish_reason":null,"logprobs":null}]}\n\n'
    out, size, i = [b": OPENROUTER PROCESSING\n\n"], 0, 0
    while size < mb * 1e6:
        text = json.dumps(f" step {i} of the reasoning").encode()
        event = (
            env + b'{"role":"assistant","content":"","reasoning":' + text + b',"reasoning_details":[{"type":'
            b'"reasoning.text","text":' + text + b',"format":"unknown","index":0}]}' + tail
        )
        out.append(event)
        if i % 200 == 199:
            out.append(b": OPENROUTER PROCESSING\n\n")
        size += len(event)
        i += 1
    out.append(env + b'{"role":"assistant","content":"Done."},"finish_reason":"stop"}]}\n\n')
    out.append(
        env.split(b'"choices"')[0] + b'"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":%d}}\n\n' % i
    )
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


def _short_stream() -> bytes:
    from benchmarks.bench_generation import _body, _sse

    return _sse(_body())


def measure(mode: str, kind: str, in_flight: int, mb: float, rounds: int) -> dict:
    from eagle_pipeline.generation.backends.stream import BATCH_BYTES, ChatStreamAssembler

    raw = _long_stream(mb) if kind == "long" else _short_stream()
    batch = math.inf if mode == "one batch" else BATCH_BYTES
    reads = [(i, i + READ) for i in range(0, len(raw), READ)]
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cpu0 = time.process_time()
    done = 0
    for _ in range(rounds):
        streams = [ChatStreamAssembler(batch_bytes=batch) for _ in range(in_flight)]
        for a, b in reads:
            for s in streams:
                s.feed(raw[a:b])  # a fresh bytes object per read, as a network read
        for s in streams:
            s.body_json(s.body())
            done += 1
        del streams
    cpu = time.process_time() - cpu0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "stream_mb": len(raw) / 1e6,
        "cpu_ms_per_response": 1000 * cpu / done,
        "peak_rss_mib": (peak - base) / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    in_flight, mb = (20, 5.0) if args.quick else (50, 10.0)
    print(f"# stream assembly: python {sys.version.split()[0]}, {READ // 1024} KiB reads, round-robin over the streams")
    print(f"{'answer':<28} {'mode':<10} {'in flight':>9} {'stream MB':>9} {'cpu ms/resp':>11} {'peak RSS':>12}")
    for kind, flight, size, rounds in (("long", in_flight, mb, 1), ("short", 2000, 0, 3)):
        for mode in ("one batch", "batched"):
            cmd = [sys.executable, __file__, "--measure", mode, kind, str(flight), str(size), str(rounds)]
            r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
            label = "long reasoning" if kind == "long" else "short (bench_generation's)"
            print(
                f"{label:<28} {mode:<10} {flight:>9} {r['stream_mb']:>9.2f} {r['cpu_ms_per_response']:>11.3f} "
                f"{r['peak_rss_mib']:>8.0f} MiB",
                flush=True,
            )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":
        mode, kind, flight, size, rounds = sys.argv[2:7]
        print(json.dumps(measure(mode, kind, int(flight), float(size), int(rounds))))
    else:
        main()
