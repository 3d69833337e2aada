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
import contextlib
import fcntl
import heapq
import io
import json
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
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
    shard_stem,
    tensor_key,
)
from .layers import (
    aux_layer_to_hf_index,
    aux_layer_to_vllm_id,
    default_aux_layers,
    final_state_hf_index,
    validate_aux_layers,
)
from .merged import count_rows, read_rows, shard_row_range
from .shards import ShardSummary, prepare_shard

# error_class values of this path, beside generation's (a RequestFailure either way).
FINAL_LAYER_MISSING = "final_layer_missing"
LAYER_COUNT = "layer_count"
PROMPT_IDS_MISMATCH = "prompt_ids_mismatch"
NO_KV_TRANSFER = "no_kv_transfer_params"
INVALID_STATES = "invalid_hidden_states"
SIMULATED = "simulated"

# The vLLM bug that drops id L on this backbone (docs/hidden_states.md §10): named in the refusal.
DROPPED_FINAL_LAYER_BUG = (
    "vLLM PR #46973 (merged 2026-06-28): vLLM >= 0.18 builds without it drop the final id (num_hidden_layers) on the "
    "DeepSeek-V2 backbone (DeepSeek-V3, Kimi-K2/K2.5, GLM-MoE), returning N - 1 layers. Run a vLLM build that "
    "contains that fix (pin it; Model-Optimizer pins v0.22.0) and restart the server"
)


class EngineShardError(RuntimeError):
    """A shard could not be extracted through the engine; the message names the shard, row, sample and endpoint."""


def vllm_layer_ids(aux_layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """vLLM's `eagle_aux_hidden_state_layer_ids` for project aux layers (k -> k + 1) plus the final id L."""
    aux = validate_aux_layers(aux_layers, num_layers)
    if list(aux) != sorted(aux):
        raise ValueError(f"aux layers {list(aux)} must be ascending for the vllm engine (its file follows id order)")
    ids = [aux_layer_to_vllm_id(k) for k in aux]
    if num_layers in ids:
        raise ValueError(
            f"aux layer {num_layers - 1} (the last decoder layer) is vLLM id {num_layers}, the final state itself; "
            "choose a lower aux layer"
        )
    return (*ids, num_layers)


@dataclass(frozen=True)
class FileFacts:
    tokens: int
    hidden_size: int
    dtype: torch.dtype


def validate_states_file(
    path: str | os.PathLike, ids: Sequence[int], layer_ids: Sequence[int], *, hidden_size: int | None = None
) -> FileFacts:
    """Check one connector file against what was asked: `hidden_states` [len(ids), len(layer_ids), H], finite, no
    all-zero position or layer, `token_ids == ids`. Raises a non-retryable RequestFailure saying what is wrong."""
    from safetensors import safe_open

    n_ids, t_want = len(layer_ids), len(ids)
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        if not {"hidden_states", "token_ids"} <= keys:
            raise RequestFailure(
                INVALID_STATES, f"{path}: tensors {sorted(keys)}, need hidden_states and token_ids", False
            )
        hs = f.get_tensor("hidden_states")
        tok = f.get_tensor("token_ids")

    def bad(cls: str, msg: str) -> RequestFailure:
        return RequestFailure(cls, f"{path}: {msg}", False)

    if hs.ndim != 3 or not hs.is_floating_point():
        raise bad(INVALID_STATES, f"hidden_states {hs.dtype} {tuple(hs.shape)}, expected a float [T, {n_ids}, H]")
    t, n, h = hs.shape
    if n == n_ids - 1:
        raise bad(
            FINAL_LAYER_MISSING,
            f"{n} layers for the {n_ids} layer ids {list(layer_ids)}: the final id {layer_ids[-1]} is missing. "
            + DROPPED_FINAL_LAYER_BUG,
        )
    if n != n_ids:
        raise bad(
            LAYER_COUNT,
            f"{n} layers, expected {n_ids} for layer ids {list(layer_ids)}: the server was "
            "started with other eagle_aux_hidden_state_layer_ids (print them with `eagle-pipeline vllm-command`)",
        )
    if hidden_size is not None and h != hidden_size:
        raise bad(INVALID_STATES, f"hidden size {h}, expected {hidden_size}: the server runs another model")
    if t != t_want:
        raise bad(
            INVALID_STATES,
            f"states for {t} positions, {t_want} sent (short by {t_want - t}): prefix caching on? start the server "
            "with --no-enable-prefix-caching --no-enable-chunked-prefill",
        )
    if tok.shape != (t_want,) or not torch.equal(tok.to(torch.int64), torch.as_tensor(list(ids), dtype=torch.int64)):
        raise bad(INVALID_STATES, "token_ids in the file differ from the ids sent")
    top = _max_magnitude_bits(hs)  # [T, n]: the largest |x| of each state vector, as IEEE bits
    inf_bits = _FLOAT_BITS[hs.dtype][2] if hs.dtype in _FLOAT_BITS else None
    if inf_bits is None:
        nonfinite = int((~torch.isfinite(hs)).sum())
    else:  # Inf and NaN are the bit patterns at and above the exponent mask
        nonfinite = int((top >= inf_bits).sum())
    if nonfinite:
        raise bad(INVALID_STATES, f"{nonfinite} state vectors with NaN/Inf")
    zero = top == 0  # a position whose state in a layer is all (+-)zero
    if bool(zero.any()):
        layers = [int(layer_ids[int(j)]) for j in np.flatnonzero(zero.any(0))]
        raise bad(INVALID_STATES, f"{int(zero.sum())} all-zero state vectors (layer ids {layers})")
    return FileFacts(t, h, hs.dtype)


# dtype -> (unsigned view, magnitude mask, bits of +Inf): one integer reduction checks finiteness and zeros together
# (about 7x faster than torch.isfinite on bf16 CPU tensors; docs/hidden_states.md §12).
_FLOAT_BITS = {
    torch.bfloat16: (np.uint16, 0x7FFF, 0x7F80),
    torch.float16: (np.uint16, 0x7FFF, 0x7C00),
    torch.float32: (np.uint32, 0x7FFFFFFF, 0x7F800000),
}


def _max_magnitude_bits(hs: torch.Tensor) -> np.ndarray:
    """Per state vector (last axis), the maximum of |x| as its IEEE bit pattern (order-preserving for |x|)."""
    if hs.dtype not in _FLOAT_BITS:
        return hs.abs().nan_to_num(nan=float("inf")).amax(-1).numpy()
    view, mask, _ = _FLOAT_BITS[hs.dtype]
    bits: Any = hs.contiguous().view(torch.int16 if view is np.uint16 else torch.int32).numpy().view(view)
    return (bits & mask).max(axis=-1)


def _server_path(returned: str, storage_path: Path) -> Path:
    """Where this process sees the file the server named: as given when it lies under `storage_path`, else the same
    name under `storage_path` (the server mounts the shared volume elsewhere)."""
    p = Path(returned)
    try:
        p.relative_to(storage_path)
        return p
    except ValueError:
        return storage_path / p.name


def _journal_path(out_dir: Path, shard_index: int) -> Path:
    # Lists the connector files a run of this shard received, so a run after kill -9 can delete them.
    return out_dir / f".{shard_stem(shard_index)}.vllm-requests"


def _delete_request_files(paths: Sequence[Path]) -> None:
    for p in paths:
        p.unlink(missing_ok=True)
        Path(f"{p}.lock").unlink(missing_ok=True)


def _clean_journal(journal: Path) -> None:
    if journal.exists():
        _delete_request_files([Path(x) for x in journal.read_text().split("\n") if x])
        journal.unlink()


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
                    _delete_request_files([row.path])
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
        path = _server_path(returned, self.storage_path) if isinstance(returned, str) and returned else None
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
        await _wait_for_lock(path, deadline, self.timeout_s)
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


async def _wait_for_lock(path: Path, deadline: float, timeout_s: float) -> None:
    """Wait until no one holds the connector's `{path}.lock` (polls LOCK_EX | LOCK_NB, as speculators does)."""
    lock = f"{path}.lock"
    while True:
        try:
            fd = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:
            return  # a connector without the lock: the file check that follows waits for the file itself
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
        if time.monotonic() >= deadline:
            raise RequestFailure(F.TIMEOUT, f"{lock} still locked {timeout_s:g} s after the response", True)
        await asyncio.sleep(0.005)


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
    journal_path = _journal_path(out_dir, shard_index)
    out_dir.mkdir(parents=True, exist_ok=True)
    _clean_journal(journal_path)  # files of a run killed before it could delete them
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
        with open(journal_path, "a") as journal:
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
                    journal=journal,
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
            _delete_request_files(run.received)
        journal_path.unlink(missing_ok=True)
    return summary


@contextlib.contextmanager
def resolved_endpoints(
    endpoints: Sequence[str],
    *,
    storage_path: str | Path,
    model: str,
    family: str,
    seed: int,
    vocab_size: int,
    layer_ids: Sequence[int],
) -> Iterator[list[str]]:
    """`endpoints` with `simulated` replaced by a loopback double of the vLLM server (the demo and tests) serving
    the tiny model `hidden_states.model: tiny-random` would build in process."""
    if SIMULATED not in endpoints:
        yield list(endpoints)
        return
    from .runtime import TINY_RANDOM, load_extraction_model
    from .vllm_double import VLLMHiddenStatesDouble

    if model != TINY_RANDOM:
        raise ValueError(f"hidden_states.vllm.endpoints: 'simulated' serves tiny-random only, model is {model!r}")
    tiny = load_extraction_model(model, family=family, seed=seed, vocab_size=vocab_size, device="cpu")
    with VLLMHiddenStatesDouble(tiny, layer_ids=layer_ids, storage_path=storage_path) as double:
        yield [double.url if e == SIMULATED else e for e in endpoints]


def describe_engine_model(model: str, *, family: str, vocab_size: int) -> dict[str, Any]:
    """Shape of the model the servers run, from its config only (no weights): `tiny-random` or a directory (or
    config.json) of the target."""
    from .model import describe_model_config, load_text_config, tiny_config
    from .runtime import TINY_RANDOM

    if model == TINY_RANDOM:
        return describe_model_config(tiny_config(vocab_size, family=family))
    return describe_model_config(load_text_config(model))


def extract_shard_from_config(
    h: Any,
    *,
    merged_dir: Path,
    out_dir: Path,
    shard_index: int,
    vocab_size: int,
    log: Callable[[str], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[ShardSummary, str]:
    """One shard through the engine `hidden_states.engine` names (`h` is the `hidden_states` config section), for
    the Dagster asset. Returns the summary and where it ran."""
    from .runtime import fingerprint_for_config

    if h.engine != "vllm":
        raise ValueError(f"hidden_states.engine {h.engine!r} is not an HTTP engine")
    v = h.vllm
    wanted = fingerprint_for_config(h, merged_dir=merged_dir, vocab_size=vocab_size)
    desc = describe_engine_model(h.model, family=h.family, vocab_size=vocab_size)
    n_layers = int(desc["num_layers"])
    aux = h.aux_layers if h.aux_layers is not None else default_aux_layers(n_layers)
    ids = vllm_layer_ids(aux, n_layers)
    with resolved_endpoints(
        v.endpoints,
        storage_path=v.storage_path,
        model=h.model,
        family=h.family,
        seed=h.seed,
        vocab_size=vocab_size,
        layer_ids=ids,
    ) as endpoints:
        summary = extract_shard_vllm(
            merged_dir,
            shard_index=shard_index,
            shard_size=h.shard_size,
            out_dir=out_dir,
            endpoints=endpoints,
            storage_path=v.storage_path,
            num_layers=n_layers,
            aux_layers=aux,
            hidden_size=int(desc["hidden_size"]),
            model_description=desc,
            fingerprint=wanted,
            on_mismatch=h.on_settings_change,
            concurrency=v.concurrency,
            timeout_s=v.timeout_s,
            max_retries=v.max_retries,
            log=log,
            progress=progress,
        )
    return summary, "vllm: " + ", ".join(v.endpoints)


# Model-Optimizer's Kimi-K2.5 recipe: cold MoE kernels stall the first steps past vLLM's default timeouts.
COLD_START_ENV = {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1200", "VLLM_ENGINE_ITERATION_TIMEOUT_S": "1200"}
_DEEPSEEK_BACKBONE = {"deepseek_v3", "deepseek_v2", "kimi_k2", "kite_text"}


@dataclass(frozen=True)
class ServeCommand:
    """`vllm serve` for extraction: the environment and the argument vector (one source for the CLI and deploy/)."""

    env: dict[str, str]
    argv: list[str]

    def shell(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        args = " \\\n  ".join(_pairs(self.argv))
        return f"{env} \\\n{args}" if env else args


def _pairs(argv: list[str]) -> list[str]:
    """Shell-quoted lines: `vllm serve MODEL` on the first, then each `--flag [value]` on its own."""
    import shlex

    out: list[str] = [" ".join(shlex.quote(a) for a in argv[:3])]
    for a in argv[3:]:
        if a.startswith("--"):
            out.append(a)
        else:
            out[-1] += " " + shlex.quote(a)
    return out


def vllm_serve_command(
    served_model: str,
    *,
    layer_ids: Sequence[int],
    storage_path: str,
    tensor_parallel_size: int = 8,
    port: int = 8000,
    model_type: str = "",
) -> ServeCommand:
    """The exact server command: the extract_hidden_states speculative config with `layer_ids`, the connector
    writing to `storage_path`, prefix caching and chunked prefill off (short states otherwise), remote code on,
    and, for the DeepSeek/Kimi backbone, Model-Optimizer's cold-start knobs."""
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [int(k) for k in layer_ids]}},
    }
    kv = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": storage_path},
    }
    argv = [
        "vllm",
        "serve",
        served_model,
        "--tensor-parallel-size",
        str(tensor_parallel_size),
        "--port",
        str(port),
        "--trust-remote-code",
        "--speculative-config",
        json.dumps(spec),
        "--kv-transfer-config",
        json.dumps(kv),
        "--no-enable-prefix-caching",
        "--no-enable-chunked-prefill",
    ]
    deepseek = model_type in _DEEPSEEK_BACKBONE
    if deepseek:
        argv += ["--enforce-eager", "--no-enable-flashinfer-autotune"]
    return ServeCommand(env=dict(COLD_START_ENV) if deepseek else {}, argv=argv)


def serve_command_from_config(
    h: Any, *, served_model: str | None, vocab_size: int, tensor_parallel_size: int = 8, port: int = 8000
) -> ServeCommand:
    """`vllm_serve_command` for the `hidden_states` config section: its model's layers, aux layers, storage path."""
    from .runtime import TINY_RANDOM

    desc = describe_engine_model(h.model, family=h.family, vocab_size=vocab_size)
    n_layers = int(desc["num_layers"])
    aux = h.aux_layers if h.aux_layers is not None else default_aux_layers(n_layers)
    model = served_model or (h.model if h.model != TINY_RANDOM else None)
    if model is None:
        raise ValueError("hidden_states.model is tiny-random: name the model the server loads (--served-model)")
    return vllm_serve_command(
        model,
        layer_ids=vllm_layer_ids(aux, n_layers),
        storage_path=h.vllm.storage_path,
        tensor_parallel_size=tensor_parallel_size,
        port=port,
        model_type=str(desc["model_type"]),
    )


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
        _delete_request_files(run.received)
