"""The sink for committed rows: buffers responses and errors, and commits them as numbered shards.

Writes run on one writer thread so that they never block the event loop; a rerun finds the committed shards through
`store.committed_sample_ids` and requests only what they lack (exactly once).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from pathlib import Path

from eagle_pipeline.generation import store
from eagle_pipeline.generation.rows import ERRORS_SCHEMA, RESPONSES_SCHEMA, ColumnBuffer


class ShardSink:
    """Buffers rows and commits them as numbered shards on one writer thread.

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
        self._pending: list[concurrent.futures.Future[Path]] = []
        self._max_pending = max_pending_writes
        self.last_commit = time.monotonic()
        self.shards_written = 0
        self.write_error: BaseException | None = None

    def buffered(self) -> bool:
        """Whether any row waits to be committed."""
        return bool(len(self.responses) or len(self.errors))

    def _written(self, f: concurrent.futures.Future[Path]) -> None:
        exc = f.exception()
        if exc is not None and self.write_error is None:
            self.write_error = exc

    def _check(self) -> None:
        if self.write_error is not None:
            raise RuntimeError(
                f"writing a shard failed: {type(self.write_error).__name__}: {self.write_error}"
            ) from self.write_error

    def _submit(self) -> list[concurrent.futures.Future[Path]]:
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
        """Commit what is buffered; wait only when more than `max_pending_writes` writes are queued."""
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
