"""Helpers for the generation tests: prompt tables, backend specs against loopback servers, a run wrapper, the kill
tests' pieces (a server in a process of its own, a run in a child process, the proofs of the client's reads), and a
count of file opens."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Self

import pyarrow as pa
import pyarrow.parquet as pq

from eagle_pipeline.generation.run.runner import generate_dataset
from eagle_pipeline.generation.spec import BackendSpec, SamplingSpec
from eagle_pipeline.generation.store.answer_log import read_log
from eagle_pipeline.generation.store.shards import part_files
from eagle_pipeline.prompts import Prompt, prompts_table
from eagle_pipeline.simulation import request_key
from eagle_pipeline.simulation.server import LoopbackServer

REPO = Path(__file__).resolve().parents[2]
SAMPLING = SamplingSpec(temperature=1.0, top_p=0.95, seed=7, max_tokens=2048, thinking=True)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}, "exact": {"type": "boolean"}},
            "required": ["query"],
        },
    },
}

_TOPICS = [
    "photosynthesis",
    "binary search",
    "glacier formation",
    "compound interest",
    "the French revolution",
    "TCP congestion control",
    "protein folding",
    "tidal forces",
    "Bayesian inference",
    "sourdough fermentation",
]


def make_prompts(
    n: int, *, dataset: str = "B1", sampling: SamplingSpec = SAMPLING, tools_every: int = 0, start: int = 0
) -> pa.Table:
    """n distinct prompts; every `tools_every`-th offers tools."""
    prompts = []
    for i in range(start, start + n):
        topic = _TOPICS[i % len(_TOPICS)]
        tools = [WEATHER_TOOL, SEARCH_TOOL] if tools_every and i % tools_every == 0 else None
        msgs = [
            {"role": "system", "content": "You are concise."},
            {"role": "user", "content": f"Question {i}: explain {topic} with an example."},
        ]
        prompts.append(Prompt(source_id=f"{dataset.lower()}-{i:04d}", messages=msgs, tools=tools))
    return prompts_table(dataset, prompts, sampling.to_dict())


def sim_backend(url: str | None, **kw: Any) -> BackendSpec:
    base: dict[str, Any] = dict(
        name="sim",
        kind="simulated",
        endpoint=url,
        model="moonshotai/kimi-k2.5",
        concurrency=4,
        timeout_s=10.0,
        max_retries=4,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
        circuit_breaker_failures=1000,
    )
    base.update(kw)
    return BackendSpec(**base)


def run(
    prompts: pa.Table,
    backend: BackendSpec,
    root: Path,
    *,
    sampling: SamplingSpec = SAMPLING,
    dataset: str = "B1",
    **kw: Any,
):
    """`generate_dataset` into `root/responses/<dataset>`; a run's options are passed as the product takes them,
    `options=RunOptions(...)`."""
    return generate_dataset(
        dataset=dataset,
        prompts=prompts,
        backend=backend,
        sampling=sampling,
        out_dir=root / "responses" / dataset,
        errors_dir=root / "responses" / dataset / "errors",
        **kw,
    )


def sample_key(sample_id: str, messages_json: str, sampling: SamplingSpec = SAMPLING) -> str:
    """The key a simulated server files a sample's request under: its messages and the seed it carries (each
    sample's own, `SamplingSpec.request_seed`)."""
    return request_key(messages_json, sampling.request_seed(sample_id))


def sample_keys(prompts: pa.Table, sampling: SamplingSpec = SAMPLING) -> dict[str, str]:
    """sample_id -> its request's key (`sample_key`) for every prompt of a prompts table."""
    sids, messages = prompts.column("sample_id").to_pylist(), prompts.column("messages_json").to_pylist()
    return {sid: sample_key(sid, mj, sampling) for sid, mj in zip(sids, messages)}


def prompts_on_disk(prompts: pa.Table, root: Path) -> tuple[Path, dict[str, str]]:
    """`prompts` written to `root/prompts.parquet` for a run in a child process (`run_child`), and each prompt's
    request key as the simulated servers log it (sample id -> key)."""
    path = root / "prompts.parquet"
    pq.write_table(prompts, path)
    return path, sample_keys(prompts)


def out_dirs(root: Path, dataset: str = "B1") -> tuple[Path, Path]:
    return root / "responses" / dataset, root / "responses" / dataset / "errors"


def committed_ids(out: Path) -> tuple[list[str], int]:
    """Sample ids of every committed shard (no dedupe), and the number of shards; every shard must be readable."""
    ids: list[str] = []
    files = part_files(out)
    for f in files:
        ids += pq.read_table(f, columns=["sample_id"]).column("sample_id").to_pylist()
    return ids, len(files)


def durable_ids(out: Path) -> set[str]:
    """Sample ids a rerun will not request: those of the committed shards and of the answer log a kill left."""
    return set(committed_ids(out)[0]) | {r["sample_id"] for r in read_log(out).responses}


class ServerProcess:
    """A simulated OpenRouter server in a child process of its own (`server_child`), with the request-log reads the
    kill tests need. Its stamps of when an answer's last byte was written come from a clock and an event loop that
    neither the test nor the client (another process) can delay; the reads fetch only what is new since the last."""

    def __init__(self, **server_kwargs: Any) -> None:
        self._kwargs = server_kwargs
        self._proc: subprocess.Popen[str] | None = None
        self.url = ""
        self._answered: list[tuple[str, int, float]] = []
        self._read_by: list[tuple[str, int, float]] = []
        self._arrivals: list[tuple[str, float]] = []

    def __enter__(self) -> Self:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "eagle_pipeline_tests.generation.server_child", json.dumps(self._kwargs)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        self.url = self._proc.stdout.readline().strip()
        assert self.url.startswith("http://127.0.0.1:"), f"the server process did not start: {self.url!r}"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait(30)

    def _call(self, call: str, **kw: Any) -> Any:
        assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps({"call": call, **kw}) + "\n")
        self._proc.stdin.flush()
        return json.loads(self._proc.stdout.readline())

    def answered(self) -> list[tuple[str, int, float]]:
        """(request key, attempt, server wall clock when the answer's last byte was written), in that order."""
        self._answered += [(k, a, t) for k, a, t in self._call("answered", since=len(self._answered))]
        return list(self._answered)

    def read_by(self) -> list[tuple[str, int, float]]:
        """(request key, attempt, server wall clock when the client had certainly read the whole answer), in the
        order of those proofs (`LoopbackServer.read_by`)."""
        self._read_by += [(k, a, t) for k, a, t in self._call("read_by", since=len(self._read_by))]
        return list(self._read_by)

    def arrivals(self) -> list[tuple[str, float]]:
        """(request key, server wall clock) of every request as it arrived, in order."""
        self._arrivals += [(k, t) for k, t in self._call("arrivals", since=len(self._arrivals))]
        return list(self._arrivals)

    def open_connections(self) -> int:
        return int(self._call("open_connections"))

    def request_counts(self) -> dict[str, int]:
        return dict(self._call("request_counts"))


def drained(srv: LoopbackServer | ServerProcess) -> None:
    """Wait until the server has dealt with every request a killed client sent (a starved server reads them late)."""
    deadline = time.monotonic() + 60
    while srv.open_connections() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not srv.open_connections(), "the server still holds the killed client's connections"


# The answer log's promise: an answer the client has read is durable (written to the log) within ~0.1 s.
GRACE_S = 0.1
# When the client read an answer is proven by the server (`LoopbackServer.read_by`): the next request on the
# connection that carried it. The client appends the row to the log before it yields to its event loop, but the
# connection is back in the pool a moment earlier, so another task may send that next request first: one pass of a
# busy event loop (tens of milliseconds on a loaded 2-core machine). An answer read more than GRACE_S + READ_SLACK_S
# before a kill must be durable after it.
READ_SLACK_S = 0.05


def run_child(prompts_path: Path, url: str, root: Path, options: dict[str, Any] | None = None) -> subprocess.Popen:
    """One generate_dataset run in a child process (`resume_child`), for a test to kill."""
    extra = [json.dumps(options)] if options else []
    return subprocess.Popen(
        [sys.executable, "-m", "eagle_pipeline_tests.generation.resume_child", str(prompts_path), url, str(root)]
        + extra,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def proven_reads(srv: ServerProcess, read_start: int, answered: set[tuple[str, int]]) -> list[tuple[str, float]]:
    """(key, when the client had read it) of the answers `answered` (one run's: (key, attempt)) proven read so far,
    from the `read_start`-th proof on."""
    return [(k, t) for k, a, t in srv.read_by()[read_start:] if (k, a) in answered]


def kill_once_read(
    proc: subprocess.Popen,
    srv: ServerProcess,
    *,
    reads: int,
    max_written: int,
    answered_start: int = 0,
    read_start: int = 0,
    deadline_s: float = 150.0,
) -> float:
    """Kill -9 the run `proc` once `reads` of its answers (those the server wrote from the `answered_start`-th on)
    were read by the client more than GRACE_S + READ_SLACK_S ago, while the server had written fewer than
    `max_written` of them (asserted: past that, the moment the test wants is gone). Returns the kill's time."""
    deadline = time.monotonic() + deadline_s
    while True:
        assert proc.poll() is None, f"the run ended before its kill: {proc.communicate()}"
        assert time.monotonic() < deadline, "the run was never killed"
        t_kill = time.time()
        written = {(k, a) for k, a, _ in srv.answered()[answered_start:]}
        proven = proven_reads(srv, read_start, written)
        old = sum(1 for _, t in proven if t <= t_kill - GRACE_S - READ_SLACK_S)
        assert len(written) < max_written, (
            f"no moment to kill the run with fewer than {max_written} answers written: {len(written)} written, "
            f"{len(proven)} proven read, {old} of them more than {GRACE_S + READ_SLACK_S} s ago"
            + ("" if proven else " (none: does the client still reuse its connections?)")
        )
        if old >= reads:
            os.kill(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
            return t_kill
        time.sleep(0.01)


class FileOpens:
    """The opens of the files directly under a directory, by name, as the kernel reports them (Linux inotify): every
    open by this process or another, through whatever library. `counts()` returns those since the watch began.

    The kernel merges an event into the previous one when both are the same and unread; closes are watched too so
    that a file opened, closed and opened again counts two opens (only a second open of a file while it is still open,
    with no other event between, would count one).
    """

    _IN_OPEN = 0x20
    _IN_CLOSE = 0x08 | 0x10  # IN_CLOSE_WRITE | IN_CLOSE_NOWRITE: events between two opens of a file
    _IN_Q_OVERFLOW = 0x4000
    _EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name, NUL-padded)

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._fd = -1
        self._counts: Counter[str] = Counter()

    def __enter__(self) -> Self:
        libc = ctypes.CDLL(None, use_errno=True)
        self._fd = libc.inotify_init1(os.O_NONBLOCK)
        if (
            self._fd < 0
            or libc.inotify_add_watch(self._fd, os.fsencode(self.directory), self._IN_OPEN | self._IN_CLOSE) < 0
        ):
            raise OSError(ctypes.get_errno(), f"inotify on {self.directory}")
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)

    def counts(self) -> Counter[str]:
        while True:
            try:
                buf = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return Counter(self._counts)
            i = 0
            while i < len(buf):
                _, mask, _, length = self._EVENT.unpack_from(buf, i)
                assert not mask & self._IN_Q_OVERFLOW, "inotify dropped events: the counts would be low"
                name = buf[i + self._EVENT.size : i + self._EVENT.size + length].rstrip(b"\0").decode()
                if name and mask & self._IN_OPEN:  # an open of the directory itself has no name
                    self._counts[name] += 1
                i += self._EVENT.size + length
