"""The generation runner: exactly-once resume, bounded concurrency, retries, budgets, clean stops.

A run reads the sample ids of the committed shards, requests only the missing prompts through a fixed pool of
worker coroutines (bounded memory: one prompt per worker in flight), and commits rows in atomically written
`part-NNNNN.parquet` shards every N rows or T seconds. A kill -9 loses at most the rows not yet committed, and
the next run requests exactly those again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow as pa

from eagle_pipeline import storage
from eagle_pipeline.generation import failures as F
from eagle_pipeline.generation import store
from eagle_pipeline.generation.backends import HttpBackend, ParsedResponse, PromptItem, RenderPromptIds, make_backend
from eagle_pipeline.generation.client import HttpClient
from eagle_pipeline.generation.failures import Redactor, RequestFailure
from eagle_pipeline.generation.schema import ERRORS_SCHEMA, RESPONSES_SCHEMA, ColumnBuffer
from eagle_pipeline.generation.spec import BackendSpec, SamplingSpec
from eagle_pipeline.prompts import canonical_json

log = logging.getLogger("eagle_pipeline.generation")

APP_HEADERS = {"HTTP-Referer": "https://github.com/eagle-pipeline/eagle-pipeline", "X-Title": "eagle-pipeline"}


class SpendTracker:
    """Spend shared by every dataset of one pipeline run (thread-safe: datasets may generate in parallel threads)."""

    def __init__(self, budget_usd: float | None = None) -> None:
        self.budget_usd = budget_usd
        self._spent = 0.0
        self._lock = threading.Lock()

    def add(self, usd: float) -> None:
        with self._lock:
            self._spent += usd

    @property
    def spent_usd(self) -> float:
        with self._lock:
            return self._spent

    def reached(self, projected_extra_usd: float = 0.0) -> bool:
        """True when the spend (plus what in-flight requests are expected to cost) reaches the budget."""
        if self.budget_usd is None:
            return False
        with self._lock:
            return self._spent + projected_extra_usd >= self.budget_usd


@dataclass(frozen=True)
class ProgressEvent:
    dataset: str
    done: int  # committed or completed rows, earlier runs included
    total: int
    rate_per_s: float  # completions per second in this run
    eta_s: float | None
    spend_usd: float
    errors: int
    elapsed_s: float

    def format(self) -> str:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        eta = "-" if self.eta_s is None else f"{self.eta_s:,.0f}s"
        return (
            f"[{self.dataset}] {self.done:,}/{self.total:,} ({pct:.1f}%) {self.rate_per_s:,.1f}/s "
            f"eta {eta} spend ${self.spend_usd:,.4f} errors {self.errors:,} elapsed {self.elapsed_s:,.0f}s"
        )


@dataclass
class GenerationSummary:
    dataset: str
    total_prompts: int
    already_done: int
    requested: int
    completed: int
    failed: int
    errors_by_class: dict[str, int]
    spend_usd: float
    prompt_tokens: int
    completion_tokens: int
    stopped_reason: str | None
    elapsed_s: float
    backend: str
    simulated: bool
    skipped_duplicates: int = 0  # prompts sharing a sample_id (requested once), or duplicate import records
    shards_written: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _now_us() -> int:
    return time.time_ns() // 1000


class _RpmBucket:
    """Evenly spaced request slots (no burst): `rpm` requests per minute across all workers."""

    def __init__(self, rpm: float) -> None:
        self.interval = 60.0 / rpm
        self._next = time.monotonic()

    async def acquire(self) -> None:
        now = time.monotonic()
        slot = max(now, self._next)
        self._next = slot + self.interval
        if slot > now:
            await asyncio.sleep(slot - now)


@dataclass
class _Counters:
    requested: int = 0
    completed: int = 0
    failed: int = 0
    spend: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors_by_class: dict[str, int] = field(default_factory=dict)


class _Sink:
    """Buffers rows and commits them as numbered shards on one writer thread (writes never block the event loop).

    A failed write (disk full, permissions) is fatal for the run: its rows were answered but are not committed, so
    the run must not report them as done; the next run requests them again.
    """

    def __init__(self, out_dir: Path, errors_dir: Path, max_pending_writes: int = 2) -> None:
        self.out_dir = out_dir
        self.errors_dir = errors_dir
        self.responses = ColumnBuffer(RESPONSES_SCHEMA)
        self.errors = ColumnBuffer(ERRORS_SCHEMA)
        self._next_resp = store.next_part_index(out_dir)
        self._next_err = store.next_part_index(errors_dir)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="eagle-shard-writer")
        self._pending: list[concurrent.futures.Future] = []
        self._max_pending = max_pending_writes
        self.last_commit = time.monotonic()
        self.shards_written = 0
        self.write_error: BaseException | None = None

    def _written(self, f: concurrent.futures.Future) -> None:
        exc = f.exception()
        if exc is not None and self.write_error is None:
            self.write_error = exc

    def _check(self) -> None:
        if self.write_error is not None:
            raise RuntimeError(
                f"writing a shard failed: {type(self.write_error).__name__}: {self.write_error}"
            ) from self.write_error

    def _submit(self) -> list[concurrent.futures.Future]:
        futs = []
        t = self.responses.take()
        if t is not None:
            futs.append(self._pool.submit(store.write_shard, t, self.out_dir, self._next_resp))
            self._next_resp += 1
            self.shards_written += 1
        e = self.errors.take()
        if e is not None:
            futs.append(self._pool.submit(store.write_shard, e, self.errors_dir, self._next_err))
            self._next_err += 1
        for f in futs:
            f.add_done_callback(self._written)
        self.last_commit = time.monotonic()
        return futs

    def commit_nowait(self) -> None:
        """Submit a commit without waiting (sync callers; close() waits for every write)."""
        self._check()
        self._pending.extend(self._submit())

    async def commit(self) -> None:
        self._check()
        self._pending.extend(self._submit())
        # Back-pressure: if the disk is slower than generation, wait instead of piling tables up in memory.
        while len(self._pending) > self._max_pending:
            await asyncio.wait([asyncio.wrap_future(self._pending.pop(0))])
        self._pending = [f for f in self._pending if not f.done()]
        self._check()

    async def close(self) -> None:
        """Commit what is buffered and wait for every write; raise if any write failed."""
        try:
            futs = self._pending + self._submit()
            if futs:
                await asyncio.wait([asyncio.wrap_future(f) for f in futs])
        finally:
            self._pending = []
            self._pool.shutdown(wait=True)
        self._check()


class _Run:
    """State of one generate_dataset call against a live backend."""

    def __init__(
        self,
        *,
        dataset: str,
        items: list[PromptItem],
        backend: BackendSpec,
        http_backend: HttpBackend,
        sampling: SamplingSpec,
        sink: _Sink,
        redact: Redactor,
        endpoint: str,
        budget_usd: float | None,
        baseline_spend: float,
        run_budget: SpendTracker | None,
        commit_every_rows: int,
        commit_every_s: float,
        progress: Callable[[ProgressEvent], None] | None,
        progress_every_s: float,
        total: int,
        already_done: int,
    ) -> None:
        self.dataset = dataset
        self.items = items
        self.spec = backend
        self.backend = http_backend
        self.sink = sink
        self.redact = redact
        self.endpoint = endpoint
        self.budget_usd = budget_usd
        self.baseline_spend = baseline_spend
        self.run_budget = run_budget
        self.commit_every_rows = max(1, commit_every_rows)
        self.commit_every_s = commit_every_s
        self.progress = progress
        self.progress_every_s = progress_every_s
        self.total = total
        self.already_done = already_done
        self.c = _Counters()
        self.stop_reason: str | None = None
        self.inflight = 0
        self.consecutive_failures = 0
        self.pause_until = 0.0
        self.rpm = _RpmBucket(backend.rpm) if backend.rpm else None
        self.sampling_json = canonical_json(sampling.to_dict())
        self.thinking = bool(sampling.thinking)
        self.source = backend.source
        q = backend.provider.get("quantizations") if isinstance(backend.provider, dict) else None
        # Only a routing pinned to exactly one quantization tells us what served the request.
        self.quantization = q[0] if isinstance(q, list) and len(q) == 1 else None
        self.model = backend.model
        self._rng = random.Random()
        self._pending_iter: Iterator[PromptItem] = iter(items)
        self.t0 = time.monotonic()

    # ---- control -------------------------------------------------------------------------------------------
    def stop(self, reason: str, detail: str = "") -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            self._stop_event.set()
            log.warning(
                "[%s] stopping: %s%s (in flight: %d)",
                self.dataset,
                reason,
                f" ({detail})" if detail else "",
                self.inflight,
            )

    def _budget_reached(self) -> bool:
        # Project the cost of requests already in flight so that 2,000 of them cannot overshoot blindly.
        avg = self.c.spend / self.c.completed if self.c.completed else 0.0
        projected = self.inflight * avg
        if self.budget_usd is not None and self.baseline_spend + self.c.spend + projected >= self.budget_usd:
            return True
        return self.run_budget is not None and self.run_budget.reached(projected)

    async def _sleep_or_stop(self, delay: float) -> bool:
        """Sleep `delay` seconds; return False early if the run is stopped meanwhile."""
        if delay <= 0:
            return self.stop_reason is None
        try:
            await asyncio.wait_for(self._stop_event.wait(), timeout=delay)
            return False
        except TimeoutError:
            return self.stop_reason is None

    def _backoff(self, attempt: int, f: RequestFailure) -> float:
        if f.retry_after_s is not None:
            # Honour the server's wait; a little jitter so that a storm of 429s does not return in lockstep.
            return f.retry_after_s + self._rng.uniform(0.0, min(1.0, 0.1 * f.retry_after_s))
        cap = min(self.spec.backoff_max_s, self.spec.backoff_base_s * (2 ** (attempt - 1)))
        return self._rng.uniform(0.0, cap)  # full jitter

    # ---- main loop -----------------------------------------------------------------------------------------
    async def run(self, client: HttpClient) -> None:
        self._stop_event = asyncio.Event()
        self.client = client
        n_workers = max(1, min(self.spec.effective_concurrency, len(self.items)))
        ticker = asyncio.create_task(self._ticker())
        workers = [asyncio.create_task(self._worker()) for _ in range(n_workers)]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)
        self._emit_progress()

    async def _ticker(self) -> None:
        last_progress = time.monotonic()
        tick = max(0.05, min(0.5, self.commit_every_s / 4, self.progress_every_s / 2))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            if (
                len(self.sink.responses) or len(self.sink.errors)
            ) and now - self.sink.last_commit >= self.commit_every_s:
                await self.sink.commit()
            if now - last_progress >= self.progress_every_s:
                last_progress = now
                self._emit_progress()

    def _emit_progress(self) -> None:
        elapsed = time.monotonic() - self.t0
        rate = self.c.completed / elapsed if elapsed > 0 else 0.0
        done = self.already_done + self.c.completed
        remaining = max(0, self.total - done)
        ev = ProgressEvent(
            dataset=self.dataset,
            done=done,
            total=self.total,
            rate_per_s=rate,
            eta_s=remaining / rate if rate > 0 else None,
            spend_usd=self.c.spend,
            errors=self.c.failed,
            elapsed_s=elapsed,
        )
        log.info("%s", ev.format())
        if self.progress is not None:
            try:
                self.progress(ev)
            except Exception:  # a broken progress callback must not lose generated rows
                log.exception("progress callback failed")

    async def _worker(self) -> None:
        while self.stop_reason is None:
            if self._budget_reached():
                self.stop(F.STOP_BUDGET)
                return
            if self.rpm is not None:
                await self.rpm.acquire()
                if self.stop_reason is not None:
                    return
            item = next(self._pending_iter, None)
            if item is None:
                return
            self.c.requested += 1
            self.inflight += 1
            try:
                await self._process(item)
            finally:
                self.inflight -= 1
                self.backend.forget(item)

    async def _process(self, item: PromptItem) -> None:
        started_us = _now_us()
        attempt = 0
        last: RequestFailure | None = None
        while True:
            # A 429 with Retry-After pauses every worker: such limits are usually account-wide.
            if self.pause_until > time.monotonic() and not await self._sleep_or_stop(
                self.pause_until - time.monotonic()
            ):
                return await self._fail(item, attempt, last, cancelled=True)
            attempt += 1
            t_attempt = time.perf_counter()
            try:
                status, raw, retry_after = await self.client.post(
                    self.backend.url, self.backend.build_body(item, attempt)
                )
                text, parsed = self.backend.parse(status, raw, retry_after, item)
            except RequestFailure as f:
                last = f
                if f.stop_reason:
                    self.stop(f.stop_reason, self.redact(f.message) or "")
                    return await self._fail(item, attempt, f)
                if not f.retryable or attempt > self.spec.max_retries:
                    return await self._fail(item, attempt, f)
                if self.stop_reason is not None:
                    return await self._fail(item, attempt, f, cancelled=True)
                if f.error_class == F.RATE_LIMIT and f.retry_after_s:
                    self.pause_until = max(self.pause_until, time.monotonic() + f.retry_after_s)
                if not await self._sleep_or_stop(self._backoff(attempt, f)):
                    return await self._fail(item, attempt, f, cancelled=True)
                if self.rpm is not None:
                    await self.rpm.acquire()
                continue
            latency = time.perf_counter() - t_attempt
            await self._succeed(item, parsed, text, attempt, started_us, latency)
            return

    async def _succeed(
        self, item: PromptItem, p: ParsedResponse, text: str, attempts: int, started_us: int, latency: float
    ) -> None:
        self.consecutive_failures = 0
        self.c.completed += 1
        if p.cost_usd:
            self.c.spend += p.cost_usd
            if self.run_budget is not None:
                self.run_budget.add(p.cost_usd)
        self.c.prompt_tokens += p.usage_prompt_tokens or 0
        self.c.completion_tokens += p.usage_completion_tokens or 0
        # Values in RESPONSES_SCHEMA order (asserted in tests): one tuple per row, no per-row dict.
        self.sink.responses.append_values(
            (
                item.sample_id,
                self.dataset,
                item.messages_json,
                item.tools_json,
                self.source,
                self.spec.name,
                self.endpoint,
                p.model or self.model,
                p.provider,
                self.quantization,
                p.reasoning,
                p.content,
                p.tool_calls_json,
                p.prompt_token_ids,
                p.output_token_ids,
                p.finish_reason,
                p.native_finish_reason,
                p.usage_prompt_tokens,
                p.usage_completion_tokens,
                p.usage_reasoning_tokens,
                p.cost_usd,
                p.generation_id,
                self.sampling_json,
                self.thinking,
                latency,
                attempts,
                started_us,
                _now_us(),
                # A body that echoes the key (a misbehaving proxy) must not carry it into the dataset.
                self.redact(text),
            )
        )
        if len(self.sink.responses) >= self.commit_every_rows:
            await self.sink.commit()

    async def _fail(
        self, item: PromptItem, attempts: int, f: RequestFailure | None, *, cancelled: bool = False
    ) -> None:
        if cancelled or f is None:
            cls = F.CANCELLED
            message = f"run stopped ({self.stop_reason}) before " + (
                f"retrying; last failure: {f}" if f else "the first attempt"
            )
        else:
            cls = f.error_class
            message = f.message
            self.consecutive_failures += 1
        self.c.failed += 1
        self.c.errors_by_class[cls] = self.c.errors_by_class.get(cls, 0) + 1
        self.sink.errors.append(
            {
                "sample_id": item.sample_id,
                "dataset": self.dataset,
                "backend": self.spec.name,
                "error_class": cls,
                "http_status": f.http_status if f is not None else None,
                "message": self.redact(F.truncate(message, 1000)),
                "attempts": attempts,
                "at": _now_us(),
            }
        )
        if self.consecutive_failures >= self.spec.circuit_breaker_failures:
            self.stop(F.STOP_CIRCUIT, f"{self.consecutive_failures} consecutive failed requests; last: {cls}")
        if len(self.sink.errors) >= self.commit_every_rows:
            await self.sink.commit()


def _pending_items(prompts: pa.Table, done: set[str], limit: int | None) -> tuple[list[PromptItem], int, int, int]:
    """(items to request, total prompts considered, already done, duplicate sample ids skipped)."""
    if limit is not None:
        prompts = prompts.slice(0, limit)
    sids = prompts.column("sample_id").to_pylist()
    mjs = prompts.column("messages_json").to_pylist()
    tjs = prompts.column("tools_json").to_pylist() if "tools_json" in prompts.column_names else [None] * len(sids)
    items: list[PromptItem] = []
    seen: set[str] = set()
    already = dups = 0
    for sid, mj, tj in zip(sids, mjs, tjs):
        if sid in seen:
            dups += 1
            continue
        seen.add(sid)
        if sid in done:
            already += 1
            continue
        items.append(PromptItem(sid, mj, tj))
    return items, len(seen), already, dups


def _all_items(prompts: pa.Table, limit: int | None) -> tuple[list[PromptItem], dict[str, str]]:
    if limit is not None:
        prompts = prompts.slice(0, limit)
    sids = prompts.column("sample_id").to_pylist()
    tjs = prompts.column("tools_json").to_pylist() if "tools_json" in prompts.column_names else [None] * len(sids)
    srcs = prompts.column("source_id").to_pylist() if "source_id" in prompts.column_names else [None] * len(sids)
    items = [PromptItem(s, m, t) for s, m, t in zip(sids, prompts.column("messages_json").to_pylist(), tjs)]
    return items, {s: str(src) for s, src in zip(sids, srcs) if src is not None}


def _api_key(spec: BackendSpec) -> str | None:
    if not spec.api_key_env:
        return None
    value = os.environ.get(spec.api_key_env)
    if not value:
        raise RuntimeError(f"backend {spec.name!r}: environment variable {spec.api_key_env} is not set")
    return value


async def agenerate_dataset(
    *,
    dataset: str,
    prompts: pa.Table,
    backend: BackendSpec,
    sampling: SamplingSpec,
    out_dir: Path,
    errors_dir: Path,
    render_prompt_ids: RenderPromptIds | None = None,
    budget_usd: float | None = None,
    run_budget: SpendTracker | None = None,
    commit_every_rows: int = 500,
    commit_every_s: float = 10.0,
    progress: Callable[[ProgressEvent], None] | None = None,
    progress_every_s: float = 5.0,
    limit: int | None = None,
) -> GenerationSummary:
    """The async form of `generate_dataset` (same arguments), for callers that already run an event loop."""
    t_start = time.monotonic()
    out_dir, errors_dir = Path(out_dir), Path(errors_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    errors_dir.mkdir(parents=True, exist_ok=True)
    with store.DirLock(out_dir):
        # A killed writer may have left hidden temporaries; they were never committed.
        storage.clean_stale_tmp(out_dir)
        storage.clean_stale_tmp(errors_dir)
        done, baseline_spend = store.committed_sample_ids(out_dir)
        items, total, already, dups = _pending_items(prompts, done, limit)
        sink = _Sink(out_dir, errors_dir)

        if not backend.kind.is_http:
            from eagle_pipeline.generation.importer import import_responses

            all_items, source_ids = _all_items(prompts, limit)
            try:
                summary = import_responses(
                    dataset=dataset,
                    all_items=all_items,
                    source_ids=source_ids,
                    pending={it.sample_id for it in items},
                    backend=backend,
                    sampling=sampling,
                    sink=sink,
                    commit_every_rows=commit_every_rows,
                )
            finally:
                await sink.close()
            summary.total_prompts, summary.already_done = total, already
            summary.skipped_duplicates += dups
            summary.elapsed_s = time.monotonic() - t_start
            summary.shards_written = sink.shards_written
            log.info("[%s] import: %s", dataset, json.dumps(summary.to_dict()))
            return summary

        try:
            key = _api_key(backend)
            redact = Redactor([key] if key else [])
            headers = dict(APP_HEADERS) if backend.kind.speaks_openrouter else {}
            if key:
                headers["Authorization"] = f"Bearer {key}"
            server = None
            spec = backend
            if backend.kind == "simulated" and not backend.endpoint:
                from eagle_pipeline.generation.simulated import SimulatedOpenRouterServer

                server = SimulatedOpenRouterServer(**backend.simulated).start()
                spec = replace(backend, endpoint=server.url)
            try:
                run = _Run(
                    dataset=dataset,
                    items=items,
                    backend=spec,
                    http_backend=make_backend(spec, sampling, render_prompt_ids),
                    sampling=sampling,
                    sink=sink,
                    redact=redact,
                    endpoint=spec.endpoint or "",
                    budget_usd=budget_usd,
                    baseline_spend=baseline_spend,
                    run_budget=run_budget,
                    commit_every_rows=commit_every_rows,
                    commit_every_s=commit_every_s,
                    progress=progress,
                    progress_every_s=progress_every_s,
                    total=total,
                    already_done=already,
                )
                n_flight = max(1, min(spec.effective_concurrency, len(items)))
                log.info(
                    "[%s] %d prompts, %d already committed, %d to request from %s (%s, %d in flight)",
                    dataset,
                    total,
                    already,
                    len(items),
                    spec.name,
                    spec.kind,
                    n_flight,
                )
                if items:
                    with _gc_tuned():
                        async with HttpClient(
                            concurrency=n_flight, timeout_s=spec.timeout_s, headers=headers
                        ) as client:
                            await run.run(client)
            finally:
                if server is not None:
                    server.stop()
        finally:
            # Whatever happened (a stop, cancellation, a bug), commit every row and error in hand.
            await sink.close()
        c = run.c
        summary = GenerationSummary(
            dataset=dataset,
            total_prompts=total,
            already_done=already,
            requested=c.requested,
            completed=c.completed,
            failed=c.failed,
            errors_by_class=dict(sorted(c.errors_by_class.items())),
            spend_usd=c.spend,
            prompt_tokens=c.prompt_tokens,
            completion_tokens=c.completion_tokens,
            stopped_reason=run.stop_reason,
            elapsed_s=time.monotonic() - t_start,
            backend=spec.name,
            simulated=spec.kind == "simulated",
            skipped_duplicates=dups,
            shards_written=sink.shards_written,
        )
        log.info("[%s] summary: %s", dataset, json.dumps(summary.to_dict()))
        return summary


_gc_lock = threading.Lock()
_gc_users = 0
_gc_saved: tuple[int, int, int] | None = None
_gc_froze = False


@contextlib.contextmanager
def _gc_tuned() -> Iterator[None]:
    """Fewer, cheaper cyclic-GC passes while requests are in flight.

    Every response allocates a few dozen containers (parsed JSON); with thousands of coroutines and connections alive,
    CPython's default thresholds trigger full collections that stall the loop for hundreds of milliseconds, and every
    stall delays every queued response (measured: ~15% of the throughput at 2,000 in flight). Objects alive at the
    start are frozen out of collection and gen-0 runs every 20,000 allocations instead of 700; refcounting still frees
    everything acyclic at once. Restored when the last concurrent run ends.
    """
    global _gc_users, _gc_saved, _gc_froze
    with _gc_lock:
        if _gc_users == 0:
            _gc_saved = gc.get_threshold()
            # A process that froze objects itself (e.g. before forking) keeps its own freeze untouched.
            _gc_froze = gc.get_freeze_count() == 0
            if _gc_froze:
                gc.freeze()
            gc.set_threshold(max(_gc_saved[0], 20_000), max(_gc_saved[1], 50), max(_gc_saved[2], 50))
        _gc_users += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_users -= 1
            if _gc_users == 0 and _gc_saved is not None:
                gc.set_threshold(*_gc_saved)
                if _gc_froze:
                    gc.unfreeze()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    # uvloop cuts the event loop's share of per-request CPU; optional, and EAGLE_NO_UVLOOP=1 turns it off.
    if os.environ.get("EAGLE_NO_UVLOOP"):
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_coroutine(make_coro: Callable[[], Any]) -> Any:
    """Run a coroutine to completion from sync code: in this thread when it has no running loop, else in a fresh thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(make_coro())
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="eagle-generation") as ex:
        return ex.submit(run_coroutine, make_coro).result()


def generate_dataset(
    *,
    dataset: str,
    prompts: pa.Table,
    backend: BackendSpec,
    sampling: SamplingSpec,
    out_dir: Path,
    errors_dir: Path,
    render_prompt_ids: RenderPromptIds | None = None,
    budget_usd: float | None = None,
    run_budget: SpendTracker | None = None,
    commit_every_rows: int = 500,
    commit_every_s: float = 10.0,
    progress: Callable[[ProgressEvent], None] | None = None,
    progress_every_s: float = 5.0,
    limit: int | None = None,
) -> GenerationSummary:
    """Generate (or import) responses for every prompt of `prompts` not yet committed under `out_dir`.

    Exactly-once: rows are committed in atomically renamed shards and a rerun requests only the sample ids missing
    from them (a rerun after success makes no request). Failed requests go to `errors_dir`; a stop for auth, credits,
    budget or the circuit breaker commits everything done and is reported in `stopped_reason`.
    """
    kwargs = dict(
        dataset=dataset,
        prompts=prompts,
        backend=backend,
        sampling=sampling,
        out_dir=out_dir,
        errors_dir=errors_dir,
        render_prompt_ids=render_prompt_ids,
        budget_usd=budget_usd,
        run_budget=run_budget,
        commit_every_rows=commit_every_rows,
        commit_every_s=commit_every_s,
        progress=progress,
        progress_every_s=progress_every_s,
        limit=limit,
    )
    return run_coroutine(lambda: agenerate_dataset(**kwargs))
