"""The requests of one vLLM shard run: rows spread over the endpoints from one heap, at most `concurrency` in flight
per endpoint, transient failures retried with the shared failure classes (on another endpoint while one has not
failed the row: a dead server's rows move to the others instead of spending their retries on it), each returned file
waited for (its lock), validated and handed on in row order."""

from __future__ import annotations

import asyncio
import heapq
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle_pipeline.hidden_states.engines.vllm.vllm_files import (
    NO_KV_TRANSFER,
    PROMPT_IDS_MISMATCH,
    ConnectorFile,
    EngineShardError,
    delete_request_files,
    server_file_path,
    validate_states_file,
    wait_for_lock,
)
from eagle_pipeline.shared import failures as F
from eagle_pipeline.shared.failures import RequestFailure
from eagle_pipeline.shared.http_client import HttpClient
from eagle_pipeline.shared.progress import ProgressCallback


def rows_ahead(concurrency: int, n_endpoints: int) -> int:
    """How many rows a shard run fetches ahead of its copy (so at most this many connector files are on the
    connector's storage at once, beside retried attempts' files until the shard ends): the disk plan's peak."""
    return 2 * concurrency * n_endpoints


@dataclass
class RowFile:
    path: Path | None = None
    file: ConnectorFile | None = None  # validated, its mapping held until the writer has copied it


class ShardRequests:
    """The async part: workers per endpoint pull rows, request, wait for the lock, validate; the writer copies in
    row order as files become ready."""

    def __init__(
        self,
        rows: Any,
        *,
        shard_index: int,
        endpoints: Sequence[str],
        storage_path: Path,
        layer_ids: tuple[int, ...],
        hidden_size: int | None,
        concurrency: int,
        timeout_s: float,
        max_retries: int,
        backoff_base_s: float,
        journal: Any,
        write_row: Callable[[int, ConnectorFile], None],
        log: Callable[[str], None] | None,
        progress: ProgressCallback | None,
        validate: Callable[..., ConnectorFile] = validate_states_file,
    ) -> None:
        self.rows, self.shard_index = rows, shard_index
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.storage_path, self.layer_ids, self.hidden_size = storage_path, layer_ids, hidden_size
        self.concurrency, self.timeout_s, self.max_retries = concurrency, timeout_s, max_retries
        self.backoff_base_s = backoff_base_s
        self.journal, self.write_row, self.log, self.progress = journal, write_row, log, progress
        # `validate(path, ids, layer_ids, hidden_size=)`: `vllm_files.validate_states_file`, or a trainer layout's
        # use of it (vllm_layouts.VllmLayoutRows.validate: the digest, FP8 quantization); the same RequestFailures.
        # Either way the file is read once: the writer gets the validated mapping.
        self.validate = validate
        self.results: list[RowFile] = [RowFile() for _ in range(len(rows))]
        self.attempts = [0] * len(rows)
        self.failed_on: dict[int, set[str]] = {}  # row -> the endpoints a transient failure of it came from
        self.received: list[Path] = []
        # Rows fetched ahead of the writer are files on the connector's storage (often /dev/shm, i.e. RAM): a slow
        # row must not let the rest of the shard pile up behind it. Copied rows' files are deleted at once.
        self.window = rows_ahead(concurrency, len(self.endpoints))
        self.written = 0
        self.retries = 0
        self.compute_seconds = 0.0
        self.write_seconds = 0.0
        self._rng = random.Random(shard_index)

    def _where(self, i: int) -> str:
        return f"shard {self.shard_index:05d}, merged row {self.rows.global_row(i)} ({self.rows.sample_ids[i]})"

    def _backoff(self, attempt: int, f: RequestFailure) -> float:
        if f.retry_after_s is not None:
            return f.retry_after_s
        return self._rng.uniform(0.5, 1.0) * self.backoff_base_s * 2 ** (attempt - 1)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        self.pending = list(range(len(self.rows)))  # a heap of the rows not yet requested: the lowest first
        self.retry: list[int] = []  # a heap of the rows to request again (always inside the window)
        self.ready = [loop.create_future() for _ in range(len(self.rows))]
        self.fatal: asyncio.Future[None] = loop.create_future()
        self._advanced = asyncio.Condition()
        self._pushes: set[asyncio.Future[None]] = set()  # retries being put back (kept referenced until done)
        n_conn = self.concurrency * len(self.endpoints)
        async with HttpClient(concurrency=n_conn, timeout_s=self.timeout_s) as client:
            workers = [
                asyncio.create_task(self._worker(client, ep)) for ep in self.endpoints for _ in range(self.concurrency)
            ]
            lengths = self.rows.lengths
            tokens_done, tokens_total = 0, int(sum(lengths))
            try:
                for i in range(len(self.rows)):
                    await asyncio.wait({self.ready[i], self.fatal}, return_when=asyncio.FIRST_COMPLETED)
                    if self.fatal.done():
                        self.fatal.result()
                    self.compute_seconds = time.perf_counter() - t0
                    row = self.results[i]
                    assert row.path is not None and row.file is not None
                    tw = time.perf_counter()
                    await asyncio.to_thread(self.write_row, i, row.file)
                    # Copied into the shard's temporary file: no run ever reads it again (a shard that does not
                    # commit is redone from its first request), so it leaves the connector's storage now.
                    row.file.close()
                    row.file = None
                    delete_request_files([row.path])
                    self.write_seconds += time.perf_counter() - tw
                    async with self._advanced:
                        self.written = i + 1
                        self._advanced.notify_all()
                    tokens_done += lengths[i]
                    if self.progress is not None:
                        self.progress(i + 1, len(self.rows), tokens_done, tokens_total)
            finally:
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                for row in self.results:  # validated, never written: the run failed
                    if row.file is not None:
                        row.file.close()
                        row.file = None

    def _may_retry_on(self, i: int, endpoint: str) -> bool:
        """A row goes back to an endpoint that failed it only once every endpoint has (or there is one)."""
        failed = self.failed_on.get(i, ())
        return endpoint not in failed or len(failed) >= len(self.endpoints)

    def _next_row(self, endpoint: str) -> int | None:
        """The row `endpoint` requests next: the lowest retry it may take, else the lowest new row in the window."""
        for i in sorted(self.retry):  # a handful at most: the failures of the rows in flight
            if self._may_retry_on(i, endpoint):
                return i
        if self.pending and self.pending[0] < self.written + self.window:
            return self.pending[0]
        return None

    def _take(self, endpoint: str) -> int:
        i = self._next_row(endpoint)
        assert i is not None
        if self.pending and self.pending[0] == i:
            return heapq.heappop(self.pending)
        self.retry.remove(i)
        heapq.heapify(self.retry)
        return i

    def _requeue(self, i: int) -> None:
        async def push() -> None:
            async with self._advanced:
                heapq.heappush(self.retry, i)
                self._advanced.notify_all()

        self._pushes.add(task := asyncio.ensure_future(push()))
        task.add_done_callback(self._pushes.discard)

    async def _worker(self, client: HttpClient, endpoint: str) -> None:
        consecutive = 0
        while True:
            async with self._advanced:
                await self._advanced.wait_for(lambda: self._next_row(endpoint) is not None)
                i = self._take(endpoint)
            self.attempts[i] += 1
            attempt = self.attempts[i]
            try:
                self.results[i] = await self._one(client, endpoint, i)
                self.ready[i].set_result(None)
                consecutive = 0
            except RequestFailure as f:
                where = f"{self._where(i)}: {f} (endpoint {endpoint}, attempt {attempt} of {self.max_retries + 1})"
                if not f.retryable or attempt > self.max_retries:
                    if not self.fatal.done():
                        self.fatal.set_exception(EngineShardError(where))
                    return
                self.retries += 1
                self.failed_on.setdefault(i, set()).add(endpoint)
                if self.log is not None:
                    self.log(f"retrying {where}")
                asyncio.get_running_loop().call_later(self._backoff(attempt, f), self._requeue, i)
                if f.error_class in (F.CONNECTION, F.UNREACHABLE, F.SERVER_ERROR, F.TIMEOUT):
                    consecutive += 1  # an endpoint that keeps failing slows down; others take its rows
                    await asyncio.sleep(min(self.backoff_base_s * 2 ** (consecutive - 1), 60.0))
            except Exception as exc:  # a bug or a local I/O error: stop the shard rather than wait for this row
                if not self.fatal.done():
                    where = f"{self._where(i)} (endpoint {endpoint}, attempt {attempt})"
                    self.fatal.set_exception(EngineShardError(f"{where}: {type(exc).__name__}: {exc}"))
                return

    async def _one(self, client: HttpClient, endpoint: str, i: int) -> RowFile:
        ids = self.rows.input_ids[i].tolist()
        body = json.dumps({"prompt": ids, "max_tokens": 1, "return_token_ids": True}).encode()
        status, body_or_none, retry_after = await client.post(f"{endpoint}/v1/completions", body)
        raw = body_or_none or b""
        if status != 200:
            raise F.classify_status(status, F.truncate(raw.decode("utf-8", "replace")), retry_after_s=retry_after)
        try:
            obj = json.loads(raw)
            choice = obj["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            raise RequestFailure(F.MALFORMED_BODY, F.truncate(raw.decode("utf-8", "replace")), True) from None
        kv = obj.get("kv_transfer_params") or {}
        returned = kv.get("hidden_states_path") if isinstance(kv, dict) else None
        path = server_file_path(returned, self.storage_path) if isinstance(returned, str) and returned else None
        if path is not None:  # noted before anything can fail, so every file received is cleaned up
            self.received.append(path)
            self.journal.write(f"{path}\n")
            self.journal.flush()
        got = choice.get("prompt_token_ids")
        if got is None:
            raise RequestFailure(
                F.MISSING_TOKEN_IDS,
                "no choices[0].prompt_token_ids: the server ignored return_token_ids (vLLM >= 0.10.2 is needed)",
                False,
            )
        if got != ids:
            first = next((k for k, (a, b) in enumerate(zip(got, ids)) if a != b), min(len(got), len(ids)))
            raise RequestFailure(
                PROMPT_IDS_MISMATCH,
                f"prompt_token_ids returned differ from the ids sent ({len(got)} vs {len(ids)} ids, first "
                f"difference at position {first}): the server changed the prompt, so its states are not this row's",
                False,
            )
        if path is None:
            raise RequestFailure(
                NO_KV_TRANSFER,
                "no kv_transfer_params.hidden_states_path in the response: the server was not started with "
                "--kv-transfer-config ExampleHiddenStatesConnector and the extract_hidden_states speculative config "
                "(print the command with `eagle-pipeline vllm-command`)",
                False,
            )
        deadline = time.monotonic() + self.timeout_s
        await wait_for_lock(path, deadline, self.timeout_s)
        return RowFile(path, await self._validated(path, ids, deadline))

    async def _validated(self, path: Path, ids: list[int], deadline: float) -> ConnectorFile:
        """Wait for the file to exist and be readable (it may appear late or still be growing), then validate."""
        while True:
            if path.exists():
                try:
                    return await asyncio.to_thread(
                        self.validate, path, ids, self.layer_ids, hidden_size=self.hidden_size
                    )
                except RequestFailure:
                    raise
                except Exception as exc:  # unreadable: a write still in progress, or a torn file
                    problem = f"{type(exc).__name__}: {exc}"
            else:
                problem = "does not exist"
            if time.monotonic() >= deadline:
                raise RequestFailure(F.TIMEOUT, f"{path}: {problem} {self.timeout_s:g} s after the response", True)
            await asyncio.sleep(0.01)
