"""Worker processes that read and assemble streamed answers, so that thousands of streams in flight are not limited
by one event loop.

A streamed answer costs ~2.5x the client CPU of a plain one (~1 ms against ~0.4 ms: about a hundred chunk events and ~11
network reads to one body), so one event loop saturates near 1,000 streamed answers/s: 2,000 streams in flight at 2 s.
`StreamWorkers` starts N child processes (`python -m eagle_pipeline.generation.backends.stream_workers`), each with its
own event loop and connections (an `HttpClient` with the run's timeouts and headers). The run sends each streamed
request to the least busy child and gets back what `client.assemble_streamed` returns in-process: the assembled body, a
whole non-stream body, or the RequestFailure. Retries, rows, the answer log, the budget and the rate limit stay in the
run's process, so the exactly-once and durability guarantees are the same.

Frames on the child's stdin and stdout: a header `<kind u8><request id u32><payload length u32>`, then the payload.

    INIT      parent -> child, once: JSON {concurrency, timeout_s, max_request_s, headers}. The API key travels
              here, never on a command line or in the child's environment.
    READY     child -> parent, once.
    REQUEST   JSON [url, keepalive_only_max_s], a newline, the request body.
    CANCEL    the run stopped waiting: the child cancels the exchange, which closes its connection (a provider
              stops generating, and billing, when the stream is closed).
    ANSWER    JSON [status, retry_after_s, chunks, keepalives, is_raw], a newline, the assembled body's JSON text,
              or the raw body when is_raw (an error status, a plain JSON answer).
    FAILURE   JSON [error_class, message, retryable, http_status, retry_after_s, stop_reason].
    CRASH     a bug in the child (its traceback): the run fails, as the same bug would fail it in-process.
    STATS     child -> parent, at exit: JSON {user_s, system_s, max_rss_kib}.

A child that dies (killed, out of memory) fails its requests in flight as `connection` failures, retried like a cut
connection, and is started again, at most `MAX_RESTARTS_PER_PROCESS` times per process and run. A child whose stdin
closes (the run ended, or was killed with -9) cancels its exchanges and exits: no orphan keeps a paid stream open.

Why this module is long: it holds both ends of one pipe protocol (the run's `StreamWorkers` and the worker's
`_serve`), so that the frames are defined once and read by one `FrameReader`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import signal
import struct
import sys
import traceback
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import orjson

from eagle_pipeline.generation.backends.client import Streamed, assemble_streamed
from eagle_pipeline.shared import failures as F
from eagle_pipeline.shared.aio import gc_tuned, run_coroutine
from eagle_pipeline.shared.failures import RequestFailure
from eagle_pipeline.shared.http_client import HttpClient

log = logging.getLogger("eagle_pipeline.generation")

INIT, READY, REQUEST, CANCEL, ANSWER, FAILURE, CRASH, STATS = range(8)
_HEAD = struct.Struct("<BII")
START_TIMEOUT_S = 60.0  # a child that is not ready by then (a broken install) fails the run's start
CLOSE_TIMEOUT_S = 10.0  # a child that has not exited by then after its stdin closed is killed
MAX_RESTARTS_PER_PROCESS = 3


def frame(kind: int, rid: int = 0, payload: bytes = b"") -> bytes:
    """One frame of the worker protocol."""
    return _HEAD.pack(kind, rid, len(payload)) + payload


class FrameReader:
    """Cuts a byte stream (received in pieces cut anywhere) into frames: `on_frame(kind, rid, payload)` for each."""

    def __init__(self, on_frame: Callable[[int, int, bytes], None]) -> None:
        self._buf = bytearray()
        self._on_frame = on_frame

    def feed(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos, n, size = 0, len(buf), _HEAD.size
        while n - pos >= size:
            kind, rid, length = _HEAD.unpack_from(buf, pos)
            end = pos + size + length
            if end > n:
                break
            self._on_frame(kind, rid, bytes(buf[pos + size : end]))
            pos = end
        if pos:
            del buf[:pos]

    @property
    def pending_bytes(self) -> int:
        """Bytes of an incomplete frame (non-zero when the stream ends: the frame was cut)."""
        return len(self._buf)


def _retrieved(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


# ---- the run's side ---------------------------------------------------------------------------------------------
class _Child(asyncio.SubprocessProtocol):
    """One worker process as the run sees it: its stdin, the requests it holds, its readiness and its exit."""

    def __init__(self, slot: int) -> None:
        loop = asyncio.get_running_loop()
        self.slot = slot
        self.pid: int | None = None
        self.reader = FrameReader(self._on_frame)
        self.pending: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self.ready: asyncio.Future[None] = loop.create_future()
        self.ready.add_done_callback(_retrieved)  # a start that failed is reported by `_spawn`, or not needed
        self.output_closed: asyncio.Future[None] = loop.create_future()
        self.exited: asyncio.Future[None] = loop.create_future()
        self.stats: dict[str, Any] | None = None
        self.transport: asyncio.SubprocessTransport | None = None
        self.stdin: asyncio.WriteTransport | None = None
        self.closing = False

    @property
    def alive(self) -> bool:
        return self.ready.done() and not self.ready.exception() and not self.output_closed.done()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports have the methods, not the asyncio base classes: no isinstance here.
        self.transport = cast(asyncio.SubprocessTransport, transport)
        self.pid = self.transport.get_pid()
        self.stdin = cast(asyncio.WriteTransport, self.transport.get_pipe_transport(0))

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        if fd == 1:
            self.reader.feed(data)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if fd != 1 or self.output_closed.done():
            return
        self.output_closed.set_result(None)
        code = self.transport.get_returncode() if self.transport is not None else None
        how = f"exited with code {code}" if code is not None else "closed its output"
        if not self.ready.done():
            self.ready.set_exception(
                RuntimeError(f"stream worker process {self.pid} {how} before it was ready (its errors: stderr above)")
            )
        lost = RequestFailure(F.CONNECTION, f"stream worker process {self.pid} {how} with this request in flight", True)
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(lost)
        self.pending.clear()

    def send(self, data: bytes) -> bool:
        """Write to the process's stdin; False when it is already gone (its exit is reported by its output)."""
        if self.stdin is None or self.stdin.is_closing():
            return False
        try:
            self.stdin.write(data)
        except (RuntimeError, OSError):  # closed between the check and the write (uvloop raises RuntimeError)
            return False
        return True

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def _on_frame(self, kind: int, rid: int, payload: bytes) -> None:
        if kind in (ANSWER, FAILURE, CRASH):
            fut = self.pending.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result((kind, payload))
        elif kind == READY:
            if not self.ready.done():
                self.ready.set_result(None)
        elif kind == STATS:
            self.stats = json.loads(payload)


class StreamWorkers:
    """N worker processes that carry the run's streamed exchanges (`post_streamed`); `start()` then `close()`.

    `stats` holds each exited child's CPU time and peak RSS (what `resource.getrusage` said at its exit).
    """

    def __init__(
        self,
        n: int,
        *,
        concurrency: int,
        timeout_s: float,
        max_request_s: float | None,
        headers: dict[str, str],
    ) -> None:
        if n < 1:
            raise ValueError(f"StreamWorkers needs at least one process, got {n}")
        self.n = n
        self._init = json.dumps(
            {"concurrency": concurrency, "timeout_s": timeout_s, "max_request_s": max_request_s, "headers": headers}
        ).encode()
        self._children: list[_Child] = []
        self._restarts = [0] * n
        self._watchers: set[asyncio.Task[None]] = set()
        self._given_up = [False] * n  # a slot whose process died and will not be started again
        self._changed: asyncio.Event | None = None  # set when a restart ends (a process is back, or given up)
        self._next_id = 0
        self.stats: list[dict[str, Any]] = []
        self._closed = False

    async def start(self) -> None:
        """Start every process and wait until each is ready; a process that fails to start fails the start."""
        results = await asyncio.gather(*(self._spawn(i) for i in range(self.n)), return_exceptions=True)
        self._children = [r for r in results if isinstance(r, _Child)]
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self.close()
            raise failed[0]
        self._changed = asyncio.Event()
        for child in self._children:
            self._watchers.add(asyncio.get_running_loop().create_task(self._watch(child)))

    async def _spawn(self, slot: int) -> _Child:
        loop = asyncio.get_running_loop()
        # The child must import this package as the run does, whatever put it on the run's sys.path.
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        _, child = await loop.subprocess_exec(
            lambda: _Child(slot),
            sys.executable,
            "-m",
            "eagle_pipeline.generation.backends.stream_workers",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=None,  # the run's stderr: its logs and a failed start's traceback land where the run's do
            env=env,
        )
        child.send(frame(INIT, 0, self._init))
        try:
            await asyncio.wait_for(asyncio.shield(child.ready), START_TIMEOUT_S)
        except BaseException:
            await self._stop(child)
            raise
        return child

    async def _watch(self, child: _Child) -> None:
        """Start a child that died mid-run again (its requests were already failed as retryable)."""
        await child.output_closed
        if self._closed or child.closing:
            return
        await self._stop(child)  # reap it, keep its figures
        fresh: _Child | None = None
        if self._restarts[child.slot] < MAX_RESTARTS_PER_PROCESS:
            self._restarts[child.slot] += 1
            with contextlib.suppress(Exception):  # a failed start's error went to stderr; `_pick` reports the end
                fresh = await self._spawn(child.slot)
        if fresh is not None and self._closed:
            await self._stop(fresh)
        elif fresh is not None:
            self._children[self._children.index(child)] = fresh
            self._watchers.add(asyncio.get_running_loop().create_task(self._watch(fresh)))
        else:
            self._given_up[child.slot] = True
        assert self._changed is not None
        self._changed.set()

    async def _pick(self) -> _Child:
        """The live process with the fewest requests in flight; waits while the only ones left are restarting."""
        while True:
            alive = [c for c in self._children if c.alive]
            if alive:
                return min(alive, key=lambda c: len(c.pending))
            if all(self._given_up) or self._changed is None:
                raise RuntimeError(
                    f"all {self.n} stream worker processes stopped "
                    f"(restarted {sum(self._restarts)} times; their errors: stderr above)"
                )
            self._changed.clear()
            await self._changed.wait()

    async def post_streamed(self, url: str, body: bytes, keepalive_only_max_s: float | None) -> Streamed:
        """`client.assemble_streamed` in the least busy worker process."""
        child = await self._pick()
        self._next_id = rid = (self._next_id + 1) & 0xFFFFFFFF
        fut: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        if not child.send(frame(REQUEST, rid, json.dumps([url, keepalive_only_max_s]).encode() + b"\n" + body)):
            raise RequestFailure(F.CONNECTION, f"stream worker process {child.pid} is gone", True)
        child.pending[rid] = fut
        try:
            kind, payload = await fut
        except asyncio.CancelledError:
            if child.pending.pop(rid, None) is not None:
                child.send(frame(CANCEL, rid))
            raise
        if kind == ANSWER:
            head, _, data = payload.partition(b"\n")
            status, retry_after_s, chunks, keepalives, is_raw = json.loads(head)
            if is_raw:
                return Streamed(status, retry_after_s, data)
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:  # NaN, integers beyond 64 bits: written by the standard library
                obj = json.loads(data)
            return Streamed(status, retry_after_s, None, data.decode(), obj, chunks, keepalives)
        if kind == FAILURE:
            error_class, message, retryable, http_status, retry_after_s, stop_reason = json.loads(payload)
            raise RequestFailure(error_class, message, retryable, http_status, retry_after_s, stop_reason)
        raise RuntimeError(
            f"stream worker process {child.pid} failed on a request:\n{payload.decode(errors='replace')}"
        )

    async def close(self) -> None:
        """Close every process's stdin (it cancels its exchanges and exits) and wait for it; kill a stuck one.
        Logs what the processes cost (their CPU time and peak RSS, each process's own figures at its exit)."""
        self._closed = True
        await asyncio.gather(*(self._stop(c) for c in self._children))
        await asyncio.gather(*self._watchers)  # a restart under way stops what it started
        if self.stats:
            log.info(
                "stream worker processes: %d, %d restarted; %.1f s of CPU in all; peak RSS %d MiB at most each",
                self.n,
                sum(self._restarts),
                sum(st["user_s"] + st["system_s"] for st in self.stats),
                max(st["max_rss_kib"] for st in self.stats) // 1024,
            )

    async def _stop(self, child: _Child) -> None:
        child.closing = True
        if child.stdin is not None and not child.stdin.is_closing():
            child.stdin.close()  # the child's cue to cancel its exchanges and exit
        transport = child.transport
        if transport is None:
            return
        _, waiting = await asyncio.wait({child.output_closed, child.exited}, timeout=CLOSE_TIMEOUT_S)
        if waiting:
            with contextlib.suppress(ProcessLookupError):
                transport.kill()
            # Reaped, so that its resources are released (and its CPU time counted as the run's children's).
            await asyncio.wait({child.exited}, timeout=CLOSE_TIMEOUT_S)
        transport.close()
        if child.stats is not None and child.stats not in self.stats:
            self.stats.append(child.stats)


@contextlib.asynccontextmanager
async def stream_workers(
    n: int, *, concurrency: int, timeout_s: float, max_request_s: float | None, headers: dict[str, str]
) -> AsyncIterator[StreamWorkers | None]:
    """`n` started worker processes for the duration of the block (None for `n` = 0: the run's own loop streams)."""
    if n <= 0:
        yield None
        return
    workers = StreamWorkers(
        n, concurrency=concurrency, timeout_s=timeout_s, max_request_s=max_request_s, headers=headers
    )
    await workers.start()
    try:
        yield workers
    finally:
        await workers.close()


# ---- the child's side -------------------------------------------------------------------------------------------
class _Inbox(asyncio.Protocol):
    def __init__(self, on_frame: Callable[[int, int, bytes], None], eof: asyncio.Future[None]) -> None:
        self.reader = FrameReader(on_frame)
        self.eof = eof

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)

    def eof_received(self) -> bool:
        if not self.eof.done():
            self.eof.set_result(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.eof.done():
            self.eof.set_result(None)


async def _serve(out_fd: int) -> None:
    """The child: take INIT, answer REQUESTs until stdin closes, then report STATS and return."""
    loop = asyncio.get_running_loop()
    out, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(out_fd, "wb", buffering=0))
    init: asyncio.Future[dict[str, Any]] = loop.create_future()
    eof: asyncio.Future[None] = loop.create_future()
    tasks: dict[int, asyncio.Task[None]] = {}
    client: HttpClient | None = None

    def send(data: bytes) -> None:
        if not out.is_closing():  # the run is gone (killed): what is left to say has no reader
            out.write(data)

    async def exchange(rid: int, url: str, keepalive_only_max_s: float | None, body: bytes) -> None:
        assert client is not None
        try:
            s = await assemble_streamed(client, url, body, keepalive_only_max_s)
            head = json.dumps([s.status, s.retry_after_s, s.chunks, s.keepalives, s.raw is not None]).encode()
            data = s.raw if s.raw is not None else (s.text or "").encode()
            send(frame(ANSWER, rid, head + b"\n" + data))
        except RequestFailure as f:
            fields = [f.error_class, f.message, f.retryable, f.http_status, f.retry_after_s, f.stop_reason]
            send(frame(FAILURE, rid, json.dumps(fields).encode()))
        except Exception:
            send(frame(CRASH, rid, traceback.format_exc().encode()))
        finally:
            tasks.pop(rid, None)

    def on_frame(kind: int, rid: int, payload: bytes) -> None:
        if kind == REQUEST:
            head, _, body = payload.partition(b"\n")
            url, keepalive_only_max_s = json.loads(head)
            tasks[rid] = loop.create_task(exchange(rid, url, keepalive_only_max_s, body))
        elif kind == CANCEL:
            task = tasks.pop(rid, None)
            if task is not None:
                task.cancel()
        elif kind == INIT and not init.done():
            init.set_result(json.loads(payload))

    await loop.connect_read_pipe(lambda: _Inbox(on_frame, eof), os.fdopen(0, "rb", buffering=0))
    first: list[asyncio.Future[Any]] = [init, eof]
    done, _ = await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
    if init in done:
        settings = init.result()
        async with HttpClient(
            concurrency=settings["concurrency"],
            timeout_s=settings["timeout_s"],
            max_request_s=settings["max_request_s"],
            headers=settings["headers"],
        ) as client:
            send(frame(READY))
            await eof
            for task in list(tasks.values()):
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    stats = {"user_s": usage.ru_utime, "system_s": usage.ru_stime, "max_rss_kib": usage.ru_maxrss}
    send(frame(STATS, 0, json.dumps(stats).encode()))
    while out.get_write_buffer_size():  # flushed before the loop (and the process) ends
        await asyncio.sleep(0.005)
    out.close()


def main() -> None:
    """Entry point of a worker process (`python -m eagle_pipeline.generation.backends.stream_workers`)."""
    out_fd = os.dup(1)
    os.dup2(2, 1)  # a stray print goes to stderr, never into the frames
    # Ctrl-C reaches the whole process group: the run commits what it has and closes the workers' stdin, which is
    # when they stop; dying first would only fail its streams in flight.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with gc_tuned():
        run_coroutine(lambda: _serve(out_fd))


if __name__ == "__main__":
    main()
