"""The hidden states in each trainer's own offline layout: written directly by extraction, or derived from shards.

* SpecForge (`data.hidden_states_path`, `data.eval_hidden_states_path`): `{out}/train/` and `{out}/eval/`, one
  `torch.save` file `{sample_id}.ckpt` per sample with `input_ids` int64 [T], `loss_mask` int64 [T],
  `aux_hidden_state` [1, T, 3H] and `hidden_state` [1, T, H] **after** the final norm; `draft_vocab.pt` beside.
* speculators (`--data-path`): an Arrow dataset (`save_to_disk`, torch format: `input_ids`, `loss_mask`, `seq_len`,
  `sample_id`; train rows in merged order, then eval rows), `hidden_states/hs_{i}.safetensors` for row i with
  `hidden_states` [T, n_aux + 1, H] (the n_aux aux layers, [T, 4, H] for the default 3, then the final state
  **before** the final norm) and `token_ids` [T] int64, `d2t.npy` / `t2d.npy` when a draft vocabulary was built, and
  `--train-data-ratio` = (n_train + 0.5) / n in `export.json` and README.md.

With `hidden_states.layout: specforge | speculators` extraction writes each sample's states straight into that
trainer's files (`plan_layout_target`, `SampleFilesWriter`); the shard file keeps only ids and masks, and every
check reads the trainer's files through `open_shard`. Otherwise `write_layout` converts the shards: they hold the
final state pre-norm plus the target's final norm (`head.py`), so SpecForge's post-norm state is `final_norm(pre)`,
bit-equal to the model's own norm. Every file is written atomically; files of rows no longer merged are removed.
Disk and time of each choice at scale: docs/hidden_states.md §14.
"""

from __future__ import annotations

import io
import os
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from eagle_pipeline.hidden_states.store import fp8
from eagle_pipeline.hidden_states.store.fingerprint import LAYOUT_SHARDS
from eagle_pipeline.hidden_states.store.format import (
    TENSOR_NAMES,
    SampleLocation,
    build_sample_index,
    read_index,
    read_index_meta,
    sample_file_digest,
    sample_file_entry,
    shard_paths,
    tensor_key,
)
from eagle_pipeline.hidden_states.store.fp8 import QUANTIZE_FP8, QUANTIZE_NONE
from eagle_pipeline.hidden_states.store.head import POST_NORM, PRE_NORM
from eagle_pipeline.shared.storage import TMP_SUFFIX, write_bytes_atomic

SPLITS = ("train", "eval")
SHARDS, SPECFORGE, SPECULATORS = LAYOUT_SHARDS, "specforge", "speculators"
LAYOUTS = (SHARDS, SPECFORGE, SPECULATORS)
STATE_NAMES = ("aux_hidden_states", "final_hidden_state")
# The final-state convention each trainer's files must hold.
LAYOUT_FINAL_STATE = {SPECFORGE: POST_NORM, SPECULATORS: PRE_NORM}
EXPORT_JSON = "export.json"


def without_states(
    layout: list[tuple[str, torch.dtype, tuple[int, ...]]],
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """A shard's tensor layout (`format.shard_layout`) less the states, which live in the trainer's files: the ids
    and masks a shard in a trainer layout keeps (every engine)."""
    return [entry for entry in layout if entry[0].rsplit("/", 1)[1] not in STATE_NAMES]


def final_state_for_layout(layout: str) -> str:
    """The final-state convention extraction stores under `hidden_states.layout`: a trainer's own, else pre-norm."""
    return LAYOUT_FINAL_STATE.get(layout, PRE_NORM)


SPECULATORS_HS_DIR = "hidden_states"


@dataclass
class StatesExportSummary:
    format: str
    path: str
    rows: dict[str, int]
    tokens: dict[str, int]
    bytes_written: int
    final_state: str  # the convention of the final state in the files written
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def shard_final_state(meta: dict[str, Any]) -> str:
    """The final-state convention a shard's index metadata records ('pre_norm' | 'post_norm')."""
    if "final_state" in meta:
        return str(meta["final_state"])
    return POST_NORM if meta.get("final_state_is_post_norm", True) else PRE_NORM


@dataclass(frozen=True)
class LayoutTarget:
    """Where extraction writes each sample's states when `hidden_states.layout` is a trainer's layout: the trainer's
    export folder and, per sample id, its file there (relative to `root`), and how the states are stored
    (`fp8.QUANTIZE_MODES`: speculators' files hold e4m3 states and their scales with `fp8`)."""

    name: str
    root: Path
    file_of: dict[str, str]
    quantize: str = QUANTIZE_NONE


def plan_layout_target(
    layout: str,
    export_root: str | Path,
    merged_dir: str | Path,
    *,
    left_out: Collection[str] = (),
    quantize: str = QUANTIZE_NONE,
) -> LayoutTarget | None:
    """The per-sample file of every merged row in `layout` (None for 'shards'): speculators' `hs_{i}` numbers rows
    train first, then eval, each in merged order; SpecForge's files are `{split}/{sample_id}.ckpt`. Rows in
    `left_out` (dropped by extraction: `too_long_rows: drop`) get no file and no number: speculators' loader reads
    row i of its Arrow dataset from `hs_{i}` (`ArrowDataset._get_raw_data`), so the numbers must be dense over the
    rows the dataset holds, which are exactly the rows with states."""
    if layout == SHARDS:
        return None
    if layout not in LAYOUTS:
        raise ValueError(f"unknown hidden-states layout {layout!r}; expected one of {LAYOUTS}")
    gone = set(left_out)
    splits = {sid: split for sid, split in merged_splits(merged_dir).items() if sid not in gone}
    if layout == SPECFORGE:
        files = {sid: f"{split}/{safe_file_stem(sid)}.ckpt" for sid, split in splits.items()}
    else:
        ordered = [sid for split in SPLITS for sid, s in splits.items() if s == split]
        files = {sid: f"{SPECULATORS_HS_DIR}/hs_{i}.safetensors" for i, sid in enumerate(ordered)}
    if quantize != QUANTIZE_NONE and layout != SPECULATORS:
        raise ValueError(f"quantize {quantize!r} is built for layout {SPECULATORS!r} only, not {layout!r}")
    return LayoutTarget(layout, Path(export_root), files, quantize)


def remove_stale_tmp(target: LayoutTarget, sample_ids: list[str]) -> int:
    """Delete the temporaries a killed run left beside these samples' trainer files (`storage.atomic_path` names
    them `.{name}.{hex}.tmp`): a partial copy of a sample's states. Only these samples' names, since other shard
    runs write into the same folders at the same time. Returns how many were removed."""
    names: dict[Path, set[str]] = {}
    for sid in sample_ids:
        rel = target.file_of.get(sid)
        if rel is not None:
            path = target.root / rel
            names.setdefault(path.parent, set()).add(path.name)
    removed = 0
    for folder, wanted in names.items():
        if not folder.is_dir():
            continue
        for entry in os.scandir(folder):
            name = entry.name
            if name[:1] == "." and name.endswith(TMP_SUFFIX) and name[1 : -len(TMP_SUFFIX)].rsplit(".", 1)[0] in wanted:
                os.unlink(entry.path)
                removed += 1
    return removed


def serialise(
    layout: str,
    t: dict[str, torch.Tensor],
    n_aux: int,
    hidden: int,
    aliases: Mapping[str, str] | None = None,
    quantize: str = QUANTIZE_NONE,
) -> bytes:
    """One sample's file in a trainer's format, from the four canonical tensors (final state already in the
    trainer's convention). SpecForge: `aliases` (`drafter_types.specforge_aliases`) adds the DFlash family's key
    names for EAGLE-3's tensors; torch.save writes a storage once however many keys name it. speculators with
    `quantize: fp8`: e4m3 `hidden_states` and fp32 `hidden_states_scales` [T, n_aux + 1, 1], what its fp8 backend
    loads."""
    n_tok = int(t["input_ids"].numel())
    if layout == SPECULATORS:
        from safetensors.torch import save

        states = torch.cat(
            [t["aux_hidden_states"].view(n_tok, n_aux, hidden), t["final_hidden_state"].view(n_tok, 1, hidden)], dim=1
        )
        ids = t["input_ids"].to(torch.int64).contiguous()
        if quantize == QUANTIZE_FP8:
            return fp8.sample_file(states, ids)
        return save({"hidden_states": states.contiguous(), "token_ids": ids})
    record = {
        "input_ids": _own_storage(t["input_ids"].to(torch.int64)),
        "loss_mask": _own_storage(t["loss_mask"].to(torch.int64)),
        "aux_hidden_state": _own_storage(t["aux_hidden_states"]).unsqueeze(0),
        "hidden_state": _own_storage(t["final_hidden_state"]).unsqueeze(0),
    }
    record.update({alias: record[src] for alias, src in (aliases or {}).items()})
    buf = io.BytesIO()
    torch.save(record, buf)
    return buf.getvalue()


def _own_storage(x: torch.Tensor) -> torch.Tensor:
    """`x` alone in its storage: torch.save writes a view's whole storage, so a sample sliced out of its batch
    would carry every other sample of the batch into its `.ckpt` (seen: 7.6x the sample's bytes)."""
    x = x.contiguous()
    if x.untyped_storage().nbytes() != x.numel() * x.element_size():
        x = x.clone()
    return x


def _deserialise(layout: str, path: Path, n_aux: int) -> dict[str, torch.Tensor]:
    """aux [T, n_aux*H] and final [T, H] of one trainer file (FP8 states dequantized to fp32: `fp8.dequantize`)."""
    if layout == SPECULATORS:
        from safetensors.torch import load_file

        raw = load_file(str(path))
        states = raw[fp8.STATES_KEY]
        if fp8.SCALES_KEY in raw:
            states = fp8.dequantize_checked(path, states, raw[fp8.SCALES_KEY])
        return {"aux_hidden_states": states[:, :n_aux].flatten(1), "final_hidden_state": states[:, n_aux]}
    rec = torch.load(path, mmap=True, weights_only=True)
    return {"aux_hidden_states": rec["aux_hidden_state"][0], "final_hidden_state": rec["hidden_state"][0]}


class SampleFilesWriter:
    """Stands in for the shard's `StreamingSafetensorsWriter` when the states go straight into a trainer's layout:
    ids and masks still go to the shard file (small: 5 B/token), each sample's aux and final states to its own
    trainer file, written atomically as soon as both arrive, with its size and digest recorded for `shard_status`.
    """

    def __init__(self, inner: Any, target: LayoutTarget, out_dir: Path, masks: dict[str, np.ndarray], n_aux: int):
        self._inner, self._target, self._out_dir, self._masks, self._n_aux = inner, target, out_dir, masks, n_aux
        remove_stale_tmp(target, list(masks))  # what a killed run of this shard was writing
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self.files: list[dict[str, Any]] = []

    @property
    def total_bytes(self) -> int:
        return int(self._inner.total_bytes)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        sid, name = key.rsplit("/", 1)
        if name not in STATE_NAMES:  # ids and masks stay in the shard file
            self._inner.write(key, tensor)
        if name == "loss_mask":  # known from the merged rows; arrives after every sample's file is written
            return
        got = self._pending.setdefault(sid, {})
        got[name] = tensor
        if len(got) == 3:  # aux, final, ids
            self.write_sample(sid, self._pending.pop(sid))

    def write_sample(self, sid: str, t: dict[str, torch.Tensor]) -> None:
        """Write sample `sid`'s file from its aux, final (in the layout's convention) and ids tensors."""
        rel = self._target.file_of.get(sid)
        if rel is None:
            raise ValueError(f"sample {sid!r} has no file in the {self._target.name} layout: the merged table changed")
        hidden = int(t["final_hidden_state"].shape[-1])
        t = {**t, "loss_mask": torch.from_numpy(self._masks[sid])}
        data = serialise(self._target.name, t, self._n_aux, hidden, quantize=self._target.quantize)
        path = self._target.root / rel
        write_bytes_atomic(data, path)
        self.files.append(
            sample_file_entry(sid, os.path.relpath(path, self._out_dir), len(data), sample_file_digest(data))
        )

    def finish(self) -> str:
        if self._pending:
            raise ValueError(f"{len(self._pending)} samples never received all their states")
        return str(self._inner.finish())


def shard_layout(meta: dict[str, Any]) -> str:
    return str(meta.get("layout", SHARDS))


class ShardReader:
    """The four canonical tensors of each sample of one shard, whatever its layout (`open_shard`)."""

    def __init__(self, f: Any, meta: dict[str, Any], out_dir: Path):
        self._f, self.meta, self._out_dir = f, meta, out_dir
        self.layout = shard_layout(meta)
        self._keys = set(f.keys())
        self._files = {d["sample_id"]: out_dir / d["path"] for d in meta.get("sample_files", [])}
        self._n_aux = len(meta["aux_layers"])

    def has(self, sid: str) -> bool:
        own = TENSOR_NAMES if self.layout == SHARDS else ("input_ids", "loss_mask")
        if not all(tensor_key(sid, n) in self._keys for n in own):
            return False
        return self.layout == SHARDS or (sid in self._files and self._files[sid].exists())

    def get(self, sid: str) -> dict[str, torch.Tensor]:
        if self.layout == SHARDS:
            return {n: self._f.get_tensor(tensor_key(sid, n)) for n in TENSOR_NAMES}
        out = {n: self._f.get_tensor(tensor_key(sid, n)) for n in ("input_ids", "loss_mask")}
        out.update(_deserialise(self.layout, self._files[sid], self._n_aux))
        return {n: out[n] for n in TENSOR_NAMES}


@contextmanager
def open_shard(out_dir: str | Path, shard_index: int) -> Iterator[ShardReader]:
    """A reader over one shard's samples (states in the shard file, or in a trainer's files)."""
    from safetensors import safe_open

    st_path, idx_path = shard_paths(out_dir, shard_index)
    meta = read_index_meta(idx_path)
    with safe_open(str(st_path), framework="pt") as f:
        yield ShardReader(f, meta, Path(out_dir))


def shard_indexes(hs_dir: str | Path) -> list[tuple[int, dict[str, Any], list[str]]]:
    out = []
    for idx_path in sorted(Path(hs_dir).glob("shard-*.index.parquet")):
        meta = read_index_meta(idx_path)
        out.append((int(meta["shard_index"]), meta, read_index(idx_path).column("sample_id").to_pylist()))
    return out


def iter_shard_samples(
    hs_dir: str | Path, *, skip_layout: str | None = None
) -> Iterator[tuple[str, dict[str, torch.Tensor], dict[str, Any]]]:
    """(sample_id, the four tensors, the shard's index metadata) for every sample of every shard, one at a time;
    shards already in `skip_layout` are passed over."""
    for shard, meta, sample_ids in shard_indexes(hs_dir):
        if skip_layout is not None and shard_layout(meta) == skip_layout:
            continue
        with open_shard(hs_dir, shard) as reader:
            for sid in sample_ids:
                yield sid, reader.get(sid), meta


def recorded_drops(hs_dir: str | Path) -> list[dict[str, Any]]:
    """The rows the shards under `hs_dir` left out (`dropped_rows` of their indexes: `too_long_rows: drop`), in
    shard order: they have no states, so the exports leave them out too."""
    return [dict(d) for _shard, meta, _ids in shard_indexes(hs_dir) for d in meta.get("dropped_rows") or []]


def direct_samples(hs_dir: str | Path, target: LayoutTarget) -> set[str]:
    """Samples whose states extraction already wrote in `target`'s layout, checked to sit where the current merged
    table puts them."""
    found: set[str] = set()
    for _shard, meta, _ids in shard_indexes(hs_dir):
        if shard_layout(meta) != target.name:
            continue
        for d in meta.get("sample_files", []):
            want = target.file_of.get(d["sample_id"])
            if want is None or (Path(hs_dir) / d["path"]).resolve() != (target.root / want).resolve():
                raise ValueError(
                    f"{hs_dir}: shard {meta['shard_index']} wrote {d['sample_id']!r} to {d['path']}, but the merged "
                    f"table now puts it at {target.root / str(want)}: re-extract the shard"
                )
            found.add(d["sample_id"])
    return found


def merged_tables(merged_dir: str | Path, columns: list[str]) -> list[pa.Table]:
    """The merged part files in global row order, as extraction reads them (`merged.merged_parts`), so the trainer
    files are planned over exactly the rows the shards hold."""
    import pyarrow.parquet as pq

    from eagle_pipeline.hidden_states.store.merged import merged_parts

    return [pq.read_table(p, columns=columns) for p in merged_parts(merged_dir)]


def merged_splits(merged_dir: str | Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for t in merged_tables(merged_dir, ["sample_id", "split"]):
        out.update(zip(t.column("sample_id").to_pylist(), t.column("split").to_pylist()))
    return out


def safe_file_stem(sample_id: str) -> str:
    if not sample_id or "/" in sample_id or "\\" in sample_id or sample_id.startswith(".") or "\x00" in sample_id:
        raise ValueError(f"sample_id {sample_id!r} cannot name a file: SpecForge features are one file per sample id")
    return sample_id


def load_sample(
    out_dir: str | Path, sample_id: str, *, index: dict[str, SampleLocation] | None = None
) -> dict[str, torch.Tensor]:
    """The four tensors of one sample, from the shard file or the trainer layout the shard was written in (keys without the sample_id prefix). Pass a `build_sample_index` result
    as `index` when loading many samples, to avoid rescanning the index files each time."""
    loc = (index if index is not None else build_sample_index(out_dir)).get(sample_id)
    if loc is None:
        raise KeyError(f"sample {sample_id!r} not in any shard index under {out_dir}")
    with open_shard(out_dir, loc.shard_index) as reader:
        return reader.get(sample_id)
