"""Generation client throughput at thousands of requests in flight (prints figures; not a test).

    .venv/bin/python benchmarks/bench_generation.py            # the full set (~2-3 minutes on 2 cores)
    .venv/bin/python benchmarks/bench_generation.py --quick    # a smaller set (~1 minute)
    .venv/bin/python benchmarks/bench_generation.py --quick --only-stream   # streaming next to non-streaming only

Every scenario runs a fixed-latency loopback server in one process and the client in another, so the client's
CPU time and peak RSS are its own. The server is a raw asyncio HTTP/1.1 server answering every request with one
precomputed OpenRouter-format body (~2 KB of reasoning + content, ~4 KB of JSON), cheap enough not to be the
bottleneck (its CPU time is printed). A request with `"stream":true` gets the same answer as server-sent events
(93 chunks of 24 characters, ~31 KB with the per-chunk envelope; compact JSON, as OpenRouter and vLLM write it):
the headers and a keep-alive comment at once, then the chunks in ten bursts over the second
half of the latency, so the client reads and parses them as they arrive.

Clients:
  pipeline  eagle_pipeline.generation.generate_dataset (aiohttp, parsing, rows, Parquet commits): the real thing,
            non-streaming (`stream: false`) and streaming (`stream: true`) in the same run; streaming as configured
            by default (`stream_processes` unset: one worker process per 500 in flight, at most one per CPU) and
            with `--stream-processes` workers (default 0: in the run's own event loop). CPU counts every process of
            the client; peak RSS is the client's plus, per worker, the largest worker's peak
  aiohttp   a bare aiohttp ClientSession loop (one session, connector sized to the in-flight count)
  httpx     a bare httpx.AsyncClient loop (one pool sized to the in-flight count)

Steady throughput is Little's law over the requests that started after the connection ramp (two latencies) and
ended before the drain (the pipeline's 90th-percentile completion; the end of the bare clients' time box):
in_flight x success share / mean request time (client-side, send to parsed). A count of completions over a window
would be biased by the waves a fixed latency creates. httpx, which never gets near that regime, is measured by the
count of completions in the window. Share of ideal = throughput / (in_flight / latency); the
"overall" column is completions / wall time, ramp and drain included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _body() -> bytes:
    reasoning = (
        "The user asks for a careful explanation; let me reason about each step and check the edge cases. " * 12
    ).strip()
    content = ("Here is the answer, with a short example and the caveat that matters in practice. " * 12).strip()
    obj = {
        "id": "gen-1767225600-aBcDeFgHiJkLmNoPqRsT",
        "provider": "Bench",
        "model": "moonshotai/kimi-k2.5",
        "object": "chat.completion",
        "created": 1767225600,
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "logprobs": None,
                "finish_reason": "stop",
                "native_finish_reason": "stop",
                "message": {
                    "role": "assistant",
                    "content": content,
                    "refusal": None,
                    "reasoning": reasoning,
                    "reasoning_details": [
                        {"type": "reasoning.text", "text": reasoning, "format": "unknown", "index": 0}
                    ],
                },
            }
        ],
        "usage": {
            "prompt_tokens": 120,
            "completion_tokens": 560,
            "total_tokens": 680,
            "completion_tokens_details": {"reasoning_tokens": 300},
            "cost": 0.0015,
        },
    }
    return obj


def _compact(obj: dict) -> bytes:
    """JSON without spaces, as OpenRouter and vLLM write their bodies and stream chunks."""
    return json.dumps(obj, separators=(",", ":")).encode()


def _sse(obj: dict) -> bytes:
    from eagle_pipeline.simulation.streaming import KEEPALIVE, completion_chunks

    events = b"".join(b"data: " + _compact(c) + b"\n\n" for c in completion_chunks(obj, chunk_chars=24))
    return KEEPALIVE + events + b"data: [DONE]\n\n"


# ---- server ----------------------------------------------------------------------------------------------


def serve(latency: float, port_file: str) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    obj = _body()
    body = _compact(obj)
    response = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    sse = _sse(obj)
    sse_head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" % len(sse)
    from eagle_pipeline.simulation.streaming import KEEPALIVE

    first = len(KEEPALIVE)
    cuts = [first + (len(sse) - first) * k // 10 for k in range(11)]
    bursts = [sse[a:b] for a, b in zip(cuts, cuts[1:])]

    class Proto(asyncio.Protocol):
        def connection_made(self, transport):  # type: ignore[override]
            self.t = transport
            self.buf = bytearray()

        def data_received(self, data: bytes) -> None:
            self.buf += data
            while True:
                i = self.buf.find(b"\r\n\r\n")
                if i < 0:
                    return
                head = bytes(self.buf[:i]).lower()
                j = head.find(b"content-length:")
                n = int(head[j + 15 : head.find(b"\r\n", j) if head.find(b"\r\n", j) > 0 else None]) if j >= 0 else 0
                if len(self.buf) < i + 4 + n:
                    return
                streamed = b'"stream":true' in self.buf[i + 4 : i + 4 + n]
                del self.buf[: i + 4 + n]
                if not streamed:
                    loop.call_later(latency, self._respond, response)
                    continue
                self._respond(sse_head + sse[:first])
                for k, burst in enumerate(bursts, 1):
                    loop.call_later(latency * (0.5 + 0.05 * k), self._respond, burst)

        def _respond(self, data: bytes) -> None:
            if not self.t.is_closing():
                self.t.write(data)

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(loop.create_server(Proto, "127.0.0.1", 0, backlog=8192))
    Path(port_file).write_text(str(server.sockets[0].getsockname()[1]))
    loop.run_forever()


# ---- clients ---------------------------------------------------------------------------------------------


def _steady(spans: list[tuple[float, float, bool]], in_flight: int, latency: float, t_from: float, t_to: float) -> dict:
    """Steady throughput by Little's law over the requests that started after `t_from` and ended before `t_to`.

    Every worker loops back-to-back, so completions/s = in_flight * success share / mean request time. A fixed
    latency makes completions arrive in waves, which biases a count over an arbitrary window; this does not.
    """
    sel = [(e - s, ok) for s, e, ok in spans if s >= t_from and e <= t_to]
    if not sel:
        return {"steady_per_s": 0.0, "share_of_ideal": 0.0, "mean_request_s": None}
    mean = sum(d for d, _ in sel) / len(sel)
    ok_share = sum(1 for _, ok in sel if ok) / len(sel)
    steady = in_flight * ok_share / mean
    return {"steady_per_s": steady, "share_of_ideal": steady / (in_flight / latency), "mean_request_s": mean}


def _usage() -> tuple[float, int]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime, ru.ru_maxrss * 1024


def _children_usage() -> tuple[float, int]:
    """CPU seconds of this process's exited children (the stream worker processes) and the largest one's peak RSS."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime, ru.ru_maxrss * 1024


def bench_prompts(n: int):
    """`n` single-turn prompts of ~400 characters (the `prompts` table `generate_dataset` takes)."""
    import pyarrow as pa

    from eagle_pipeline.prompts import canonical_json

    text = "Explain, with one worked example, how the following idea applies in practice: " + "context " * 40
    return pa.table(
        {
            "sample_id": [f"B1-{i:08d}" for i in range(n)],
            "dataset": ["B1"] * n,
            "source_id": [str(i) for i in range(n)],
            "messages_json": [canonical_json([{"role": "user", "content": f"{text} #{i}"}]) for i in range(n)],
            "tools_json": pa.nulls(n, pa.string()),
        }
    )


def steady_of_responses(table, in_flight: int, latency: float) -> dict:
    """Steady throughput (`_steady`) of a `responses` table, from two latencies after the first request (connection
    ramp) to the 90th-percentile completion (before the drain)."""
    starts = [x.timestamp() for x in table.column("started_at").to_pylist()]
    ends = [x.timestamp() for x in table.column("finished_at").to_pylist()]
    spans = [(a, b, True) for a, b in zip(starts, ends)]
    ordered = sorted(ends)
    return _steady(spans, in_flight, latency, min(starts) + 2 * latency, ordered[int(len(ordered) * 0.9)])


def client_pipeline(
    url: str, in_flight: int, n: int, latency: float, stream: bool = False, stream_processes: int | None = None
) -> dict:
    from eagle_pipeline.generation.run.options import RunOptions
    from eagle_pipeline.generation.run.runner import generate_dataset
    from eagle_pipeline.generation.spec import BackendSpec, SamplingSpec
    from eagle_pipeline.generation.store.shards import read_responses

    sampling = SamplingSpec(seed=1, max_tokens=4096)
    prompts = bench_prompts(n)
    backend = BackendSpec(
        name="bench",
        kind="openrouter",
        endpoint=url,
        model="moonshotai/kimi-k2.5",
        concurrency=in_flight,
        timeout_s=120,
        stream=stream,
        stream_processes=stream_processes,
    )
    workers = backend.stream_processes_for(in_flight)
    with tempfile.TemporaryDirectory() as d:
        cpu0, _ = _usage()
        child0, _ = _children_usage()
        t0 = time.monotonic()
        s = generate_dataset(
            dataset="B1",
            prompts=prompts,
            backend=backend,
            sampling=sampling,
            out_dir=Path(d) / "r",
            errors_dir=Path(d) / "r" / "errors",
            options=RunOptions(progress_every_s=3600),
        )
        wall = time.monotonic() - t0
        cpu1, rss = _usage()
        child1, child_rss = _children_usage()
        # Every process's CPU; RSS: this process's peak plus each worker's at most the largest worker's peak.
        parent_cpu = cpu1 - cpu0
        cpu1 += child1 - child0
        rss += workers * child_rss
        t = read_responses(Path(d) / "r")
        chunks = t.column("stream_chunks").to_pylist()
        steady = steady_of_responses(t, in_flight, latency)
    return {
        "completed": s.completed,
        "failed": s.failed,
        "wall_s": wall,
        "cpu_ms_per_response": 1000 * (cpu1 - cpu0) / max(1, s.completed),
        "peak_rss_mib": rss / 2**20,
        "mean_stream_chunks": sum(c or 0 for c in chunks) / max(1, len(chunks)),
        "stream_processes": workers,
        "parent_cpu_ms_per_response": 1000 * parent_cpu / max(1, s.completed),
        **steady,
    }


async def _bare(
    kind: str, url: str, in_flight: int, duration: float
) -> tuple[list[tuple[float, float, bool]], int, float]:
    """Requests for `duration` seconds, then everything still in flight is cancelled (a stalled pool cannot stretch the run)."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 300}], "max_tokens": 4096}).encode()
    headers = {"Content-Type": "application/json"}
    spans: list[tuple[float, float, bool]] = []
    failures = 0
    if kind == "aiohttp":
        import aiohttp

        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=in_flight), timeout=aiohttp.ClientTimeout(total=60)
        )

        async def one() -> None:
            async with session.post(url, data=body, headers=headers) as r:
                json.loads(await r.read())
    else:
        import httpx

        session = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight), timeout=60
        )

        async def one() -> None:
            r = await session.post(url, content=body, headers=headers)
            json.loads(r.content)

    async def worker() -> None:
        nonlocal failures
        while True:
            t = time.time()
            try:
                await one()
                spans.append((t, time.time(), True))
            except asyncio.CancelledError:
                raise
            except Exception:
                failures += 1
                spans.append((t, time.time(), False))

    t0 = time.time()
    tasks = [asyncio.create_task(worker()) for _ in range(in_flight)]
    await asyncio.sleep(duration)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if kind == "aiohttp":
        await session.close()
    else:
        await session.aclose()
    return spans, failures, t0


def client_bare(kind: str, url: str, in_flight: int, n: int, latency: float, duration: float) -> dict:
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    cpu0, _ = _usage()
    with asyncio.Runner(loop_factory=loop_factory) as r:
        spans, failures, t0 = r.run(_bare(kind, url, in_flight, duration))
    cpu1, rss = _usage()
    done = sum(1 for _, _, ok in spans if ok)
    a, b = t0 + 2 * latency, t0 + duration
    if kind == "aiohttp":
        steady = _steady(spans, in_flight, latency, a, b)
    else:
        # httpx never reaches the wave regime (requests take many latencies): count completions in the window.
        rate = sum(1 for _, e, ok in spans if ok and a <= e <= b) / (b - a)
        steady = {"steady_per_s": rate, "share_of_ideal": rate / (in_flight / latency), "mean_request_s": None}
    return {
        "completed": done,
        "failed": failures,
        "wall_s": duration,
        "cpu_ms_per_response": 1000 * (cpu1 - cpu0) / max(1, done),
        "peak_rss_mib": rss / 2**20,
        **steady,
    }


# ---- orchestration ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def loopback_server(latency: float) -> Iterator[tuple[str, int]]:
    """The fixed-latency server (`serve`) in its own process: yields its base URL (`.../api/v1`) and its pid."""
    with tempfile.TemporaryDirectory() as d:
        port_file = os.path.join(d, "port")
        server = subprocess.Popen([sys.executable, __file__, "--serve", str(latency), port_file])
        try:
            for _ in range(200):
                if os.path.exists(port_file) and Path(port_file).read_text():
                    break
                time.sleep(0.05)
            yield f"http://127.0.0.1:{Path(port_file).read_text()}/api/v1", server.pid
        finally:
            server.kill()
            server.wait()


def scenario(
    client: str, in_flight: int, latency: float, n: int, duration: float = 600.0, env: dict | None = None
) -> dict:
    with loopback_server(latency) as (base, server_pid):
        url = base if client.startswith("pipeline") else base + "/chat/completions"
        cmd = [
            sys.executable,
            __file__,
            "--client",
            client,
            url,
            str(in_flight),
            str(n),
            str(latency),
            str(duration),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=900)
        if out.returncode != 0:
            return {"error": out.stderr[-2000:]}
        server_cpu = _proc_cpu(server_pid)
        res = json.loads(out.stdout.strip().splitlines()[-1])
        res["server_cpu_s"] = server_cpu
        return res


def _proc_cpu(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only-stream", action="store_true", help="only the non-streaming and streaming pipeline rows")
    ap.add_argument(
        "--stream-processes", type=int, default=0, help="worker processes of the second streaming row (0: one loop)"
    )
    args = ap.parse_args()
    procs = str(args.stream_processes)
    q = args.quick
    runs = [
        ("pipeline", 2000, 2.0, 8000 if q else 20000, 600.0, None, "pipeline (uvloop)"),
        ("pipeline-stream", 2000, 2.0, 8000 if q else 20000, 600.0, None, "streaming (default)"),
        ("pipeline-stream:" + procs, 2000, 2.0, 8000 if q else 20000, 600.0, None, "streaming"),
        ("pipeline", 2000, 5.0, 6000 if q else 10000, 600.0, None, "pipeline (uvloop)"),
        ("pipeline", 2000, 2.0, 8000 if q else 20000, 600.0, {"EAGLE_NO_UVLOOP": "1"}, "pipeline (asyncio loop)"),
        ("aiohttp", 2000, 2.0, 0, 10.0 if q else 16.0, None, "bare aiohttp"),
        ("httpx", 256, 2.0, 0, 10.0 if q else 14.0, None, "bare httpx"),
        ("httpx", 2000, 2.0, 0, 10.0 if q else 14.0, None, "bare httpx"),
    ]
    cores = os.cpu_count()
    print(
        f"# generation client benchmark: {cores} cores, python {sys.version.split()[0]}, loopback server in a separate process"
    )
    header = (
        f"{'client':<30} {'in flight':>9} {'latency':>7} {'done':>7} {'fail':>5} {'steady/s':>9} {'ideal/s':>8} {'share':>6} "
        f"{'overall/s':>9} {'cpu ms/resp':>11} {'peak RSS':>9} {'wall s':>7} {'srv cpu s':>9}"
    )
    print(header)
    if args.only_stream:
        runs = runs[:3]  # non-streaming, streaming by default, streaming with --stream-processes workers
    steady: dict[str, float] = {}
    for client, inflight, latency, n, duration, env, label in runs:
        r = scenario(client, inflight, latency, n, duration, env)
        if client.startswith("pipeline-stream"):
            n_procs = r.get("stream_processes", 0)
            label = f"{label}, {n_procs} workers" if n_procs else f"{label}, one loop"
        if "error" in r:
            print(
                f"{label:<30} {inflight:>9} {latency:>6.0f}s  ERROR: {r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'}"
            )
            continue
        print(
            f"{label:<30} {inflight:>9} {latency:>6.0f}s {r['completed']:>7} {r['failed']:>5} {r['steady_per_s']:>9.0f} {inflight / latency:>8.0f} "
            f"{100 * r['share_of_ideal']:>5.0f}% {r['completed'] / r['wall_s']:>9.0f} {r['cpu_ms_per_response']:>11.2f} {r['peak_rss_mib']:>6.0f} MiB {r['wall_s']:>7.1f} "
            f"{(r['server_cpu_s'] or 0):>9.1f}",
            flush=True,
        )
        if r.get("stream_processes"):
            print(f"#   of which the run's own process: {r['parent_cpu_ms_per_response']:.2f} ms/resp", flush=True)
        if client.startswith("pipeline") and latency == 2.0 and not env:
            steady[label] = r["steady_per_s"]
    base = next(iter(steady.values()), 0.0)
    for label, rate in list(steady.items())[1:]:
        print(f"# {label} / non-streaming steady throughput: {rate / base if base else float('nan'):.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(float(sys.argv[2]), sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "--client":
        kind, url, inflight, n, latency, duration = (
            sys.argv[2],
            sys.argv[3],
            int(sys.argv[4]),
            int(sys.argv[5]),
            float(sys.argv[6]),
            float(sys.argv[7]),
        )
        if kind.startswith("pipeline"):
            kind, _, procs = kind.partition(":")  # pipeline-stream:N: N worker processes
            stream, n_procs = kind == "pipeline-stream", int(procs) if procs else None
            res = client_pipeline(url, inflight, n, latency, stream=stream, stream_processes=n_procs)
        else:
            res = client_bare(kind, url, inflight, n, latency, duration)
        print(json.dumps(res))
    else:
        main()
