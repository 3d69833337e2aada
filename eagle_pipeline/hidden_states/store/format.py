"""On-disk format of extracted hidden states: one safetensors file plus one index Parquet per shard.

`shard-NNNNN.safetensors` holds four tensors per sample, keyed `{sample_id}/{name}`:
`aux_hidden_states` [T, n_aux*H], `final_hidden_state` [T, H] (bf16 on GPU runs, fp32 on CPU runs),
`input_ids` [T] int32, `loss_mask` [T] int8; with `quantize: fp8` the states are e4m3 beside their fp32
`SCALES_NAME` [T, n_aux + 1]. `shard-NNNNN.index.parquet` is written last and records the
safetensors file's sha256 and size: a shard is done iff its index exists and the hash matches. States written
straight into a trainer's layout are listed in the index's `sample_files` (`sample_file_entry`), each with its size
and XXH3-128 (`SAMPLE_FILE_DIGEST`; entries written before it carry a sha256, still verified as such).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import xxhash

from eagle_pipeline.shared.storage import TMP_SUFFIX, file_sha256, file_xxh3_128

FORMAT_NAME = "eagle_pipeline.hidden_states"
FORMAT_VERSION = 2  # a shard of another version is stale (`shards.shard_state`): extracted again, never read
INDEX_META_KEY = b"eagle_pipeline.hidden_states"
MAX_HEADER_BYTES = 100_000_000  # the safetensors reader refuses larger headers (~1 KB per sample here)
TENSOR_NAMES = ("aux_hidden_states", "final_hidden_state", "input_ids", "loss_mask")
# With `quantize: fp8` a shard file also holds each sample's fp32 scales [T, n_aux + 1], one per token per layer (aux
# layers, then the final state), beside its e4m3 aux and final states; every reader dequantizes (`open_shard`).
SCALES_NAME = "state_scales"

_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
}

INDEX_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("row_index", pa.int64()),
        ("n_tokens", pa.int32()),
        ("n_supervised", pa.int32()),
        ("n_nonfinite", pa.int64()),
        ("keys", pa.list_(pa.string())),
    ]
)


def tensor_key(sample_id: str, name: str) -> str:
    return f"{sample_id}/{name}"


def shard_stem(shard_index: int) -> str:
    return f"shard-{shard_index:05d}"


def shard_number(name: str) -> int:
    """NNNNN of a shard's file name (`shard-NNNNN.<ext>`); -1 for any other name."""
    number = name[len("shard-") :].split(".", 1)[0] if name.startswith("shard-") else ""
    return int(number) if number.isdigit() else -1


def shard_numbers(out_dir: str | Path) -> list[int]:
    """The shards with an index in `out_dir`, sorted (a file named otherwise is no shard's)."""
    return sorted(n for p in Path(out_dir).glob("shard-*.index.parquet") if (n := shard_number(p.name)) >= 0)


def shard_paths(out_dir: str | Path, shard_index: int) -> tuple[Path, Path]:
    """(safetensors path, index path) of a shard."""
    d = Path(out_dir)
    stem = shard_stem(shard_index)
    return d / f"{stem}.safetensors", d / f"{stem}.index.parquet"


def shard_tmp_leftovers(out_dir: str | Path, shard_index: int) -> list[Path]:
    """Temporary files `storage.atomic_path` left for this shard (a writer was killed mid-write)."""
    return sorted(Path(out_dir).glob(f".{shard_stem(shard_index)}.*{TMP_SUFFIX}"))


class StreamingSafetensorsWriter:
    """Writes a valid safetensors file whose layout is declared up front, tensor by tensor, in layout order.

    Why not `safetensors.torch.save_file`: it needs the whole shard in host memory at once (Kimi-K2.5:
    ~57 KB/token, so a 1,000-sample shard is >100 GB). Here memory is one batch, the file is written
    sequentially, and its sha256 is computed on the way. The format: u64-LE header length, JSON header
    (space-padded to 8 bytes), then the tensors' raw little-endian bytes back to back with no holes.
    """

    def __init__(
        self, fh: BinaryIO, layout: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]
    ):
        header: dict[str, Any] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
        self._order: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
        offset = 0
        for key, dtype, shape in layout:
            if key in header:
                raise ValueError(f"duplicate tensor key {key!r}")
            nbytes = _numel(shape) * _itemsize(dtype)
            header[key] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._order.append((key, dtype, tuple(shape), nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % 8)  # data section starts 8-byte aligned
        if len(raw) > MAX_HEADER_BYTES:
            raise ValueError(f"safetensors header of {len(raw):,} B exceeds readers' 100 MB limit: lower shard_size")
        self._fh = fh
        self._hash = hashlib.sha256()
        self._next = 0
        self.data_bytes = offset
        self.total_bytes = 8 + len(raw) + offset
        self._emit(struct.pack("<Q", len(raw)) + raw)

    def _emit(self, data: Any) -> None:
        self._fh.write(data)
        self._hash.update(data)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._order):
            raise ValueError(f"unexpected tensor {key!r}: layout already complete")
        exp_key, dtype, shape, nbytes = self._order[self._next]
        if key != exp_key or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(
                f"tensor {self._next}: expected {exp_key} {dtype} {shape}, got {key} {tensor.dtype} {tuple(tensor.shape)}"
            )
        if nbytes:
            buf = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            self._emit(buf.data)
        self._next += 1

    def finish(self) -> str:
        """Check every declared tensor was written; return the file's sha256."""
        if self._next != len(self._order):
            raise ValueError(f"{len(self._order) - self._next} declared tensors were never written")
        self._fh.flush()
        return self._hash.hexdigest()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def state_dtype(name: str) -> torch.dtype:
    """The torch dtype `dtype_name` names ('bfloat16', 'float32', ...)."""
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return found


def shard_layout(
    sample_ids: list[str],
    lengths: list[int],
    order: list[int],
    *,
    n_aux: int,
    hidden: int,
    state_dtype: torch.dtype,
    ids_dtype: torch.dtype,
    mask_dtype: torch.dtype,
    states: bool = True,
    scales: bool = False,
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The tensor layout of a shard file, shared by every engine: samples in `order` (aux, final, ids each; ids
    alone when `states` is false: a trainer's layout holds them; with `scales`, FP8 states' fp32 `SCALES_NAME`
    after the final state), then every loss mask. Keeps the 4-byte tensors ahead of the 1-byte masks, so all
    offsets stay aligned (e4m3 states are T x H bytes, H a multiple of 4 in every target), and makes the file
    strictly sequential."""
    layout: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for i in order:
        sid, t = sample_ids[i], lengths[i]
        if states:
            layout += [
                (tensor_key(sid, "aux_hidden_states"), state_dtype, (t, n_aux * hidden)),
                (tensor_key(sid, "final_hidden_state"), state_dtype, (t, hidden)),
            ]
            if scales:
                layout.append((tensor_key(sid, SCALES_NAME), torch.float32, (t, n_aux + 1)))
        layout.append((tensor_key(sid, "input_ids"), ids_dtype, (t,)))
    layout += [(tensor_key(sample_ids[i], "loss_mask"), mask_dtype, (lengths[i],)) for i in order]
    return layout


# ---------------------------------------------------------------- index


def write_index(path: Path, rows: dict[str, list], meta: dict[str, Any]) -> None:
    """Write the shard index (the 'done' marker) atomically, with `meta` as JSON in the schema metadata."""
    from eagle_pipeline.shared.storage import write_parquet_atomic

    table = pa.Table.from_pydict(rows, schema=INDEX_SCHEMA)
    table = table.replace_schema_metadata({INDEX_META_KEY: json.dumps(meta, sort_keys=True).encode()})
    write_parquet_atomic(table, path)


def read_index_meta(index_path: str | Path) -> dict[str, Any]:
    md = pq.read_schema(index_path).metadata or {}
    if INDEX_META_KEY not in md:
        raise ValueError(f"{index_path}: not a hidden-states index (no {INDEX_META_KEY.decode()} metadata)")
    return json.loads(md[INDEX_META_KEY])


def read_index(index_path: str | Path) -> pa.Table:
    return pq.read_table(index_path)


def shard_status(out_dir: str | Path, shard_index: int, *, check_hash: bool = True) -> str:
    """'done' | 'missing' | 'partial' for one shard.

    partial = anything a killed or interrupted run can leave: tmp files, a safetensors file without its index, an
    index without its file, or a file whose size/digest differs from what the index recorded. `check_hash=False`
    compares sizes only (cheap; use for listings, not before trusting the data). This compares the files with their
    own index only; `shards.shard_state` also tells whether they were extracted under the settings asked for now.
    """
    st_path, idx_path = shard_paths(out_dir, shard_index)
    if shard_tmp_leftovers(out_dir, shard_index):
        return "partial"
    has_st, has_idx = st_path.exists(), idx_path.exists()
    if not has_st and not has_idx:
        return "missing"
    if not (has_st and has_idx):
        return "partial"
    try:
        meta = read_index_meta(idx_path)
    except Exception:  # unreadable index = a broken shard, never a done one
        return "partial"
    if st_path.stat().st_size != meta.get("size_bytes"):
        return "partial"
    if check_hash and file_sha256(st_path) != meta.get("sha256"):
        return "partial"
    for f in meta.get("sample_files", []):  # states written straight into a trainer's layout
        if not sample_file_intact(out_dir, f, check_hash=check_hash):
            return "partial"
    return "done"


# The integrity record of a trainer file: at Kimi's rate (~1.4 GB/s of states per server) a sha256 pass was the
# largest cost of the zero-copy hand-off; XXH3-128 detects the same torn or truncated writes at ~0.05 s/GB.
SAMPLE_FILE_DIGEST = "xxh3_128"


def sample_file_digest(data: Any) -> str:
    """XXH3-128 of a trainer file's bytes (any buffer: bytes, an mmap)."""
    return str(xxhash.xxh3_128_hexdigest(data))


def sample_file_entry(sample_id: str, rel_path: str, size: int, digest: str) -> dict[str, Any]:
    """A shard index's record of one trainer file it vouches for (`rel_path` relative to the shard's folder)."""
    return {"sample_id": sample_id, "path": rel_path, "size": size, SAMPLE_FILE_DIGEST: digest}


def sample_file_intact(out_dir: str | Path, entry: dict[str, Any], *, check_hash: bool = True) -> bool:
    """Whether the trainer file of `entry` exists with its recorded size (and digest, unless `check_hash=False`)."""
    p = Path(out_dir) / entry["path"]
    if not p.exists() or p.stat().st_size != entry["size"]:
        return False
    if not check_hash:
        return True
    return bool(file_xxh3_128(p) == entry[SAMPLE_FILE_DIGEST])


def remove_shard(out_dir: str | Path, shard_index: int) -> None:
    """Delete a shard's files, index first so no moment exists where an index vouches for a missing file."""
    st_path, idx_path = shard_paths(out_dir, shard_index)
    try:
        sample_files = [Path(out_dir) / f["path"] for f in read_index_meta(idx_path).get("sample_files", [])]
    except Exception:  # no or unreadable index: its trainer files, if any, are rewritten by the redo
        sample_files = []
    idx_path.unlink(missing_ok=True)
    st_path.unlink(missing_ok=True)
    for p in sample_files:
        p.unlink(missing_ok=True)
    for p in shard_tmp_leftovers(out_dir, shard_index):
        p.unlink(missing_ok=True)


# ---------------------------------------------------------------- readers for trainers


@dataclass(frozen=True)
class SampleLocation:
    shard_index: int
    path: Path
    row_index: int


def build_sample_index(out_dir: str | Path) -> dict[str, SampleLocation]:
    """sample_id -> where its tensors are, over every shard index in `out_dir` (reads only the index files)."""
    found: dict[str, SampleLocation] = {}
    for idx_path in sorted(Path(out_dir).glob("shard-*.index.parquet")):
        meta = read_index_meta(idx_path)
        st_path = idx_path.with_name(meta["safetensors_file"])
        t = pq.read_table(idx_path, columns=["sample_id", "row_index"])
        for sid, row in zip(t.column("sample_id").to_pylist(), t.column("row_index").to_pylist()):
            found[sid] = SampleLocation(int(meta["shard_index"]), st_path, int(row))
    return found
