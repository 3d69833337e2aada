"""The sink for committed rows: buffers responses and errors, logs them, and commits them as numbered shards.

Every row added through `add_response` / `add_error` is also appended to the answer log (`answer_log`), durable
within ~0.1 s, so a kill -9 loses no answered work; the shards are still written only at the commit window. Writes
run on one writer thread (the log on its own) so that they never block the event loop; a rerun folds the log into
shards and finds the committed ones through `shards.read_committed`, then requests only what they lack.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from eagle_pipeline.generation.store import shards
from eagle_pipeline.generation.store.answer_log import DEFAULT_FLUSH_S, ERROR_ROW, RESPONSE_ROW, AnswerLog, Segment
from eagle_pipeline.generation.store.rows import ERRORS_SCHEMA, RESPONSE_COLUMNS, RESPONSES_SCHEMA, ColumnBuffer


class ShardSink:
    """Buffers rows and commits them as numbered shards on one writer thread.

    With `answer_log_s` (the log's write-and-fsync interval; None: no log) every row added through `add_response` /
    `add_error` is logged too, one log segment per commit, deleted once that commit's shards are durable. Rows put
    straight into the buffers (the importer's: its files are still there to read again) are not logged.

    A failed write (disk full, permissions) is fatal for the run: its rows were answered but are not committed, so
    the run must not report them as done; they stay in the log for the next run to fold.
    """

    def __init__(
        self,
        out_dir: Path,
        errors_dir: Path,
        max_pending_writes: int = 2,
        answer_log_s: float | None = DEFAULT_FLUSH_S,
    ) -> None:
        self.out_dir = out_dir
        self.errors_dir = errors_dir
        self.responses = ColumnBuffer(RESPONSES_SCHEMA)
        self.errors = ColumnBuffer(ERRORS_SCHEMA)
        self._next_resp = shards.next_part_index(out_dir)
        self._next_err = shards.next_part_index(errors_dir)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="eagle-shard-writer")
        self._pending: list[concurrent.futures.Future[None]] = []
        self._max_pending = max_pending_writes
        self.last_commit = time.monotonic()
        self.shards_written = 0
        self.write_error: BaseException | None = None
        self.log = AnswerLog(out_dir, answer_log_s) if answer_log_s is not None else None

    def add_response(self, values: tuple[Any, ...]) -> None:
        """Buffer (and log) one responses row given as values in schema order."""
        self.responses.append_values(values)
        if self.log is not None:
            self.log.append(RESPONSE_ROW, dict(zip(RESPONSE_COLUMNS, values)))

    def add_error(self, row: dict[str, Any]) -> None:
        """Buffer (and log) one errors row."""
        self.errors.append(row)
        if self.log is not None:
            self.log.append(ERROR_ROW, row)

    def buffered(self) -> bool:
        """Whether any row waits to be committed."""
        return bool(len(self.responses) or len(self.errors))

    def _written(self, f: concurrent.futures.Future[None]) -> None:
        exc = f.exception()
        if exc is not None and self.write_error is None:
            self.write_error = exc

    def _check(self) -> None:
        log_error = self.log.error if self.log is not None else None
        for what, exc in (("a shard", self.write_error), ("the answer log", log_error)):
            if exc is not None:
                raise RuntimeError(f"writing {what} failed: {type(exc).__name__}: {exc}") from exc

    def _submit(self) -> list[concurrent.futures.Future[None]]:
        t = self.responses.take()
        e = self.errors.take()
        # The segment ends with the buffers taken: it holds exactly this commit's rows (both happen on the loop).
        seg = self.log.rotate() if self.log is not None else None
        self.last_commit = time.monotonic()
        if t is None and e is None:
            return []
        resp_index = err_index = None
        if t is not None:
            resp_index, self._next_resp = self._next_resp, self._next_resp + 1
            self.shards_written += 1
        if e is not None:
            err_index, self._next_err = self._next_err, self._next_err + 1
        fut = self._pool.submit(self._commit, t, resp_index, e, err_index, seg)
        fut.add_done_callback(self._written)
        return [fut]

    def _commit(
        self,
        responses: pa.Table | None,
        resp_index: int | None,
        errors: pa.Table | None,
        err_index: int | None,
        segment: Segment | None,
    ) -> None:
        """One commit, on the writer thread: its shards, then (only once both are durable) its log segment goes."""
        if responses is not None and resp_index is not None:
            shards.write_shard(responses, self.out_dir, resp_index)
        if errors is not None and err_index is not None:
            shards.write_shard(errors, self.errors_dir, err_index)
        if segment is not None and self.log is not None:
            self.log.release(segment)

    def commit_nowait(self) -> None:
        """Submit a commit without waiting (sync callers; close() waits for every write)."""
        self._check()
        self._pending.extend(self._submit())

    async def commit(self) -> None:
        """Commit what is buffered; wait only when more than `max_pending_writes` writes are queued."""
        self._check()
        self._pending.extend(self._submit())
        # Back-pressure: if the disk is slower than generation, wait instead of piling tables up in memory.
        while len(self._pending) > self._max_pending:
            await _settled([self._pending.pop(0)])
        self._pending = [f for f in self._pending if not f.done()]
        self._check()

    async def close(self) -> None:
        """Commit what is buffered and wait for every write; raise if any write failed (the rows of a failed commit
        stay in the answer log)."""
        try:
            futs = self._pending + self._submit()
            if futs:
                await _settled(futs)
        finally:
            self._pending = []
            self._pool.shutdown(wait=True)
            if self.log is not None:
                self.log.close()
        self._check()


async def _settled(futs: list[concurrent.futures.Future[None]]) -> None:
    """Wait for writes to end, failed or not (a failure is reported by `_check`, from `write_error`). Unlike gather,
    asyncio.wait never cancels a queued write when the waiter is cancelled."""
    done, _ = await asyncio.wait([asyncio.wrap_future(f) for f in futs])
    for d in done:
        d.exception()  # retrieved here so that asyncio does not log it as never retrieved
