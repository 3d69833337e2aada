"""A vLLM connector file handed to speculators as it is: validated and hashed in one read, then renamed into place.

The connector writes `hidden_states` [T, n_ids, H] (the aux layers, then vLLM id L: the final state before the final
norm) and `token_ids` [T] int64, which is byte for byte speculators' `hs_{i}.safetensors` (trainer_layouts.py). So with
`engine: vllm` and `layout: speculators` the client reads each file once (one mapping), computes its XXH3-128 (`format.sample_file_digest`) and runs
`vllm_files.check_states` over that one buffer, then renames the file to its `hs_{i}` name when the connector's storage
and the export folder are on one filesystem (same `st_dev`), else writes the buffer it already holds (one streaming
copy) and deletes the connector's file. Crash safety: a kill -9 before the rename leaves the connector file, which
the shard's request journal lists and the rerun deletes and asks for again; one after it leaves `hs_{i}` (the
rename is atomic: the whole file or the old one), which no shard index vouches for until the shard is written, so the
rerun rewrites it (`os.replace`). The cost per GB beside the other paths: benchmarks/bench_layout_copy.py,
docs/hidden_states.md §12.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_pipeline.hidden_states.engines.vllm.vllm_files import INVALID_STATES, FileFacts, check_states
from eagle_pipeline.hidden_states.store.format import sample_file_digest
from eagle_pipeline.shared.failures import RequestFailure
from eagle_pipeline.shared.storage import atomic_path, fsync_dir

RENAMED, COPIED = "renamed", "copied"

# safetensors dtype names of the tensors a connector file may hold.
_ST_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "I64": torch.int64,
    "I32": torch.int32,
}


@dataclass(frozen=True)
class HandedFile:
    """A validated connector file: what it holds, and its size and digest (from the one read)."""

    facts: FileFacts
    size: int
    digest: str  # format.sample_file_digest
    how: str = ""  # RENAMED | COPIED once placed


def map_file(path: str | os.PathLike) -> mmap.mmap:
    """The whole file as a private mapping: its pages are read once from storage (or taken from the page cache the
    server's write left them in), never copied into a fresh buffer (a `readinto` costs ~4x the checks, page faults
    on new memory and a memcpy: docs/hidden_states.md §12). Writable copy-on-write so torch can view it."""
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            raise RequestFailure(INVALID_STATES, f"{path}: empty file", False)
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)


def safetensors_views(path: str | os.PathLike, buf: mmap.mmap) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in `buf`, as views of it (no copy); a malformed file raises a
    non-retryable RequestFailure naming it."""

    def bad(msg: str) -> RequestFailure:
        return RequestFailure(INVALID_STATES, f"{path}: not a safetensors file ({msg})", False)

    if len(buf) < 8:
        raise bad(f"{len(buf)} bytes")
    n = int.from_bytes(buf[:8], "little")
    if n > len(buf) - 8:
        raise bad(f"header of {n} bytes in a file of {len(buf)}")
    try:
        header = json.loads(bytes(buf[8 : 8 + n]))
    except ValueError as exc:
        raise bad(f"header: {exc}") from exc
    base, out = 8 + n, {}
    for name, d in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(d.get("dtype"))
        if dtype is None:
            raise bad(f"tensor {name} has dtype {d.get('dtype')}")
        start, stop = d["data_offsets"]
        numel = 1
        for s in d["shape"]:
            numel *= int(s)
        if stop - start != numel * dtype.itemsize or base + stop > len(buf):
            raise bad(f"tensor {name}: offsets {start}..{stop} for shape {d['shape']} {d['dtype']}")
        flat = (
            torch.frombuffer(buf, dtype=dtype, count=numel, offset=base + start)
            if numel
            else torch.empty(0, dtype=dtype)
        )
        out[name] = flat.view([int(s) for s in d["shape"]])
    return out


def read_validated(
    path: str | os.PathLike, ids: Sequence[int], layer_ids: Sequence[int], *, hidden_size: int | None = None
) -> tuple[HandedFile, mmap.mmap]:
    """Read a connector file once; check it as `vllm_files.validate_states_file` does (ids, layer count, H, finite,
    no all-zero state) and that `token_ids` is int64 (speculators' dtype); return its facts, size and digest, and
    the buffer (for a copy to another filesystem)."""
    buf = map_file(path)
    digest = sample_file_digest(buf)  # one pass over the pages; the checks below find them mapped
    t = safetensors_views(path, buf)
    if not {"hidden_states", "token_ids"} <= set(t):
        raise RequestFailure(INVALID_STATES, f"{path}: tensors {sorted(t)}, need hidden_states and token_ids", False)
    if t["token_ids"].dtype != torch.int64:
        raise RequestFailure(
            INVALID_STATES, f"{path}: token_ids are {t['token_ids'].dtype}, speculators reads int64", False
        )
    facts = check_states(path, t["hidden_states"], t["token_ids"], ids, layer_ids, hidden_size=hidden_size)
    return HandedFile(facts, len(buf), digest), buf


def same_filesystem(src: str | os.PathLike, dst_dir: str | os.PathLike) -> bool:
    return os.stat(src).st_dev == os.stat(dst_dir).st_dev


def place_file(src: str | os.PathLike, dst: str | os.PathLike, data: mmap.mmap) -> str:
    """Put the connector file `src` (whose bytes are `data`) at `dst`: a rename on one filesystem, else one write of
    `data` (atomic, fsynced) and the removal of `src`. Its `.lock` goes too. Returns RENAMED or COPIED."""
    src, dst = Path(src), Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if same_filesystem(src, dst.parent):
        os.replace(src, dst)
        with open(dst, "rb") as fh:  # the connector need not have synced it; the shard index will vouch for it
            os.fsync(fh.fileno())
        fsync_dir(dst.parent)
        how = RENAMED
    else:
        with atomic_path(dst) as tmp, open(tmp, "wb") as fh:
            fh.write(data)
        src.unlink()
        how = COPIED
    Path(f"{src}.lock").unlink(missing_ok=True)
    return how


def hand_off(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    ids: Sequence[int],
    layer_ids: Sequence[int],
    *,
    hidden_size: int | None = None,
) -> HandedFile:
    """Validate the connector file `src` and place it at `dst` (speculators' `hs_{i}.safetensors`); nothing is
    placed when the file is invalid (a RequestFailure says why)."""
    handed, buf = read_validated(src, ids, layer_ids, hidden_size=hidden_size)
    try:
        how = place_file(src, dst, buf)
    finally:
        buf.close()
    return HandedFile(handed.facts, handed.size, handed.digest, how)
