"""The request loop of a live run: a fixed pool of worker coroutines, retries with backoff, account-wide pauses on
Retry-After, rpm pacing, stops (auth, credits, an unreachable endpoint, budget, circuit breaker), periodic commits and progress.

`LiveRun` turns each prompt (each turn of a regenerated conversation, `turns`) into one responses row or one
errors row in the sink; `runner` sets it up and tears it down. The wire format (request bodies, response parsing) is the backend's (`backends`), the transport the client's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from eagle_pipeline.generation.backends.client import ChatClient
from eagle_pipeline.generation.backends.wire import HttpBackend, ParsedResponse, PromptItem
from eagle_pipeline.generation.plan.pending import RequestPlan
from eagle_pipeline.generation.plan.turns import after_answer
from eagle_pipeline.generation.run.options import CommitCadence
from eagle_pipeline.generation.spec import BackendSpec, SamplingSpec
from eagle_pipeline.generation.spend.budget import SpendLedger
from eagle_pipeline.generation.store.identity import BackendIdentity
from eagle_pipeline.generation.store.rows import RowProvenance, error_row, now_us, response_values
from eagle_pipeline.generation.store.sink import ShardSink
from eagle_pipeline.generation.summary import GenerationSummary, ProgressEvent
from eagle_pipeline.prompts import canonical_json
from eagle_pipeline.shared import failures as F
from eagle_pipeline.shared.failures import Redactor, RequestFailure

log = logging.getLogger("eagle_pipeline.generation")

RELEASE_SPREAD_MAX_S = 5.0


def release_spread_s(retry_after_s: float) -> float:
    """The window over which requests paused by a Retry-After restart (each at a random point in it).

    Without it every paused worker restarts at the same instant (2,000 requests within ~30 ms) against a limit that is
    usually account-wide. The window is the whole wait up to one second, 10% of longer waits, at most 5 s.
    """
    return min(RELEASE_SPREAD_MAX_S, max(0.1 * retry_after_s, min(retry_after_s, 1.0)))


class RetryPause:
    """The pause every worker keeps after a 429 with Retry-After (such limits are usually account-wide): until when,
    and the window after it over which the paused workers wake, each at its own random point."""

    def __init__(self, rng: random.Random) -> None:
        self.until = 0.0
        self.spread_s = 0.0
        self._rng = rng

    def extend(self, retry_after_s: float, now: float) -> None:
        """Pause until `retry_after_s` after `now`, unless a longer pause already holds."""
        if now + retry_after_s > self.until:
            self.until, self.spread_s = now + retry_after_s, release_spread_s(retry_after_s)

    def wake_at(self, now: float) -> float | None:
        """When a worker that finds the pause at `now` may go on: a random point of the release window, or None if
        the pause is over."""
        if self.until <= now:
            return None
        return self.until + self._rng.uniform(0.0, self.spread_s)


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
    completed: int = 0  # rows (one per turn of a regenerated conversation)
    answered: int = 0  # prompts answered: a conversation once its last turn is in
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors_by_class: dict[str, int] = field(default_factory=dict)


def row_provenance(dataset: str, spec: BackendSpec, sampling: SamplingSpec, identity: BackendIdentity) -> RowProvenance:
    """The fixed columns of every row a live run of `spec` produces (`identity`: of the configured spec, before a
    loopback server gave it an endpoint)."""
    q = spec.provider.get("quantizations") if isinstance(spec.provider, dict) else None
    return RowProvenance(
        dataset=dataset,
        source=spec.source,
        backend=spec.name,
        endpoint=spec.endpoint or "",
        model=spec.model,
        # Only a routing pinned to exactly one quantization tells us what served the request.
        quantization=q[0] if isinstance(q, list) and len(q) == 1 else None,
        sampling_json=canonical_json(sampling.provenance_dict()),
        thinking=bool(sampling.thinking),
        identity=identity.to_json(),
    )


class LiveRun:
    """State of one generate_dataset call against a live backend."""

    def __init__(
        self,
        *,
        dataset: str,
        plan: RequestPlan,
        backend: BackendSpec,
        http_backend: HttpBackend,
        provenance: RowProvenance,
        sink: ShardSink,
        redact: Redactor,
        ledger: SpendLedger,
        cadence: CommitCadence,
        progress: Callable[[ProgressEvent], None] | None,
    ) -> None:
        self.dataset = dataset
        self.plan = plan
        self.spec = backend
        self.backend = http_backend
        self.prov = provenance
        self.sink = sink
        self.redact = redact
        self.ledger = ledger
        self.commit_every_rows = cadence.commit_every_rows
        self.commit_every_s = cadence.commit_every_s
        self.progress = progress
        self.progress_every_s = cadence.progress_every_s
        self.c = _Counters()
        self.stop_reason: str | None = None
        self.stop_detail: str | None = None
        self.inflight = 0
        self.consecutive_failures = 0
        self.endpoint_answered = False  # any HTTP answer this run, even an error status
        self.rpm = _RpmBucket(backend.rpm) if backend.rpm else None
        self._rng = random.Random()
        self.pause = RetryPause(self._rng)
        self._pending_iter: Iterator[PromptItem] = iter(plan.items)
        self._stop_event = asyncio.Event()
        self.t0 = time.monotonic()

    @property
    def n_workers(self) -> int:
        return max(1, min(self.spec.effective_concurrency, len(self.plan.items)))

    # ---- control -------------------------------------------------------------------------------------------
    def stop(self, reason: str, detail: str = "") -> None:
        """Stop issuing requests (the first reason wins); requests in flight finish, pending retries are cancelled."""
        if self.stop_reason is None:
            self.stop_reason, self.stop_detail = reason, detail or None
            self._stop_event.set()
            log.warning(
                "[%s] stopping: %s%s (in flight: %d)",
                self.dataset,
                reason,
                f" ({detail})" if detail else "",
                self.inflight,
            )

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
            # Honour the server's wait, released at a random point of a window so that a storm of 429s does not
            # come back in lockstep.
            return f.retry_after_s + self._rng.uniform(0.0, release_spread_s(f.retry_after_s))
        cap = min(self.spec.backoff_max_s, self.spec.backoff_base_s * (2 ** (attempt - 1)))
        return self._rng.uniform(0.0, cap)  # full jitter

    async def _wait_for_pause(self) -> bool:
        """Wait out a Retry-After pause, waking at a random point of its release window; False if the run stopped
        meanwhile."""
        now = time.monotonic()
        wake = self.pause.wake_at(now)
        return True if wake is None else await self._sleep_or_stop(wake - now)

    # ---- main loop -----------------------------------------------------------------------------------------
    async def run(self, client: ChatClient) -> None:
        """Request every prompt of the plan (until a stop) through `n_workers` workers sharing `client`."""
        self.client = client
        ticker = asyncio.create_task(self._ticker())
        workers = [asyncio.create_task(self._worker()) for _ in range(self.n_workers)]
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
            if self.sink.buffered() and now - self.sink.last_commit >= self.commit_every_s:
                await self.sink.commit()
            if now - last_progress >= self.progress_every_s:
                last_progress = now
                self._emit_progress()

    def progress_event(self) -> ProgressEvent:
        """Where the run stands now: this run's figures and the dataset's totals, each labelled."""
        elapsed = time.monotonic() - self.t0
        rate = self.c.answered / elapsed if elapsed > 0 else 0.0
        done = self.plan.already_done + self.c.answered
        remaining = max(0, self.plan.total - done)
        return ProgressEvent(
            dataset=self.dataset,
            done=done,
            total=self.plan.total,
            done_this_run=self.c.answered,
            rows_this_run=self.c.completed,
            response_rows=self.plan.rows_done + self.c.completed,
            rate_per_s=rate,
            eta_s=remaining / rate if rate > 0 else None,
            spend_usd=self.ledger.this_run_usd,
            spend_total_usd=self.ledger.dataset_total_usd,
            errors=self.c.failed,
            elapsed_s=elapsed,
            already_done=self.plan.already_done,
            errors_by_class=dict(self.c.errors_by_class),
        )

    def _emit_progress(self) -> None:
        ev = self.progress_event()
        log.info("%s", ev.format())
        if self.progress is not None:
            try:
                self.progress(ev)
            except Exception:  # a broken progress callback must not lose generated rows
                log.exception("progress callback failed")

    async def _worker(self) -> None:
        while self.stop_reason is None:
            if self._budget_reached(self.inflight):
                return
            if self.rpm is not None:
                await self.rpm.acquire()
                if self.stop_reason is not None:
                    return
            item = next(self._pending_iter, None)
            if item is None:
                return
            self.inflight += 1
            try:
                await self._process(item)
            finally:
                self.inflight -= 1

    async def _process(self, first: PromptItem) -> None:
        """Request one prompt; a turn of a regenerated conversation is followed by the conversation's next turns,
        in order, until it ends, a turn fails for good, or the run stops (a rerun resumes at the first missing turn)."""
        item: PromptItem | None = first
        while item is not None:
            if item is not first:
                if self.stop_reason is not None or self._budget_reached(self.inflight - 1):
                    return
                if self.rpm is not None:
                    await self.rpm.acquire()
            self.c.requested += 1
            current = item
            try:
                item = await self._request(current)
            finally:
                self.backend.forget(current)

    def _budget_reached(self, inflight: int) -> bool:
        if self.ledger.reached(inflight):
            self.stop(F.STOP_BUDGET, self.ledger.why or "")
            return True
        return False

    async def _request(self, item: PromptItem) -> PromptItem | None:
        """One request with its retries: a responses row or an errors row; returns the conversation's next turn."""
        started_us = now_us()
        attempt = 0
        last: RequestFailure | None = None
        while True:
            if not await self._wait_for_pause():
                await self._fail(item, attempt, last, cancelled=True)
                return None
            attempt += 1
            t_attempt = time.perf_counter()
            try:
                text, parsed = await self.backend.exchange(self.client, item, attempt)
            except RequestFailure as f:
                last = f = self._unreachable_stops(f)
                if f.http_status is not None:
                    self.endpoint_answered = True
                if f.stop_reason:
                    self.stop(f.stop_reason, f"{self.backend.url}: {self.redact(f.message) or ''}")
                    await self._fail(item, attempt, f)
                    return None
                if not f.retryable or attempt > self.spec.max_retries:
                    await self._fail(item, attempt, f)
                    return None
                if self.stop_reason is not None:
                    await self._fail(item, attempt, f, cancelled=True)
                    return None
                if f.error_class == F.RATE_LIMIT and f.retry_after_s:
                    self.pause.extend(f.retry_after_s, time.monotonic())
                if not await self._sleep_or_stop(self._backoff(attempt, f)):
                    await self._fail(item, attempt, f, cancelled=True)
                    return None
                if self.rpm is not None:
                    await self.rpm.acquire()
                continue
            latency = time.perf_counter() - t_attempt
            self.endpoint_answered = True
            return await self._succeed(item, parsed, text, attempt, started_us, latency)

    def _unreachable_stops(self, f: RequestFailure) -> RequestFailure:
        """An endpoint this run never reached stops the run at its first unreachable attempt: a name that does not
        resolve or a port nothing listens on fails every request the same way, and minutes of retries (8 per prompt)
        would only hide the cause. Once the endpoint has answered, losing it is a fault to retry (a restarting
        server, a dropped route) like any other connection failure."""
        if f.error_class != F.UNREACHABLE or self.endpoint_answered:
            return f
        return dataclasses.replace(f, retryable=False, stop_reason=F.STOP_UNREACHABLE)

    async def _succeed(
        self, item: PromptItem, p: ParsedResponse, text: str, attempts: int, started_us: int, latency: float
    ) -> PromptItem | None:
        end = nxt = None
        if item.conversation_id is not None:
            # Decided before the row is built: the conversation's last turn records why it ended.
            src = self.plan.conversations[item.conversation_id]
            end, nxt = after_answer(src, item, p.reasoning, p.content, p.tool_calls_json, p.finish_reason)
        self.consecutive_failures = 0
        self.c.completed += 1
        self.c.answered += int(item.conversation_id is None or end is not None)
        self.ledger.record(p.cost_usd)
        self.c.prompt_tokens += p.usage_prompt_tokens or 0
        self.c.completion_tokens += p.usage_completion_tokens or 0
        values = response_values(
            self.prov,
            item,
            p,
            latency_s=latency,
            attempts=attempts,
            started_us=started_us,
            finished_us=now_us(),
            # A body that echoes the key (a misbehaving proxy) must not carry it into the dataset.
            raw_response_json=self.redact(text),
            conversation_end=end,
        )
        self.sink.add_response(values)
        if len(self.sink.responses) >= self.commit_every_rows:
            await self.sink.commit()
        return nxt

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
        self.sink.add_error(
            error_row(
                sample_id=item.sample_id,
                dataset=self.dataset,
                backend=self.spec.name,
                error_class=cls,
                http_status=f.http_status if f is not None else None,
                message=message,
                attempts=attempts,
                redact=self.redact,
            )
        )
        if self.consecutive_failures >= self.spec.circuit_breaker_failures:
            self.stop(F.STOP_CIRCUIT, f"{self.consecutive_failures} consecutive failed requests; last: {cls}")
        if len(self.sink.errors) >= self.commit_every_rows:
            await self.sink.commit()

    def summary(self) -> GenerationSummary:
        """This run's outcome (elapsed time and shard count are filled in by the caller)."""
        c = self.c
        return GenerationSummary(
            dataset=self.dataset,
            total_prompts=self.plan.total,
            already_done=self.plan.already_done,
            requested=c.requested,
            completed=c.completed,
            failed=c.failed,
            errors_by_class=dict(sorted(c.errors_by_class.items())),
            spend_usd=self.ledger.this_run_usd,
            prompt_tokens=c.prompt_tokens,
            completion_tokens=c.completion_tokens,
            stopped_reason=self.stop_reason,
            stopped_detail=self.stop_detail,
            elapsed_s=0.0,
            backend=self.spec.name,
            simulated=self.spec.kind == "simulated",
            skipped_duplicates=self.plan.duplicates,
        )
