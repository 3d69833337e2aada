"""Hidden states from running vLLM `extract_hidden_states` servers: shard runs are HTTP clients, never model loads.

For every merged row of a shard: `POST {endpoint}/v1/completions` with the row's exact ids as the prompt,
`max_tokens: 1`, `return_token_ids: true`; the returned `prompt_token_ids` must equal the ids; the connector's file
(`kv_transfer_params.hidden_states_path`) is read once its `{path}.lock` is free, validated, and copied into the
project's shard (hidden_states/format.py: same file, index and checks as the in-process extractor). A per-request
file is deleted as soon as it is copied into the shard's temporary file, the rest when the shard ends; at most
2 x concurrency x endpoints rows are fetched ahead of the copy. Layer ids: project aux layer k is vLLM id k + 1; the final state is
vLLM id L (`num_hidden_layers`), the last layer's output **before** the final norm.
"""

from __future__ import annotations

import asyncio
import heapq
import io
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..generation import failures as F
from ..generation.client import HttpClient
from ..generation.failures import RequestFailure
from ..generation.runner import run_coroutine
from ..storage import atomic_path
from .extract import IDS_DTYPE, MASK_DTYPE, _transformers_version, _write_shard_index
from .fingerprint import ExtractionFingerprint, merged_version
from .format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    StreamingSafetensorsWriter,
    dtype_name,
    shard_layout,
    shard_paths,
    tensor_key,
)
from .layers import (
    aux_layer_to_hf_index,
    default_aux_layers,
    final_state_hf_index,
    validate_aux_layers,
)
from .merged import count_rows, read_rows, shard_row_range
from .shards import ShardSummary, prepare_shard
from .vllm_files import (
    NO_KV_TRANSFER,
    PROMPT_IDS_MISMATCH,
    EngineShardError,
    FileFacts,
    clean_journal,
    delete_request_files,
    journal_path,
    server_file_path,
    validate_states_file,
    vllm_layer_ids,
    wait_for_lock,
)


@dataclass
class _Row:
    path: Path | None = None
    facts: FileFacts | None = None


class _ShardRun:
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
        write_row: Callable[[int, Path, FileFacts], None],
        log: Callable[[str], None] | None,
        progress: Callable[[int, int], None] | None,
    ) -> None:
        self.rows, self.shard_index = rows, shard_index
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.storage_path, self.layer_ids, self.hidden_size = storage_path, layer_ids, hidden_size
        self.concurrency, self.timeout_s, self.max_retries = concurrency, timeout_s, max_retries
        self.backoff_base_s = backoff_base_s
        self.journal, self.write_row, self.log, self.progress = journal, write_row, log, progress
        self.results: list[_Row] = [_Row() for _ in range(len(rows))]
        self.attempts = [0] * len(rows)
        self.received: list[Path] = []
        # Rows fetched ahead of the writer are files on the connector's storage (often /dev/shm, i.e. RAM): a slow
        # row must not let the rest of the shard pile up behind it. Copied rows' files are deleted at once.
        self.window = 2 * concurrency * len(self.endpoints)
        self.written = 0
        self.retries = 0
        self.compute_seconds = 0.0
        self.write_seconds = 0.0
        self._rng = random.Random(shard_index)

    def _where(self, i: int) -> str:
        return f"shard {self.shard_index:05d}, merged row {self.rows.row_start + i} ({self.rows.sample_ids[i]})"

    def _backoff(self, attempt: int, f: RequestFailure) -> float:
        if f.retry_after_s is not None:
            return f.retry_after_s
        return self._rng.uniform(0.5, 1.0) * self.backoff_base_s * 2 ** (attempt - 1)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        self.pending = list(range(len(self.rows)))  # a heap: the lowest row first, retries included
        self.ready = [loop.create_future() for _ in range(len(self.rows))]
        self.fatal: asyncio.Future[None] = loop.create_future()
        self._advanced = asyncio.Condition()
        self._pushes: set[asyncio.Future[None]] = set()  # retries being put back (kept referenced until done)
        n_conn = self.concurrency * len(self.endpoints)
        async with HttpClient(concurrency=n_conn, timeout_s=self.timeout_s) as client:
            workers = [
                asyncio.create_task(self._worker(client, ep)) for ep in self.endpoints for _ in range(self.concurrency)
            ]
            try:
                for i in range(len(self.rows)):
                    await asyncio.wait({self.ready[i], self.fatal}, return_when=asyncio.FIRST_COMPLETED)
                    if self.fatal.done():
                        self.fatal.result()
                    self.compute_seconds = time.perf_counter() - t0
                    row = self.results[i]
                    assert row.path is not None and row.facts is not None
                    tw = time.perf_counter()
                    await asyncio.to_thread(self.write_row, i, row.path, row.facts)
                    # Copied into the shard's temporary file: no run ever reads it again (a shard that does not
                    # commit is redone from its first request), so it leaves the connector's storage now.
                    delete_request_files([row.path])
                    self.write_seconds += time.perf_counter() - tw
                    async with self._advanced:
                        self.written = i + 1
                        self._advanced.notify_all()
                    if self.progress is not None:
                        self.progress(i + 1, len(self.rows))
            finally:
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)

    def _requeue(self, i: int) -> None:
        async def push() -> None:
            async with self._advanced:
                heapq.heappush(self.pending, i)
                self._advanced.notify_all()

        self._pushes.add(task := asyncio.ensure_future(push()))
        task.add_done_callback(self._pushes.discard)

    async def _worker(self, client: HttpClient, endpoint: str) -> None:
        consecutive = 0
        while True:
            async with self._advanced:
                await self._advanced.wait_for(
                    lambda: bool(self.pending) and self.pending[0] < self.written + self.window
                )
                i = heapq.heappop(self.pending)
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
                if self.log is not None:
                    self.log(f"retrying {where}")
                asyncio.get_running_loop().call_later(self._backoff(attempt, f), self._requeue, i)
                if f.error_class in (F.CONNECTION, F.SERVER_ERROR, F.TIMEOUT):
                    consecutive += 1  # an endpoint that keeps failing slows down; others take its rows
                    await asyncio.sleep(min(self.backoff_base_s * 2 ** (consecutive - 1), 60.0))
            except Exception as exc:  # a bug or a local I/O error: stop the shard rather than wait for this row
                if not self.fatal.done():
                    where = f"{self._where(i)} (endpoint {endpoint}, attempt {attempt})"
                    self.fatal.set_exception(EngineShardError(f"{where}: {type(exc).__name__}: {exc}"))
                return

    async def _one(self, client: HttpClient, endpoint: str, i: int) -> _Row:
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
        facts = await self._validated(path, ids, deadline)
        return _Row(path, facts)

    async def _validated(self, path: Path, ids: list[int], deadline: float) -> FileFacts:
        """Wait for the file to exist and be readable (it may appear late or still be growing), then validate."""
        while True:
            if path.exists():
                try:
                    return await asyncio.to_thread(
                        validate_states_file, path, ids, self.layer_ids, hidden_size=self.hidden_size
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


def extract_shard_vllm(
    merged_dir: str | Path,
    *,
    shard_index: int,
    shard_size: int,
    out_dir: str | Path,
    endpoints: Sequence[str],
    storage_path: str | Path,
    num_layers: int,
    aux_layers: Sequence[int] | None = None,
    hidden_size: int | None = None,
    model_description: dict[str, Any] | None = None,
    concurrency: int = 8,
    timeout_s: float = 600.0,
    max_retries: int = 4,
    backoff_base_s: float = 2.0,
    fingerprint: ExtractionFingerprint | None = None,
    on_mismatch: str = "refuse",
    force: bool = False,
    log: Callable[[str], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ShardSummary:
    """Extract shard `shard_index` through vLLM servers into `out_dir/shard-NNNNN.safetensors` + `.index.parquet`.

    `num_layers` is the target's decoder-layer count (L: the final id); `aux_layers` are in the project's convention
    (default low/mid/high). `fingerprint` (engine 'vllm', final state 'pre_norm', dtype not pinned: the servers')
    is recorded with the shard; by default it names the model by `model_description`. A done shard with that
    fingerprint is skipped (unless `force`); one extracted under other settings is refused or, with
    `on_mismatch='redo'`, moved aside (`shards.prepare_shard`); anything else is redone from the start. A transient
    failure (5xx, timeout, connection, a lock not freed in `timeout_s`, a file not there) is retried up to
    `max_retries` times, on whichever endpoint is free; an invalid file or answer stops the shard with an
    `EngineShardError` naming the shard, row, sample and endpoint, and writes nothing.
    """
    if not endpoints:
        raise ValueError("hidden_states.vllm.endpoints is empty")
    out_dir, storage = Path(out_dir), Path(storage_path)
    st_path, idx_path = shard_paths(out_dir, shard_index)
    n_rows = count_rows(merged_dir)
    row_start, row_stop = shard_row_range(shard_index, shard_size, n_rows)
    journal = journal_path(out_dir, shard_index)
    out_dir.mkdir(parents=True, exist_ok=True)
    clean_journal(journal)  # files of a run killed before it could delete them
    aux = validate_aux_layers(aux_layers if aux_layers is not None else default_aux_layers(num_layers), num_layers)
    wanted = fingerprint or ExtractionFingerprint(
        model=dict(model_description or {}),
        aux_layers=aux,
        final_state="pre_norm",
        shard_size=shard_size,
        dtype=None,
        merged_version=merged_version(merged_dir),
        engine="vllm",
    )
    if (wanted.engine, wanted.final_state, tuple(wanted.aux_layers)) != ("vllm", "pre_norm", aux):
        raise ValueError(f"fingerprint {wanted.to_dict()} is not one of this engine's shards (aux layers {aux})")
    decision = prepare_shard(out_dir, shard_index, wanted, on_mismatch=on_mismatch, force=force)
    if decision.reuse is not None:
        return decision.reuse

    layer_ids = vllm_layer_ids(aux, num_layers)
    n_aux = len(aux)
    rows = read_rows(merged_dir, row_start, row_stop)
    lengths = rows.lengths
    order = list(range(len(rows)))
    meta_common = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "aux_layers": json.dumps(list(aux)),
        "aux_layers_convention": "0-based decoder-layer outputs",
        "hf_hidden_states_indices": json.dumps([aux_layer_to_hf_index(x, num_layers) for x in aux]),
        "hf_hidden_states_final_index": json.dumps(final_state_hf_index(num_layers, post_norm=False)),
        "final_state_is_post_norm": json.dumps(False),
        "engine": "vllm",
        "vllm_layer_ids": json.dumps(list(layer_ids)),
        "vllm_layer_ids_convention": "id k = residual entering decoder layer k (= output of layer k-1); "
        "aux layer k -> id k+1; the final state is id num_hidden_layers, the last layer's output before the "
        "final norm (apply the target's final norm for lm_head targets)",
        "ids_dtype": dtype_name(IDS_DTYPE),
        "mask_dtype": dtype_name(MASK_DTYPE),
        "shard_index": str(shard_index),
        "row_start": str(row_start),
        "row_stop": str(row_stop),
        "rows": str(len(rows)),
        "tokens": str(sum(lengths)),
        "model": json.dumps(model_description or {}, sort_keys=True),
        "fingerprint": json.dumps(wanted.to_dict(), sort_keys=True),
        "torch_version": torch.__version__,
        "transformers_version": _transformers_version(),
    }
    state: dict[str, Any] = {}

    def write_row(i: int, path: Path, facts: FileFacts) -> None:
        from safetensors import safe_open

        if "writer" not in state:  # the first file fixes H and the dtype of the whole shard
            state["facts"] = facts
            meta = {**meta_common, "hidden_size": str(facts.hidden_size), "dtype": dtype_name(facts.dtype)}
            layout = shard_layout(
                rows.sample_ids,
                lengths,
                order,
                n_aux=n_aux,
                hidden=facts.hidden_size,
                state_dtype=facts.dtype,
                ids_dtype=IDS_DTYPE,
                mask_dtype=MASK_DTYPE,
            )
            state["writer"] = StreamingSafetensorsWriter(state["fh"], layout, meta)
        first: FileFacts = state["facts"]
        if (facts.hidden_size, facts.dtype) != (first.hidden_size, first.dtype):
            raise EngineShardError(
                f"shard {shard_index:05d}, merged row {row_start + i} ({rows.sample_ids[i]}): {path} holds "
                f"{facts.dtype} H={facts.hidden_size}, the shard's first file {first.dtype} H={first.hidden_size}: "
                "the endpoints serve different models"
            )
        with safe_open(str(path), framework="pt") as f:
            hs = f.get_tensor("hidden_states")
        t, sid, w = facts.tokens, rows.sample_ids[i], state["writer"]
        w.write(tensor_key(sid, "aux_hidden_states"), hs[:, :n_aux].reshape(t, n_aux * facts.hidden_size))
        w.write(tensor_key(sid, "final_hidden_state"), hs[:, n_aux])
        w.write(tensor_key(sid, "input_ids"), torch.from_numpy(rows.input_ids[i]))

    t0 = time.perf_counter()
    run: _ShardRun | None = None
    try:
        with open(journal, "a") as journal_file:
            with atomic_path(st_path) as tmp, open(tmp, "wb") as fh:
                state["fh"] = fh
                run = _ShardRun(
                    rows,
                    shard_index=shard_index,
                    endpoints=endpoints,
                    storage_path=storage,
                    layer_ids=layer_ids,
                    hidden_size=hidden_size,
                    concurrency=concurrency,
                    timeout_s=timeout_s,
                    max_retries=max_retries,
                    backoff_base_s=backoff_base_s,
                    journal=journal_file,
                    write_row=write_row,
                    log=log,
                    progress=progress,
                )
                run_coroutine(run.run)
                writer: StreamingSafetensorsWriter = state["writer"]
                for i in order:
                    writer.write(tensor_key(rows.sample_ids[i], "loss_mask"), torch.from_numpy(rows.loss_mask[i]))
                sha = writer.finish()
                size = writer.total_bytes
            seconds = time.perf_counter() - t0
            facts = state["facts"]
            tokens = sum(lengths)
            summary = ShardSummary(
                shard_index=shard_index,
                row_start=row_start,
                row_stop=row_stop,
                rows=len(rows),
                tokens=tokens,
                padded_tokens=0,
                padding_fraction=0.0,
                batches=len(rows),
                seconds=seconds,
                tokens_per_s=tokens / seconds if seconds > 0 else float("inf"),
                path=str(st_path),
                index_path=str(idx_path),
                sha256=sha,
                size_bytes=size,
                dtype=dtype_name(facts.dtype),
                aux_layers=list(aux),
                final_state_is_post_norm=False,
                n_nonfinite_samples=0,
                compute_seconds=run.compute_seconds,
                write_wait_seconds=run.write_seconds,
                fingerprint=wanted.to_dict(),
            )
            extra = {
                "engine": "vllm",
                "vllm_layer_ids": list(layer_ids),
                "vllm_endpoints": list(endpoints),
                "retries": run.retries,
            }
            nonfinite = np.zeros(len(rows), dtype=np.int64)  # refused above: a shard never holds NaN/Inf here
            model = model_description or {}
            _write_shard_index(idx_path, rows, summary, nonfinite, hidden=facts.hidden_size, model=model, extra=extra)
    finally:
        # Whatever is left (retried attempts' files; all of them after a failure): never reused, a rerun asks again.
        if run is not None:
            delete_request_files(run.received)
        journal.unlink(missing_ok=True)
    return summary


def smoke_request(
    endpoint: str,
    *,
    storage_path: str | Path,
    ids: Sequence[int],
    layer_ids: tuple[int, ...],
    hidden_size: int | None,
    timeout_s: float = 600.0,
) -> FileFacts:
    """One request exactly as a shard run sends it, its file validated and then deleted; raises RequestFailure."""
    from .merged import MergedRows

    row = np.asarray(list(ids), dtype=np.int32)
    rows = MergedRows(0, ["smoke"], ["smoke"], [row], [np.ones(len(row), dtype=np.int8)])
    run = _ShardRun(
        rows,
        shard_index=0,
        endpoints=[endpoint],
        storage_path=Path(storage_path),
        layer_ids=layer_ids,
        hidden_size=hidden_size,
        concurrency=1,
        timeout_s=timeout_s,
        max_retries=0,
        backoff_base_s=0.0,
        journal=io.StringIO(),
        write_row=lambda *_: None,
        log=None,
        progress=None,
    )

    async def one() -> FileFacts:
        async with HttpClient(concurrency=1, timeout_s=timeout_s) as client:
            result = await run._one(client, endpoint.rstrip("/"), 0)
        assert result.facts is not None
        return result.facts

    try:
        return run_coroutine(one)
    finally:
        delete_request_files(run.received)
