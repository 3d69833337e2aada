"""The cost of the answer log (prints figures; not a test).

    .venv/bin/python benchmarks/bench_answer_log.py            # 2 runs with the log, 2 without, interleaved
    .venv/bin/python benchmarks/bench_answer_log.py --quick    # 1 + 1

One client process runs `generate_dataset` against bench_generation.py's fixed-latency loopback server (its own
process) at 2,000 in flight, alternately with the answer log (the default: every row written and fsynced within
0.05 s) and without it (`answer_log_s=None`), so both see the same machine. Per run it prints steady responses/s
(Little's law, as bench_generation.py), client CPU per response, and the log's fsyncs per second; then the
in-process cost of one `AnswerLog.append` (encode, crc32, buffer) for a ~4 KB row.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_generation as bg  # noqa: E402  (the server, the prompts' shape and Little's law)

from eagle_pipeline.generation.store import answer_log  # noqa: E402


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def one_run(url: str, in_flight: int, n: int, latency: float, with_log: bool) -> dict:
    from eagle_pipeline.generation.run.options import RunOptions
    from eagle_pipeline.generation.run.runner import generate_dataset
    from eagle_pipeline.generation.spec import BackendSpec, SamplingSpec
    from eagle_pipeline.generation.store.shards import read_responses

    prompts = bg.bench_prompts(n)
    backend = BackendSpec(
        name="bench", kind="openrouter", endpoint=url, model="m", concurrency=in_flight, timeout_s=120, stream=False
    )
    fsyncs = {"n": 0}
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:  # counts the log's and the shards' fsyncs alike
        fsyncs["n"] += 1
        real_fsync(fd)

    os.fsync = counting_fsync
    try:
        with tempfile.TemporaryDirectory(dir=ROOT) as d:
            cpu0, t0 = _cpu(), time.monotonic()
            s = generate_dataset(
                dataset="B1",
                prompts=prompts,
                backend=backend,
                sampling=SamplingSpec(seed=1, max_tokens=4096),
                out_dir=Path(d) / "r",
                errors_dir=Path(d) / "r" / "errors",
                options=RunOptions(
                    progress_every_s=3600, answer_log_s=answer_log.DEFAULT_FLUSH_S if with_log else None
                ),
            )
            wall, cpu = time.monotonic() - t0, _cpu() - cpu0
            steady = bg.steady_of_responses(read_responses(Path(d) / "r"), in_flight, latency)
    finally:
        os.fsync = real_fsync
    return {
        "completed": s.completed,
        "steady_per_s": steady["steady_per_s"],
        "cpu_ms_per_response": 1000 * cpu / max(1, s.completed),
        "fsyncs_per_s": fsyncs["n"] / wall,
        "wall_s": wall,
    }


def append_cost_us(rows: int = 20000) -> float:
    """Microseconds per `AnswerLog.append` of a ~4 KB responses row (the event loop's share of the log)."""
    row = {
        "sample_id": "B1-0123456789abcdef0123",
        "raw_response_json": "x" * 2500,
        "reasoning": "r" * 1000,
        "content": "c" * 1000,
        "cost_usd": 0.0015,
        "latency_s": 2.0001,
        "started_at": 1_767_225_600_000_000,
        **{f"col{i}": "value" for i in range(24)},
    }
    with tempfile.TemporaryDirectory(dir=ROOT) as d:
        log = answer_log.AnswerLog(d)
        t0 = time.perf_counter()
        for _ in range(rows):
            log.append(answer_log.RESPONSE_ROW, row)
        dt = time.perf_counter() - t0
        log.close()
    return 1e6 * dt / rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    in_flight, latency, n = 2000, 2.0, 8000
    order = [True, False] if args.quick else [True, False, False, True]
    with bg.loopback_server(latency) as (url, _):
        print(f"# answer log cost: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, {in_flight} in flight, ")
        print(f"# {latency:.0f} s latency, N = {n} per run, one client process")
        print(f"{'answer log':<12} {'done':>6} {'steady/s':>9} {'cpu ms/resp':>11} {'fsyncs/s':>9} {'wall s':>7}")
        for with_log in order:
            r = one_run(url, in_flight, n, latency, with_log)
            print(
                f"{'on' if with_log else 'off':<12} {r['completed']:>6} {r['steady_per_s']:>9.0f} "
                f"{r['cpu_ms_per_response']:>11.3f} {r['fsyncs_per_s']:>9.1f} {r['wall_s']:>7.1f}",
                flush=True,
            )
    print(
        f"AnswerLog.append of a ~4 KB row, 20,000 in a tight loop (its thread writing them): {append_cost_us():.1f} us"
    )


if __name__ == "__main__":
    main()
