"""vLLM's hidden-state connector as a client meets it: layer ids, the per-request file and its lock, validation.

The connector (`ExampleHiddenStatesConnector`) writes `{shared_storage_path}/{request id}.safetensors` holding
`hidden_states` [T, n_ids, H] and `token_ids` [T] int64, and holds an exclusive flock on `{path}.lock` until the write
is done. Each check names the file and what is wrong; the failure kinds below are error_class values beside
generation's (docs/hidden_states.md §10).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import mmap
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle_pipeline.hidden_states.models.layers import aux_layer_to_vllm_id, validate_aux_layers
from eagle_pipeline.hidden_states.store.format import sample_file_digest, shard_stem
from eagle_pipeline.shared import failures as F
from eagle_pipeline.shared.failures import RequestFailure

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


@dataclass
class ConnectorFile:
    """One validated connector file, read once: its tensors are views of one private mapping of it (`map_file`), so
    whatever follows (the copy into a shard, SpecForge's `.ckpt`, FP8 quantization, speculators' hand-off) reads
    those pages, never the file again. `digest`: XXH3-128 of its bytes (`format.sample_file_digest`) when asked for,
    computed in the same read. `close` once no tensor of it is held any more."""

    path: Path
    facts: FileFacts
    tensors: dict[str, torch.Tensor]
    buf: mmap.mmap
    amax: torch.Tensor  # fp32 [T, n_ids]: the largest |x| of each state vector, from the checks' own reduction
    digest: str | None = None

    @property
    def size(self) -> int:
        return len(self.buf)

    @property
    def states(self) -> torch.Tensor:
        return self.tensors["hidden_states"]

    def close(self) -> None:
        self.tensors = {}
        self.buf.close()


def validate_states_file(
    path: str | os.PathLike,
    ids: Sequence[int],
    layer_ids: Sequence[int],
    *,
    hidden_size: int | None = None,
    digest: bool = False,
) -> ConnectorFile:
    """The one check of a connector file, for every layout: map it once, parse its safetensors header
    (`safetensors_views`), then `hidden_states` [len(ids), len(layer_ids), H] in a float dtype the connector writes
    (not e4m3: see `check_states`), finite, no all-zero position or layer, `token_ids` int64 (what the connector
    writes and speculators reads) equal to `ids`. With `digest` the file's XXH3-128 comes from the same mapping
    (speculators' `hs_{i}` is the file as it is). Raises a non-retryable RequestFailure saying what is wrong; a file
    that cannot be mapped yet (still being written) raises OSError, which the caller retries."""
    path = Path(path)
    # On a refusal the mapping is left to go with the last view of it (the traceback's frames hold some).
    buf = map_file(path)
    # the digest first: one pass faults the pages in, and the checks below find them mapped
    digest_hex = sample_file_digest(buf) if digest else None
    t = safetensors_views(path, buf)
    if not {"hidden_states", "token_ids"} <= set(t):
        raise RequestFailure(INVALID_STATES, f"{path}: tensors {sorted(t)}, need hidden_states and token_ids", False)
    if t["token_ids"].dtype != torch.int64:
        raise RequestFailure(
            INVALID_STATES, f"{path}: token_ids are {t['token_ids'].dtype}, speculators reads int64", False
        )
    facts, top = _checked(path, t["hidden_states"], t["token_ids"], ids, layer_ids, hidden_size)
    return ConnectorFile(path, facts, t, buf, _magnitudes(top, facts.dtype), digest_hex)


def map_file(path: str | os.PathLike) -> mmap.mmap:
    """The whole file as a private mapping: its pages are read once from storage (or taken from the page cache the
    server's write left them in), never copied into a fresh buffer (a `readinto` costs ~4x the checks, page faults
    on new memory and a memcpy: docs/hidden_states.md §12). Writable copy-on-write so torch can view it."""
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:  # still being written, or torn: ask again (retryable)
            raise RequestFailure(INVALID_STATES, f"{path}: empty file", True)
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)


# safetensors dtype names of the tensors a connector file may hold (F8_E4M3: speculators' FP8 connector's).
_ST_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "I64": torch.int64,
    "I32": torch.int32,
}


def safetensors_views(path: str | os.PathLike, buf: mmap.mmap) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in `buf`, as views of it (no copy); a malformed file raises a
    RequestFailure naming it: retryable when the file is shorter than its header says (what a file still being
    written, or torn by a crash, looks like: the request is sent again), else not."""

    def bad(msg: str, short: bool = False) -> RequestFailure:
        return RequestFailure(INVALID_STATES, f"{path}: not a safetensors file ({msg})", short)

    if len(buf) < 8:
        raise bad(f"{len(buf)} bytes", short=True)
    n = int.from_bytes(buf[:8], "little")
    if n > len(buf) - 8:
        raise bad(f"header of {n} bytes in a file of {len(buf)}", short=True)
    try:
        header = json.loads(bytes(buf[8 : 8 + n]))
    except ValueError as exc:
        raise bad(f"header: {exc}") from exc
    if not isinstance(header, dict):
        raise bad(f"header {header!r}")
    base, out = 8 + n, {}
    for name, d in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(d, dict) or not {"dtype", "shape", "data_offsets"} <= set(d):
            raise bad(f"tensor {name}: entry {d!r}")
        dtype = _ST_DTYPES.get(d["dtype"])
        if dtype is None:
            raise bad(f"tensor {name} has dtype {d.get('dtype')}")
        start, stop = d["data_offsets"]
        numel = 1
        for s in d["shape"]:
            numel *= int(s)
        if stop - start != numel * dtype.itemsize:
            raise bad(f"tensor {name}: offsets {start}..{stop} for shape {d['shape']} {d['dtype']}")
        if base + stop > len(buf):
            raise bad(f"tensor {name}: offsets {start}..{stop} past the end of {len(buf)} bytes", short=True)
        flat = (
            torch.frombuffer(buf, dtype=dtype, count=numel, offset=base + start)
            if numel
            else torch.empty(0, dtype=dtype)
        )
        out[name] = flat.view([int(s) for s in d["shape"]])
    return out


def check_states(
    path: str | os.PathLike,
    hs: torch.Tensor,
    tok: torch.Tensor,
    ids: Sequence[int],
    layer_ids: Sequence[int],
    *,
    hidden_size: int | None = None,
) -> FileFacts:
    """`validate_states_file`'s checks on tensors already read from `path` (named in the errors). e4m3 states are
    refused: they come from speculators' `FP8HiddenStatesConnector`, whose scales are per token over all layers
    ([T, 1, 1]); this client quantizes stock vLLM's bf16 files itself, per token per layer (docs/hidden_states.md
    §15)."""
    return _checked(path, hs, tok, ids, layer_ids, hidden_size)[0]


def _checked(
    path: str | os.PathLike,
    hs: torch.Tensor,
    tok: torch.Tensor,
    ids: Sequence[int],
    layer_ids: Sequence[int],
    hidden_size: int | None,
) -> tuple[FileFacts, np.ndarray]:
    """`check_states`, and the [T, n] largest magnitudes its one reduction found (`_max_magnitude_bits`)."""
    n_ids, t_want = len(layer_ids), len(ids)

    def bad(cls: str, msg: str) -> RequestFailure:
        return RequestFailure(cls, f"{path}: {msg}", False)

    if hs.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise bad(
            INVALID_STATES,
            f"hidden_states are {hs.dtype}: the server runs speculators' FP8HiddenStatesConnector; with "
            "quantize: fp8 this client quantizes the bf16 files of vLLM's ExampleHiddenStatesConnector itself (one "
            "scale per token per layer): restart the server with the command `eagle-pipeline vllm-command` prints",
        )
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
            f"states for {t} positions, {t_want} sent (short by {t_want - t}): prefix caching on? restart the server "
            "with the command `eagle-pipeline vllm-command` prints (--no-enable-prefix-caching)",
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
    return FileFacts(t, h, hs.dtype), top


# dtype -> (unsigned view, magnitude mask, bits of +Inf): one integer reduction checks finiteness and zeros together
# (about 7x faster than torch.isfinite on bf16 CPU tensors; docs/hidden_states.md §12).
_FLOAT_BITS = {
    torch.bfloat16: (np.uint16, 0x7FFF, 0x7F80),
    torch.float16: (np.uint16, 0x7FFF, 0x7C00),
    torch.float32: (np.uint32, 0x7FFFFFFF, 0x7F800000),
}


def _magnitudes(top: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """`_max_magnitude_bits`' result as fp32 values (exact: each is one of the states' own values)."""
    if dtype not in _FLOAT_BITS:
        return torch.from_numpy(np.ascontiguousarray(top)).to(torch.float32)
    signed = np.int16 if top.dtype == np.uint16 else np.int32
    return torch.from_numpy(np.ascontiguousarray(top).view(signed)).view(dtype).to(torch.float32)


def _max_magnitude_bits(hs: torch.Tensor) -> np.ndarray:
    """Per state vector (last axis), the maximum of |x| as its IEEE bit pattern (order-preserving for |x|)."""
    if hs.dtype not in _FLOAT_BITS:
        return hs.abs().nan_to_num(nan=float("inf")).amax(-1).numpy()
    view, mask, _ = _FLOAT_BITS[hs.dtype]
    bits: Any = hs.contiguous().view(torch.int16 if view is np.uint16 else torch.int32).numpy().view(view)
    return (bits & mask).max(axis=-1)


def server_file_path(returned: str, storage_path: Path) -> Path:
    """Where this process sees the file the server named: as given when it lies under `storage_path`, else the same
    name under `storage_path` (the server mounts the shared volume elsewhere)."""
    p = Path(returned)
    try:
        p.relative_to(storage_path)
        return p
    except ValueError:
        return storage_path / p.name


def lock_free(path: Path) -> bool:
    """No one holds the connector's `{path}.lock` (or there is none)."""
    try:
        fd = os.open(f"{path}.lock", os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


async def wait_for_lock(path: Path, deadline: float, timeout_s: float) -> None:
    """Wait until no one holds the connector's `{path}.lock` (polls LOCK_EX | LOCK_NB, as speculators does)."""
    lock = f"{path}.lock"
    while True:
        if lock_free(path):  # a connector without the lock: the file check that follows waits for the file itself
            return
        if time.monotonic() >= deadline:
            raise RequestFailure(F.TIMEOUT, f"{lock} still locked {timeout_s:g} s after the response", True)
        await asyncio.sleep(0.005)


def journal_path(out_dir: Path, shard_index: int) -> Path:
    # Lists the connector files a run of this shard received, so a run after kill -9 can delete them.
    return out_dir / f".{shard_stem(shard_index)}.vllm-requests"


def delete_request_files(paths: Sequence[Path]) -> None:
    for p in paths:
        p.unlink(missing_ok=True)
        Path(f"{p}.lock").unlink(missing_ok=True)


def clean_journal(journal: Path) -> None:
    if journal.exists():
        delete_request_files([Path(x) for x in journal.read_text().split("\n") if x])
        journal.unlink()


def sweep_orphans(storage: Path, rows_ids: Sequence[Any]) -> list[Path]:
    """Delete the finished connector files under `storage` that hold one of these rows' ids: what requests of this
    shard left when their run was killed or stopped before the answer came (the server still wrote the file, and no
    journal could name it). Other shards' files hold other rows and stay; a file still being written (its lock
    held) is left for a later run of the shard. Returns the files deleted."""
    from safetensors import safe_open

    wanted = {tuple(int(x) for x in ids) for ids in rows_ids}
    lengths = {len(w) for w in wanted}
    removed: list[Path] = []
    for p in sorted(storage.glob("*.safetensors")) if storage.is_dir() else []:
        if not lock_free(p):
            continue
        try:
            with safe_open(str(p), framework="pt") as f:
                names = list(f.keys())  # a safe_open handle has no `in`
                if "token_ids" not in names or f.get_slice("token_ids").get_shape()[0] not in lengths:
                    continue
                ids = tuple(f.get_tensor("token_ids").tolist())
        except Exception:  # not (yet) a whole safetensors file: not ours to judge
            continue
        if ids in wanted:
            delete_request_files([p])
            removed.append(p)
    return removed
