"""The seed's run rehearsed on this machine, through the project's real Dagster jobs (prints figures; not a test).

    .venv/bin/python benchmarks/bench_seed_scale.py --scale 1.0    # the seed: 40K prompts, ~138M tokens (hours)
    .venv/bin/python benchmarks/bench_seed_scale.py --scale 0.01   # the smoke test `make test` runs (minutes)

What runs, each stage in its own process on one Dagster instance (SQLite under the work folder; PostgreSQL, on a
fresh database, when EAGLE_TEST_POSTGRES_URL is set):
  prompts      5,000 x scale synthetic prompts for each of B1..B8 (coding, reasoning, math, chat, SWE agent with
               tools, tool use with tools, multilingual, long context) in JSONL, ShareGPT and Parquet files
  datasets     `EAGLE_dataset` per dataset (prompts, generation, then reconstruction and the audit checks in one step) against the
               simulated OpenRouter server in its own process, streaming, answers of Kimi-like length
               (`simulation.AnswerLengths`: log-normal, mean ~3,460 tokens, cap 16K; ~5% finish `length`), tool calls
               where the prompt has tools, billed with the target tokenizer (the real Kimi one when
               EAGLE_KIMI_TOKENIZER_DIR is set)
  audit_view   `EAGLE_audit_view`
  merge        `EAGLE_merge` (merge, draft vocabulary, the extraction plan), run --merge-runs times
  shards       a small data root of its own, merged into >= 150 x scale shard partitions of 2 rows, then
               `EAGLE_hidden_states` per shard with the tiny model, each run timed

Per step (Dagster's step events, in the stage's process): wall, CPU seconds (the process and its exited children,
the stream workers), peak RSS (VmHWM, reset at each step's start through /proc/self/clear_refs), bytes written
(wchar). Per stage: the Dagster event-log rows and the database size after it. Baselines in the same run: a minimal
aiohttp streaming client on the same server and requests (CPU per million streamed tokens); the tokenizer's raw
`encode` of the same reasoning and content texts (tokens/s against reconstruction + audit); a plain pyarrow
read-concat-shuffle-write of the same token parts (against the `merged_dataset` step, alternating, best and median
of --merge-runs). `--json PATH` writes every figure; the pytest smoke test reads it.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import math
import os
import random
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATASETS = (  # name, domain, tools, file format: the seed's mix
    ("B1", "coding", False, "jsonl"),
    ("B2", "reasoning", False, "jsonl"),
    ("B3", "math", False, "parquet"),
    ("B4", "chat", False, "sharegpt"),
    ("B5", "swe_agent", True, "jsonl"),
    ("B6", "tool_use", True, "parquet"),
    ("B7", "chat", False, "sharegpt"),
    ("B8", "coding", False, "parquet"),
)
SEED_PROMPTS_PER_DATASET = 5000
SEED_SHARDS = 152
SHARD_ROWS = 2
LENGTH_SHARE = 0.047  # + the answers the 16K cap cuts (~0.3%): ~5% finish `length`
MAX_TOKENS = 16384
# AnswerLengths counts crude 4-byte tokens; Kimi's tokenizer takes ~5.2 bytes a token of this text (measured at scale
# 0.01: 2,666 Kimi tokens an answer for a crude mean of 3,460), so this mean gives ~3,460 Kimi tokens an answer.
CRUDE_MEAN_TOKENS = 4500.0
GIB = 1 << 30


# ---- synthetic prompts ------------------------------------------------------------------------------------------

_WORDS = tuple(
    [
        "parser",
        "cache",
        "matrix",
        "gradient",
        "tensor",
        "shard",
        "index",
        "queue",
        "socket",
        "lattice",
        "theorem",
        "integral",
        "proof",
        "vector",
        "kernel",
        "thread",
        "mutex",
        "schema",
        "column",
        "buffer",
        "stream",
        "packet",
        "router",
        "ledger",
        "invoice",
        "tariff",
        "glacier",
        "harbour",
        "orchard",
        "violin",
        "sonnet",
        "recipe",
        "garden",
        "canyon",
    ]
)
_ASK = {
    "coding": "Write a Python function that {a} the {b} of a {c}, with tests and a note on complexity.",
    "reasoning": "A {a} and a {b} are placed next to a {c}. Reason step by step about which must move first.",
    "math": "Prove that the {a} of every {b} is bounded, then compute it for the {c} case.",
    "chat": "I'm planning a trip around {a} and {b}. What should I know about the {c}?",
    "swe_agent": "The test for {a} fails after the {b} refactor. Find the bug in the {c} module and fix it.",
    "tool_use": "Look up the {a} for {b} and tell me whether the {c} changed this week.",
}
_MULTILINGUAL = ("Explique en français", "Erkläre auf Deutsch", "日本語で説明してください", "Explica en español")
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite, or one test file, and return the failures.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "verbose": {"type": "boolean"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a term up in the knowledge base.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["query"],
            },
        },
    },
]


def _prompt_text(name: str, domain: str, i: int) -> str:
    rng = random.Random(f"{name}:{i}")
    a, b, c = (rng.choice(_WORDS) for _ in range(3))
    text = _ASK[domain].format(a=a, b=b, c=c) + f" (case {name}-{i}, {rng.choice(_WORDS)} {rng.choice(_WORDS)})"
    if name == "B7":
        text = f"{rng.choice(_MULTILINGUAL)}: {text}"
    if name == "B8":  # long context: a ~6K-token module to review
        body = "\n".join(
            f"def f_{i}_{k}({rng.choice(_WORDS)}):\n    return {rng.choice(_WORDS)}_{k} + {k}" for k in range(400)
        )
        text = f"Review this module for bugs and suggest fixes.\n\n```python\n{body}\n```\n\n{text}"
    return text


def write_prompts(folder: Path, n: int) -> dict[str, Path]:
    """n prompts per dataset, each dataset in its format; returns dataset -> path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, domain, tools, fmt in DATASETS:
        rows = []
        for i in range(n):
            text = _prompt_text(name, domain, i)
            row: dict[str, Any] = {"id": f"{name.lower()}-{i:06d}", "messages": [{"role": "user", "content": text}]}
            if tools:
                row["tools"] = _TOOLS
            rows.append(row)
        if fmt == "jsonl":
            path = folder / f"{name}.jsonl"
            path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        elif fmt == "sharegpt":
            path = folder / f"{name}.sharegpt.jsonl"
            lines = [
                {"id": r["id"], "conversations": [{"from": "human", "value": r["messages"][0]["content"]}]}
                for r in rows
            ]
            path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in lines))
        else:
            path = folder / f"{name}.parquet"
            table = {"id": [r["id"] for r in rows], "messages": [json.dumps(r["messages"]) for r in rows]}
            if tools:
                table["tools"] = [json.dumps(_TOOLS)] * n
            pq.write_table(pa.table(table), path)
        paths[name] = path
    return paths


# ---- the Dagster instance and the configuration -----------------------------------------------------------------


class Instance:
    """The run's Dagster home: SQLite files under it, or a fresh PostgreSQL database when EAGLE_TEST_POSTGRES_URL is set."""

    def __init__(self, home: Path) -> None:
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        self.pg_url = os.environ.get("EAGLE_TEST_POSTGRES_URL")
        self.env = {"DAGSTER_HOME": str(home)}
        self.db = ""
        if not self.pg_url:
            shutil.copyfile(ROOT / "dagster.yaml", home / "dagster.yaml")
            self.kind = "sqlite"
            return
        import psycopg2

        self.db = f"eagle_bench_{uuid.uuid4().hex[:12]}"
        admin = psycopg2.connect(self.pg_url, connect_timeout=5)
        admin.autocommit = True
        with admin.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{self.db}"')
        admin.close()
        base = self.pg_url.rsplit("/", 1)[0]
        self.db_url = f"{base}/{self.db}"
        self.env["EAGLE_DAGSTER_PG_URL"] = self.db_url.replace("postgresql://", "postgresql+psycopg2://", 1)
        shutil.copyfile(ROOT / "deploy" / "single-host" / "dagster.yaml", home / "dagster.yaml")
        self.kind = "postgresql"
        # The database is the benchmark's alone: dropped when the process ends, figures taken or not (a CI server
        # runs this on every push).
        atexit.register(self.drop)

    def size(self) -> tuple[int, int]:
        """(event-log rows, database bytes)."""
        if self.kind == "postgresql":
            import psycopg2

            with psycopg2.connect(self.db_url) as conn, conn.cursor() as cur:
                cur.execute("SELECT count(*) FROM event_logs")
                rows = cur.fetchone()[0]
                cur.execute("SELECT pg_database_size(current_database())")
                return rows, cur.fetchone()[0]
        rows = size = 0
        for db in (self.home / "history").rglob("*.db"):
            size += db.stat().st_size + sum(p.stat().st_size for p in db.parent.glob(db.name + "-*"))
            if db.name == "index.db":
                # Dagster's SQLite index copies each run's asset events and its start and end from the run's own
                # database: counted here too, they made SQLite's rows ~40% more than PostgreSQL's one table for the
                # same runs (1,072 against 776 after the datasets stage at scale 0.01).
                continue
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
            try:
                rows += con.execute("SELECT count(*) FROM event_logs").fetchone()[0]
            except sqlite3.OperationalError:
                pass  # a database without an event log (runs.db, schedules.db)
            finally:
                con.close()
        return rows, size

    def drop(self) -> None:
        if self.kind == "postgresql":
            import psycopg2

            admin = psycopg2.connect(self.pg_url)
            admin.autocommit = True
            with admin.cursor() as cur:
                cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (self.db,))
                cur.execute(f'DROP DATABASE IF EXISTS "{self.db}"')
            admin.close()


def write_config(
    path: Path,
    data_root: Path,
    prompts: dict[str, Path],
    *,
    endpoint: str | None,
    concurrency: int,
    limit: int | None,
    shard_size: int,
) -> Path:
    import yaml

    backend: dict[str, Any] = {
        "kind": "simulated",
        "model": "moonshotai/kimi-k2.5",
        "concurrency": concurrency,
        "stream": True,
        "timeout_s": 300,
        "max_retries": 4,
        "price_per_m_prompt": 0.60,
        "price_per_m_completion": 2.50,
    }
    if endpoint:
        backend["endpoint"] = endpoint
    datasets = []
    for name, domain, tools, fmt in DATASETS:
        ds = {
            "name": name,
            "prompts": str(prompts[name]),
            "domain": domain,
            "tools": tools,
            "format": fmt,
            "max_tokens": MAX_TOKENS,
            "backend": "sim",
        }
        if limit:
            ds["limit"] = limit
        datasets.append(ds)
    cfg = {
        "data_root": str(data_root),
        "target": {"tokenizer": "env:EAGLE_KIMI_TOKENIZER_DIR", "profile": "kimi-k2.5"},
        "backends": {"sim": backend},
        "datasets": datasets,
        "generation": {"budget_usd": 1.0e6, "commit_every_rows": 2000, "commit_every_s": 30, "progress_every_s": 60},
        "merge": {"seed": 0, "dedup": True, "eval_fraction": 0.05, "rows_per_shard": 10000, "draft_vocab_size": 32000},
        "hidden_states": {
            "model": "tiny-random",
            "family": "deepseek_v3",
            "seed": 0,
            "shard_size": shard_size,
            "max_tokens_per_batch": 8192,
            "device": "cpu",
            "disk_budget_gb": 50,
            "trainer_layouts": ["specforge"],
            "engine": "in_process",
        },
        "pools": {"llm_api": 4, "gpu": 1},
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


# ---- the server, in its own process -----------------------------------------------------------------------------


def serve(port_file: str, usage_file: str) -> None:
    """The simulated OpenRouter server with Kimi-like answers, billed with the target tokenizer, until SIGTERM."""
    from eagle_pipeline.defs.generation import provider_token_counters
    from eagle_pipeline.simulation import AnswerLengths, SimulatedOpenRouterServer, StreamStyle
    from eagle_pipeline.tokens import resolve_tokenizer
    from eagle_pipeline.tokens.profiles import PROFILES

    tok = resolve_tokenizer("env:EAGLE_KIMI_TOKENIZER_DIR")
    count_completion, count_prompt = provider_token_counters(tok, PROFILES["kimi-k2.5"])
    server = SimulatedOpenRouterServer(
        model="moonshotai/kimi-k2.5",
        count_completion_tokens=count_completion,
        count_prompt_tokens=count_prompt,
        faults={"length": LENGTH_SHARE},
        lengths=AnswerLengths(mean_tokens=CRUDE_MEAN_TOKENS, cap_tokens=MAX_TOKENS),
        stream=StreamStyle(chunk_chars=140, keepalive_s=5.0),  # ~35 tokens an event: ~100 events an answer
    )
    stop = False

    def on_term(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    with server:
        Path(port_file).write_text(server.url)
        while not stop:
            time.sleep(0.2)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    Path(usage_file).write_text(json.dumps({"cpu_s": ru.ru_utime + ru.ru_stime, "peak_rss": ru.ru_maxrss * 1024}))


class ServerProcess:
    def __init__(self, work: Path) -> None:
        self.port_file, self.usage_file = work / "server.url", work / "server.usage.json"
        self.port_file.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--serve", str(self.port_file), str(self.usage_file)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT)
        deadline = time.monotonic() + 120
        while not self.port_file.exists() or not self.port_file.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the simulated server did not start")
            time.sleep(0.1)
        self.url = self.port_file.read_text()

    def cpu_s(self) -> float:
        """CPU seconds the server has used so far (utime + stime from /proc)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> dict[str, Any]:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        return json.loads(self.usage_file.read_text())


# ---- a stage: real jobs in one process, measured per step ---------------------------------------------------------


def _vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux, or not allowed: the peak then is the process's peak so far


def _wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


def _cpu() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def run_stage(spec_file: str, out_file: str) -> int:
    """Run the stage's jobs (`[[job, partition or null], ...]`) in this process; write per-step and per-run figures."""
    spec = json.loads(Path(spec_file).read_text())
    import dagster as dg

    from eagle_pipeline.definitions import defs
    from eagle_pipeline.defs.partitions import SHARD_PARTITIONS_NAME
    from eagle_pipeline.defs.pools import ensure_pool_limits

    instance = dg.DagsterInstance.get()
    ensure_pool_limits(instance, {"llm_api": 4, "gpu": 1})
    steps: list[dict[str, Any]] = []
    open_steps: dict[str, dict[str, Any]] = {}
    original = instance.handle_new_event

    def watch(event: Any, *args: Any, **kwargs: Any) -> None:
        de = event.dagster_event
        if de is not None and de.step_key:
            kind = de.event_type_value
            if kind == "STEP_START":
                _reset_hwm()
                open_steps[de.step_key] = {"t": time.monotonic(), "cpu": _cpu(), "w": _wchar()}
            elif kind in ("STEP_SUCCESS", "STEP_FAILURE") and de.step_key in open_steps:
                s = open_steps.pop(de.step_key)
                steps.append(
                    {
                        "step": de.step_key,
                        "ok": kind == "STEP_SUCCESS",
                        "wall_s": time.monotonic() - s["t"],
                        "cpu_s": _cpu() - s["cpu"],
                        "peak_rss": _vm_hwm(),
                        "wchar": _wchar() - s["w"],
                    }
                )
        original(event, *args, **kwargs)

    instance.handle_new_event = watch  # type: ignore[method-assign]
    jobs = spec["jobs"]
    if jobs == "all_shards":
        jobs = [["EAGLE_hidden_states", k] for k in sorted(instance.get_dynamic_partitions(SHARD_PARTITIONS_NAME))]
    runs = []
    quiet = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
    for job, partition in jobs:
        t, c = time.monotonic(), _cpu()
        result = defs.resolve_job_def(job).execute_in_process(
            instance=instance, partition_key=partition, raise_on_error=False, run_config=quiet
        )
        runs.append(
            {
                "job": job,
                "partition": partition,
                "ok": result.success,
                "wall_s": time.monotonic() - t,
                "cpu_s": _cpu() - c,
            }
        )
        if not result.success:
            for event in result.all_events:
                if event.is_step_failure and event.step_failure_data.error is not None:
                    print(f"  {job}[{partition}] {event.step_key}: {event.step_failure_data.error.message[:400]}")
    ru = resource.getrusage(resource.RUSAGE_SELF)
    Path(out_file).write_text(
        json.dumps(
            {
                "steps": steps,
                "runs": runs,
                "peak_rss": ru.ru_maxrss * 1024,
                "children_peak_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
            }
        )
    )
    return 0


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


class Bench:
    def __init__(self, work: Path, instance: Instance, stages: list[dict[str, Any]] | None = None) -> None:
        self.work, self.instance = work, instance
        self.stages: list[dict[str, Any]] = [] if stages is None else stages

    def stage(self, name: str, config: Path, jobs: Any, data_root: Path, *, record: bool = True) -> dict[str, Any]:
        spec, out = self.work / f"{name}.spec.json", self.work / f"{name}.out.json"
        spec.write_text(json.dumps({"jobs": jobs}))
        env = {**os.environ, **self.instance.env, "EAGLE_PIPELINE_CONFIG": str(config)}
        before = _du(data_root)
        t = time.monotonic()
        proc = subprocess.run([sys.executable, __file__, "--stage", str(spec), str(out)], cwd=ROOT, env=env)
        wall = time.monotonic() - t
        if proc.returncode:
            raise RuntimeError(f"stage {name} failed (exit {proc.returncode})")
        result = json.loads(out.read_text())
        rows, db = self.instance.size()
        result.update(
            name=name,
            wall_s=wall,
            data_bytes=_du(data_root) - before,
            event_rows=rows,
            db_bytes=db,
            cpu_s=sum(r["cpu_s"] for r in result["runs"]),
            load=os.getloadavg()[0],
        )
        if record:
            self.stages.append(result)
        failed = [f"{r['job']}[{r['partition']}]" for r in result["runs"] if not r["ok"]]
        if failed:
            raise RuntimeError(f"stage {name}: failed runs {failed}")
        return result


def step_sum(stage: dict[str, Any], pred: Any) -> dict[str, float]:
    sel = [s for s in stage["steps"] if pred(s["step"])]
    return {
        "wall_s": sum(s["wall_s"] for s in sel),
        "cpu_s": sum(s["cpu_s"] for s in sel),
        "peak_rss": max((s["peak_rss"] for s in sel), default=0),
        "wchar": sum(s["wchar"] for s in sel),
        "n": len(sel),
    }


# ---- baselines --------------------------------------------------------------------------------------------------


def minimal_client(url: str, bodies_file: str, concurrency: int, out_file: str) -> None:
    """A bare aiohttp streaming loop: post, split the SSE lines, parse each event, keep the text and the usage."""
    import aiohttp
    import orjson

    bodies = [json.loads(line) for line in Path(bodies_file).read_text().splitlines()]
    tokens = 0

    async def one(session: aiohttp.ClientSession, body: dict) -> None:
        nonlocal tokens
        parts: list[str] = []
        async with session.post(url + "/chat/completions", json=body) as resp:
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                event = orjson.loads(line[6:])
                for choice in event.get("choices") or ():
                    delta = choice.get("delta") or {}
                    parts.append(delta.get("reasoning") or "")
                    parts.append(delta.get("content") or "")
                if event.get("usage"):
                    tokens += event["usage"]["completion_tokens"]
        "".join(parts)

    async def main() -> None:
        queue = list(bodies)
        connector = aiohttp.TCPConnector(limit=concurrency)
        timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

            async def worker() -> None:
                while queue:
                    await one(session, queue.pop())

            await asyncio.gather(*(worker() for _ in range(concurrency)))

    t, c = time.monotonic(), time.process_time()
    asyncio.run(main())
    ru = resource.getrusage(resource.RUSAGE_SELF)
    Path(out_file).write_text(
        json.dumps(
            {
                "n": len(bodies),
                "tokens": tokens,
                "cpu_s": time.process_time() - c,
                "wall_s": time.monotonic() - t,
                "peak_rss": ru.ru_maxrss * 1024,
            }
        )
    )


def minimal_client_baseline(work: Path, server: ServerProcess, data_root: Path, n: int, concurrency: int) -> dict:
    import pyarrow.parquet as pq

    from eagle_pipeline.shared.storage import DataRoot

    root = DataRoot(data_root)
    bodies = []
    per = max(1, n // len(DATASETS))
    for name, *_ in DATASETS:
        t = pq.read_table(root.prompts(name), columns=["messages_json", "tools_json"]).slice(0, per).to_pylist()
        for r in t:
            body = {
                "model": "moonshotai/kimi-k2.5",
                "messages": json.loads(r["messages_json"]),
                "stream": True,
                "max_tokens": MAX_TOKENS,
                "seed": 1,
            }  # another seed: the same length distribution, fresh answers
            if r["tools_json"]:
                body["tools"] = json.loads(r["tools_json"])
            bodies.append(body)
    bodies_file, out = work / "minimal.bodies.jsonl", work / "minimal.out.json"
    bodies_file.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    cpu0 = server.cpu_s()
    subprocess.run(
        [sys.executable, __file__, "--minimal-client", server.url, str(bodies_file), str(concurrency), str(out)],
        cwd=ROOT,
        check=True,
    )
    result = json.loads(out.read_text())
    result["server_cpu_s"] = server.cpu_s() - cpu0
    return result


def raw_encode(data_root: str, out_file: str) -> None:
    """The tokenizer's own encode of the texts reconstruction tokenizes: each distinct rendered prompt (with its
    special tokens) and every answer's reasoning, content and tool-call JSON. The render itself is not timed."""
    from eagle_pipeline.generation.store.shards import read_responses
    from eagle_pipeline.shared.storage import DataRoot
    from eagle_pipeline.tokens import resolve_tokenizer
    from eagle_pipeline.tokens.render import render_prompt

    tok = resolve_tokenizer("env:EAGLE_KIMI_TOKENIZER_DIR")
    root = DataRoot(Path(data_root))
    tokens = 0
    cpu = 0.0
    for name, *_ in DATASETS:
        table = read_responses(root.responses_dir(name))
        cols = {
            c: table.column(c).to_pylist()
            for c in ("messages_json", "tools_json", "reasoning", "content", "tool_calls_json")
        }
        prompts = {
            (m, t): render_prompt(tok, json.loads(m), json.loads(t) if t else None, thinking=True)
            for m, t in zip(cols["messages_json"], cols["tools_json"])
        }
        texts = [x or "" for c in ("reasoning", "content", "tool_calls_json") for x in cols[c]]
        c = time.process_time()
        tokens += sum(len(tok.encode_with_specials(p)) for p in prompts.values())
        tokens += sum(len(ids) for ids in tok.encode_ordinary_batch(texts))
        cpu += time.process_time() - c
    Path(out_file).write_text(json.dumps({"tokens": tokens, "cpu_s": cpu}))


def plain_merge(parts: list[str], out: str, seed: int = 0) -> float:
    """Read the token parts, concatenate, shuffle and write one Parquet file: the floor a merge is held against."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = time.monotonic()
    table = pa.concat_tables([pq.read_table(p) for p in parts], promote_options="permissive")
    order = np.random.default_rng(seed).permutation(table.num_rows)
    pq.write_table(table.take(pa.array(order)), out, row_group_size=10000)
    return time.monotonic() - t


def manifest_tokens(parts: list[str]) -> int:
    """Prompt + output ids in the datasets' token tables: what reconstruction produced."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    total = 0
    for p in parts:
        t = pq.read_table(p, columns=["prompt_ids", "output_ids"])
        total += sum(pc.sum(pc.list_value_length(t.column(c))).as_py() or 0 for c in ("prompt_ids", "output_ids"))
    return total


# ---- the table --------------------------------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def print_table(figures: dict[str, Any]) -> None:
    print(
        f"\n== seed-scale rehearsal, scale {figures['scale']} ({figures['instance']} instance, tokenizer "
        f"{figures['tokenizer']}); load before: {figures['load_start']}; after: {figures['load_end']}"
    )
    head = (
        f"{'stage / step':<28}{'wall s':>9}{'CPU s':>9}{'peak RSS':>11}{'written':>11}{'event rows':>11}{'DB size':>10}"
    )
    print(head)
    print("-" * len(head))
    for row in figures["rows"]:
        db = _mib(row["db_bytes"]) if row.get("db_bytes") is not None else ""
        ev = f"{row['event_rows']:,}" if row.get("event_rows") is not None else ""
        print(
            f"{row['label']:<28}{row['wall_s']:>9.1f}{row['cpu_s']:>9.1f}{_mib(row['peak_rss']):>11}"
            f"{_mib(row['written']):>11}{ev:>11}{db:>10}"
        )
    g = figures["goals"]
    print("\n" + "\n".join(f"{k:<52}{v}" for k, v in g.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--work", type=Path, default=None, help="work folder (default: a temporary one, removed)")
    ap.add_argument("--concurrency", type=int, default=1000, help="requests in flight")
    ap.add_argument("--merge-runs", type=int, default=5, help="merge and plain-merge runs, alternating")
    ap.add_argument(
        "--minimal-requests", type=int, default=4000, help="requests for the minimal client (x scale, >= 80)"
    )
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--stage", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--minimal-client", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--raw-encode", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(*args.serve)
        return 0
    if args.stage:
        return run_stage(*args.stage)
    if args.minimal_client:
        url, bodies, conc, out = args.minimal_client
        minimal_client(url, bodies, int(conc), out)
        return 0
    if args.raw_encode:
        raw_encode(*args.raw_encode)
        return 0
    # A stop (CI cancelling the job, `timeout`, a closed terminal) unwinds like an error: subprocess.run kills the
    # stage in flight, the server is stopped, the temporary folder goes and atexit drops the PostgreSQL databases.
    # Python's default for these signals ends the process at once and left all four behind.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop)
    work = args.work or Path(tempfile.mkdtemp(prefix="eagle-seed-bench-"))
    try:
        figures = rehearse(args, work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print_table(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


def _stop(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def rehearse(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from eagle_pipeline.tokens import resolve_tokenizer

    t_all = time.monotonic()
    load_start = _uptime()
    work.mkdir(parents=True, exist_ok=True)
    instance = Instance(work / "dagster_home")
    bench = Bench(work, instance)
    n = max(8, round(SEED_PROMPTS_PER_DATASET * args.scale))
    t = time.monotonic()
    prompts = write_prompts(work / "prompts", n)
    prompts_wall = time.monotonic() - t
    data_root = work / "data"
    server = ServerProcess(work)
    try:
        config = write_config(
            work / "pipeline.yaml",
            data_root,
            prompts,
            endpoint=server.url,
            concurrency=args.concurrency,
            limit=None,
            shard_size=64,
        )
        server_cpu0 = server.cpu_s()
        ds = bench.stage("datasets", config, [["EAGLE_dataset", name] for name, *_ in DATASETS], data_root)
        server_gen_cpu = server.cpu_s() - server_cpu0
        minimal = minimal_client_baseline(
            work, server, data_root, max(80, round(args.minimal_requests * args.scale)), args.concurrency
        )
    finally:
        server_usage = server.stop()
    view = bench.stage("audit_view", config, [["EAGLE_audit_view", None]], data_root)
    merge_runs, plain_runs = [], []
    from eagle_pipeline.shared.storage import DataRoot

    root = DataRoot(data_root)
    parts = [str(root.tokens(name)) for name, *_ in DATASETS]
    merge = None
    for _ in range(max(1, args.merge_runs)):
        m = bench.stage("merge", config, [["EAGLE_merge", None]], data_root, record=merge is None)
        merge = merge or m
        merge_runs.append(step_sum(m, lambda k: k == "merged_dataset")["wall_s"])
        plain_runs.append(plain_merge(parts, str(work / "plain_merge.parquet")))
    (work / "plain_merge.parquet").unlink(missing_ok=True)
    raw_out = work / "raw.out.json"
    subprocess.run([sys.executable, __file__, "--raw-encode", str(data_root), str(raw_out)], cwd=ROOT, check=True)
    raw = json.loads(raw_out.read_text())

    # the shard stage: a small data root of its own, >= 150 x scale partitions of SHARD_ROWS rows
    n_shards = max(4, round(SEED_SHARDS * args.scale)) if args.scale < 1 else SEED_SHARDS
    per_ds = math.ceil(n_shards * SHARD_ROWS / len(DATASETS) / 0.95)  # ~5% of the rows go to the eval split
    shard_root = work / "shard_data"
    # Its own instance: the shard partitions the seed-scale merge registered are not this root's.
    bench = Bench(work, Instance(work / "shard_dagster_home"), bench.stages)
    shard_cfg = write_config(
        work / "shards.yaml", shard_root, prompts, endpoint=None, concurrency=64, limit=per_ds, shard_size=SHARD_ROWS
    )
    bench.stage(
        "shard_setup",
        shard_cfg,
        [["EAGLE_dataset", name] for name, *_ in DATASETS] + [["EAGLE_merge", None]],
        shard_root,
        record=False,
    )
    shards = bench.stage("shards", shard_cfg, "all_shards", shard_root)

    # figures
    manifest = json.loads((root.merged_dir / "manifest.json").read_text())
    import pyarrow.compute as pc

    from eagle_pipeline.generation.store.shards import read_responses

    streamed = finish_length = answered = 0
    for name, *_ in DATASETS:
        resp = read_responses(root.responses_dir(name))
        streamed += pc.sum(resp.column("usage_completion_tokens")).as_py() or 0
        finish_length += pc.sum(pc.equal(resp.column("finish_reason"), "length")).as_py() or 0
        answered += resp.num_rows
    gen = step_sum(ds, lambda k: k == "responses")
    # token_samples reconstructs the ids and runs its gate checks in one step (so that a refused audit fails it).
    recon = step_sum(ds, lambda k: k == "token_samples")
    first = step_sum(ds, lambda k: k == "prompts")
    stage_rows = [
        {
            "label": "prompts (synthetic files)",
            "wall_s": prompts_wall,
            "cpu_s": prompts_wall,
            "peak_rss": 0,
            "written": _du(work / "prompts"),
        },
        {"label": "datasets: prompts step", **first, "written": first["wchar"]},
        {"label": "datasets: generation", **gen, "written": gen["wchar"]},
        {"label": "datasets: reconstruction + audit", **recon, "written": recon["wchar"]},
        {
            "label": "EAGLE_dataset x8 (stage)",
            "wall_s": ds["wall_s"],
            "cpu_s": ds["cpu_s"],
            "peak_rss": ds["peak_rss"],
            "written": ds["data_bytes"],
            "event_rows": ds["event_rows"],
            "db_bytes": ds["db_bytes"],
        },
        {
            "label": "simulated server (apart)",
            "wall_s": 0.0,
            "cpu_s": server_gen_cpu,
            "peak_rss": server_usage["peak_rss"],
            "written": 0,
        },
        {
            "label": "EAGLE_audit_view",
            "wall_s": view["wall_s"],
            "cpu_s": view["cpu_s"],
            "peak_rss": view["peak_rss"],
            "written": view["data_bytes"],
            "event_rows": view["event_rows"],
            "db_bytes": view["db_bytes"],
        },
    ]
    for key in ("merged_dataset", "merged_dataset_*", "draft_vocab", "hidden_state_plan"):
        s = step_sum(merge, lambda k, key=key: k == key or (key.endswith("*") and k.startswith(key[:-1])))
        label = "merge: checks" if key.endswith("*") else f"merge: {key}"
        stage_rows.append({"label": label, **s, "written": s["wchar"]})
    stage_rows.append(
        {
            "label": "EAGLE_merge (stage)",
            "wall_s": merge["wall_s"],
            "cpu_s": merge["cpu_s"],
            "peak_rss": merge["peak_rss"],
            "written": merge["data_bytes"],
            "event_rows": merge["event_rows"],
            "db_bytes": merge["db_bytes"],
        }
    )
    shard_runs = [r for r in shards["runs"]]
    stage_rows.append(
        {
            "label": f"EAGLE_hidden_states x{len(shard_runs)}",
            "wall_s": shards["wall_s"],
            "cpu_s": shards["cpu_s"],
            "peak_rss": shards["peak_rss"],
            "written": shards["data_bytes"],
            "event_rows": shards["event_rows"],
            "db_bytes": shards["db_bytes"],
        }
    )
    # Run 1 loads the model (once a process): the overhead against done shards is read from run 2 on.
    walls = [r["wall_s"] for r in shard_runs]
    warm = walls[1:] or walls
    k = max(1, min(10, len(warm) // 4))
    xs = list(range(1, len(warm) + 1))
    mx, my = sum(xs) / len(xs), sum(warm) / len(warm)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, warm)) / max(1e-9, sum((x - mx) ** 2 for x in xs))
    first_k, last_k = sorted(warm[:k])[k // 2], sorted(warm[-k:])[k // 2]
    gen_cpu_per_m = gen["cpu_s"] / max(1, streamed) * 1e6
    min_cpu_per_m = minimal["cpu_s"] / max(1, minimal["tokens"]) * 1e6
    ra_cpu = recon["cpu_s"]
    ra_tps = manifest_tokens(parts) / max(1e-9, ra_cpu)
    raw_tps = raw["tokens"] / max(1e-9, raw["cpu_s"])
    ratios = [m / p for m, p in zip(merge_runs, plain_runs)]
    peak = max(r["peak_rss"] for r in stage_rows)
    tok = resolve_tokenizer("env:EAGLE_KIMI_TOKENIZER_DIR")
    goals = {
        "rows merged / tokens merged": f"{manifest['rows_total']:,} / {manifest['tokens_total']:,} "
        f"({manifest['tokens_total'] / max(1, manifest['rows_total']):,.0f} a row)",
        "answers / streamed completion tokens / finish length": f"{answered:,} / {streamed:,} "
        f"({streamed / max(1, answered):,.0f} an answer) / {finish_length / max(1, answered):.1%}",
        "peak RSS, largest stage (goal < 4 GiB)": f"{peak / GIB:.2f} GiB",
        "generation client CPU s per M streamed tokens": f"{gen_cpu_per_m:.2f}",
        "minimal aiohttp client CPU s per M tokens": f"{min_cpu_per_m:.2f} ({minimal['n']} requests)",
        "ratio (goal <= 1.2x)": f"{gen_cpu_per_m / max(1e-9, min_cpu_per_m):.2f}x",
        "server CPU s (generation; minimal client)": f"{server_gen_cpu:.1f}; {minimal['server_cpu_s']:.1f}",
        "reconstruction + audit tokens/s (CPU)": f"{ra_tps:,.0f}",
        "raw encode tokens/s (CPU)": f"{raw_tps:,.0f}",
        "ratio (goal <= 1.5x)": f"{raw_tps / max(1e-9, ra_tps):.2f}x the raw encode's time",
        "merge vs plain pyarrow (merged_dataset step)": "; ".join(
            f"{m:.1f}/{p:.1f}s" for m, p in zip(merge_runs, plain_runs)
        ),
        "merge ratio: median, range (goal <= 0.8x)": f"{sorted(ratios)[len(ratios) // 2]:.2f}x, "
        f"{min(ratios):.2f}x..{max(ratios):.2f}x over {len(ratios)} runs",
        "shard runs: run 1 (model load) wall s": f"{walls[0]:.2f}",
        "shard runs: median of runs 2..k+1 / last k, wall s": f"{first_k:.2f} / {last_k:.2f} (k={k}, "
        f"{last_k / max(1e-9, first_k):.2f}x; goal <= 1.2x)",
        "shard runs: slope s per done shard": f"{slope * 1000:.2f} ms",
        "non-GPU path wall (prompts..merge)": f"{prompts_wall + ds['wall_s'] + view['wall_s'] + merge['wall_s']:.0f} s",
        "whole benchmark wall": f"{time.monotonic() - t_all:.0f} s",
    }
    return {
        "scale": args.scale,
        "instance": instance.kind,
        "databases": [i.db for i in (instance, bench.instance) if i.kind == "postgresql"],
        "tokenizer": f"{tok.name} [{tok.kind}]",
        "load_start": load_start,
        "load_end": _uptime(),
        "rows": stage_rows,
        "goals": goals,
        "shard_walls": walls,
        "shard_slope_s": slope,
        "shard_ratio": last_k / max(1e-9, first_k),
        "merge_runs": merge_runs,
        "plain_runs": plain_runs,
        "gen_cpu_per_m": gen_cpu_per_m,
        "minimal_cpu_per_m": min_cpu_per_m,
        "ra_tokens_per_s": ra_tps,
        "raw_tokens_per_s": raw_tps,
        "streamed_tokens": streamed,
        "answered": answered,
        "finish_length": finish_length,
        "manifest": {"rows_total": manifest["rows_total"], "tokens_total": manifest["tokens_total"]},
        "stages": bench.stages,
    }


if __name__ == "__main__":
    sys.exit(main())
