"""The one disk module of extraction: what it writes, item by item, and whether that fits, before a shard run's first
request and before an export.

`disk_items` lists what a run writes under the settings (docs/hidden_states.md §1): the states in the chosen layout
(the project's shards, speculators' `hs_{i}.safetensors`, or SpecForge's `.ckpt`, each with its per-file bytes), the
ids and masks a shard keeps beside a trainer's files, speculators' Arrow dataset, the vLLM connector's files at
their peak (the rows fetched ahead of the copy), and each trainer copy listed in `hidden_states.trainer_layouts`;
`disk_inputs` reads its figures from the merged rows and the settings, `extraction_disk` gives the plan's figures
(spreading a workload sized before its data exists). `check_disk_for_run` (`check_disk` on plan.json) compares
them, before a shard run sends its first request, with `hidden_states.disk_budget_gb` (the whole plan) and with the
free space of each filesystem they land on (only what is still to be written: done shards are already on disk).
`check_export_room` does the same for a trainer layout converted from the shards.
Each layout's bytes per token and per sample are its object's (`trainer_layouts.Layout.disk_rates`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle_pipeline.hidden_states.layouts.trainer_layouts import (
    EXPORTS,
    HIDDEN_STATES,
    SPECULATORS_FILE_BYTES,
    layout_of,
)
from eagle_pipeline.hidden_states.settings import SHARDS
from eagle_pipeline.hidden_states.store.fp8 import QUANTIZE_NONE
from eagle_pipeline.hidden_states.store.shard_index import IDS_BYTES, MASK_BYTES, PROJECT_SHARD_SAMPLE_BYTES
from eagle_pipeline.shared.storage import read_json

if TYPE_CHECKING:
    from eagle_pipeline.hidden_states.engines.engine import ExtractionPaths
    from eagle_pipeline.hidden_states.settings import HiddenStatesConfig

# Beyond the tensors' bytes, measured with the writers (test_hs_disk_plan holds the plan within 1 % of real files):
SHARD_FILE_BYTES = 6_500  # per shard: its header's metadata (~1.3 KB) and the index's Parquet footer (~5.0 KB)
FP8_SCALE_BYTES = 4  # one fp32 scale per state vector (per token per layer)
SERVED_FP8_SOURCE_BYTES = 2  # the bf16 a vLLM server writes, which the client quantizes to FP8
CONNECTOR = "connector"  # where the vLLM connector's files land; a layout's own places: `trainer_layouts`
PLAN_FILE = "plan.json"  # in the hidden-states folder: the plans `run.plan_run` writes, which a shard run checks


@dataclass(frozen=True)
class StateShape:
    """Per token: `n_states` vectors (aux layers + final) of `hidden_size` values of `dtype_bytes` each, and
    `scale_bytes` per vector for quantized states (FP8: 1 B values and one fp32 scale)."""

    n_states: int
    hidden_size: int
    dtype_bytes: int
    scale_bytes: int = 0

    @property
    def token_bytes(self) -> int:
        return self.n_states * (self.hidden_size * self.dtype_bytes + self.scale_bytes)


def layout_rates(layout: str, shape: StateShape, *, direct: bool = True) -> list[tuple[str, str, int, int]]:
    """(what, place, bytes per token, bytes per sample) of each part `layout` writes: its object's
    `Layout.disk_rates` (the shard files add SHARD_FILE_BYTES each)."""
    return layout_of(layout).disk_rates(shape.token_bytes, quantized=bool(shape.scale_bytes), direct=direct)


def connector_file_bytes(shape: StateShape, n_tokens: int) -> int:
    """One connector file: `hidden_states` [T, n_states, H] in the model dtype, `token_ids` [T] int64, its header.
    FP8 states (`scale_bytes`) are quantized on the client from the servers' bf16 files: those are 2 B a value."""
    served = StateShape(shape.n_states, shape.hidden_size, SERVED_FP8_SOURCE_BYTES) if shape.scale_bytes else shape
    return n_tokens * (served.token_bytes + 8) + SPECULATORS_FILE_BYTES


@dataclass(frozen=True)
class DiskInputs:
    """What the disk plan needs beyond the state shape and the layout: each shard's tokens and rows, the copies in
    `trainer_layouts`, and the token counts of the connector files on disk at the peak (`scratch_rows`; empty: no
    connector), counted or not (`scratch_counted`: False when they become another item's bytes, `scratch_note` says
    why). `disk_inputs` reads them from the merged rows and the settings."""

    shard_tokens: Sequence[int]
    shard_rows: Sequence[int]
    trainer_layouts: Sequence[str] = ()
    scratch_rows: Sequence[int] = ()
    scratch_counted: bool = True
    scratch_note: str = ""


def disk_items(shape: StateShape, inputs: DiskInputs, *, layout: str = SHARDS) -> list[dict[str, Any]]:
    """What extraction and its exports write, one dict per item: `what`, `place` (HIDDEN_STATES, EXPORTS,
    CONNECTOR), `bytes`, `per_shard` (bytes of each shard, for items written shard by shard; None otherwise),
    `counted` (False: bytes that become another item's, e.g. connector files renamed to hs_{i}) and `note`."""
    items: list[dict[str, Any]] = []
    for what, place, per_token, per_sample in layout_rates(layout, shape):
        per_file = SHARD_FILE_BYTES if place == HIDDEN_STATES else 0
        per_shard = [t * per_token + r * per_sample + per_file for t, r in zip(inputs.shard_tokens, inputs.shard_rows)]
        items.append(dict(what=what, place=place, bytes=sum(per_shard), per_shard=per_shard, counted=True, note=""))
    n_tokens, n_samples = sum(inputs.shard_tokens), sum(inputs.shard_rows)
    for extra in dict.fromkeys(t for t in inputs.trainer_layouts if t != layout):
        for what, place, per_token, per_sample in layout_rates(extra, shape, direct=False):
            nbytes = n_tokens * per_token + n_samples * per_sample
            items.append(dict(what=what, place=place, bytes=nbytes, per_shard=None, counted=True, note=""))
    if inputs.scratch_rows:
        peak = sum(connector_file_bytes(shape, t) for t in inputs.scratch_rows)
        what = f"connector files at their peak ({len(inputs.scratch_rows)} rows in flight, the longest)"
        counted, note = inputs.scratch_counted, inputs.scratch_note
        items.append(dict(what=what, place=CONNECTOR, bytes=peak, per_shard=None, counted=counted, note=note))
    return items


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes (for this user) of the filesystem `path` is on, or will be on: its nearest existing parent's."""
    return int(shutil.disk_usage(existing_parent(path)).free)


def existing_parent(path: str | os.PathLike) -> Path:
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def remaining_bytes(item: Mapping[str, Any], done_shards: Collection[int], n_shards: int) -> int:
    """What of `item` is still to be written once `done_shards` are on disk (shard items lose their done shards'
    bytes; the connector's peak and the exports count while any shard, or the export, remains)."""
    if not item["counted"]:
        return 0
    if item["per_shard"] is not None:
        return sum(b for i, b in enumerate(item["per_shard"]) if i not in done_shards)
    if item["place"] == CONNECTOR and len(set(done_shards)) >= n_shards:
        return 0
    return int(item["bytes"])


class DiskBudgetExceeded(RuntimeError):
    """This run's plan needs more bytes than `limit` allows (the disk budget, or a filesystem's free space);
    nothing has been written."""

    def __init__(self, planned_bytes: int, budget_gb: float, plan: dict[str, Any], free: tuple[str, int] | None = None):
        self.budget_gb, self.planned_bytes, self.plan, self.free = budget_gb, planned_bytes, plan, free
        self.budget_bytes = int(budget_gb * 1e9) if free is None else free[1]
        need = f"{planned_bytes:,} bytes ({planned_bytes / 1e9:.3g} GB)"
        if free is None:
            text = (
                f"this run's plan needs {need} on disk, over the budget of {self.budget_bytes:,} bytes "
                f"({budget_gb:g} GB, hidden_states.disk_budget_gb). Raise the budget"
            )
        else:
            text = (
                f"what remains to be written needs {need} on the filesystem of {free[0]}, which has "
                f"{free[1]:,} bytes ({free[1] / 1e9:.3g} GB) free. Free space there, point the data root (or "
                "hidden_states.vllm.storage_path) at a larger filesystem"
            )
        super().__init__(
            f"Extraction refused: {text}, shrink the merged dataset, extract fewer layers, or drop a "
            "trainer_layouts copy (the plan: hidden_state_plan's metadata or `eagle-pipeline plan`)."
        )

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across process pools despite the custom signature
        return type(self), (self.planned_bytes, self.budget_gb, self.plan, self.free)


@dataclass(frozen=True)
class FilesystemNeed:
    """The bytes still to be written on one filesystem (named by its first place's path) and its free bytes."""

    path: str
    places: tuple[str, ...]
    needed: int
    free: int


def check_disk(
    plan: Mapping[str, Any],
    disk_budget_gb: float | None,
    *,
    places: Mapping[str, Path],
    done_shards: Collection[int],
    free_space: Callable[[Path], int] = free_bytes,
) -> list[FilesystemNeed]:
    """Raise `DiskBudgetExceeded` when `plan` (an `ExtractionPlan.to_dict()`) needs more than `disk_budget_gb` in
    all, or when what remains to be written on a filesystem exceeds its free space (`free_space(path)`, a seam for
    tests); return each filesystem's figures otherwise. `places` maps each item's place to its folder."""
    total = int(plan["bytes_on_disk"])
    if disk_budget_gb is not None and total > disk_budget_gb * 1e9:
        raise DiskBudgetExceeded(total, disk_budget_gb, dict(plan))
    by_fs: dict[int, tuple[Path, list[str], int]] = {}
    for item in plan["disk_items"]:
        need = remaining_bytes(item, done_shards, int(plan["n_shards"]))
        path = Path(places[item["place"]])
        dev = os.stat(existing_parent(path)).st_dev
        first, names, sofar = by_fs.get(dev, (path, [], 0))
        by_fs[dev] = (first, names if item["place"] in names else [*names, item["place"]], sofar + need)
    out = []
    for path, names, need in by_fs.values():
        free = free_space(path)
        if need > free:
            raise DiskBudgetExceeded(need, disk_budget_gb or 0.0, dict(plan), free=(str(path), free))
        out.append(FilesystemNeed(str(path), tuple(names), need, free))
    return out


def state_shape(n_states: int, hidden_size: int, dtype_bytes: int, quantize: str) -> StateShape:
    """The shape of what is stored per token: `n_states` vectors of `hidden_size` values of `dtype_bytes` each, or
    with `quantize: fp8` e4m3 values (1 B) and one fp32 scale per token per layer (store/fp8.py)."""
    from eagle_pipeline.hidden_states.store.fp8 import QUANTIZE_FP8

    if quantize == QUANTIZE_FP8:
        return StateShape(n_states, hidden_size, 1, FP8_SCALE_BYTES)
    return StateShape(n_states, hidden_size, dtype_bytes)


@dataclass(frozen=True)
class ExtractionDisk:
    """What an extraction of `n_tokens` tokens in `n_samples` rows writes, item by item (`disk_items`), and the
    plan's figures of it."""

    shape: StateShape
    items: list[dict[str, Any]]
    n_tokens: int
    n_samples: int

    @property
    def bytes_on_disk(self) -> int:
        """The counted items' bytes: all that is written."""
        return sum(d["bytes"] for d in self.items if d["counted"])

    @property
    def bytes_per_token(self) -> int:
        """The states and a project shard's id and mask of one token."""
        return self.shape.token_bytes + IDS_BYTES + MASK_BYTES

    @property
    def hidden_bytes(self) -> int:
        return self.n_tokens * self.shape.token_bytes

    @property
    def overhead_bytes(self) -> int:
        """The project shards' bytes beyond the states: ids, masks and each sample's header entries and index row."""
        return self.n_tokens * (IDS_BYTES + MASK_BYTES) + self.n_samples * PROJECT_SHARD_SAMPLE_BYTES

    def bytes_with_states(self, n_states: int) -> int:
        """`bytes_on_disk` had each token `n_states` vectors instead of the shape's (another layer choice): each
        counted copy of the states (the layout's, each trainer copy) grows or shrinks by the difference."""
        copies = sum(1 for d in self.items if d["counted"] and d["what"].startswith(("states", "copy")))
        per_layer = self.n_tokens * self.shape.hidden_size * self.shape.dtype_bytes * copies
        return self.bytes_on_disk + (n_states - self.shape.n_states) * per_layer


def extraction_disk(
    shape: StateShape, layout: str, inputs: DiskInputs | None, n_tokens: int, n_samples: int, shard_size: int
) -> ExtractionDisk:
    """What the plan's extraction writes; without `inputs` (a workload sized before its data exists) the tokens are
    spread evenly over the shards, with no trainer copies and no connector."""
    if inputs is None:
        rows = [min(shard_size, n_samples - start) for start in range(0, n_samples, shard_size)]
        tokens = [n_tokens * r // n_samples for r in rows]
        if rows:
            tokens[-1] += n_tokens - sum(tokens)
        inputs = DiskInputs(shard_tokens=tokens, shard_rows=rows)
    return ExtractionDisk(shape, disk_items(shape, inputs, layout=layout), n_tokens, n_samples)


def disk_inputs(settings: HiddenStatesConfig, paths: ExtractionPaths, *, shard_runs: int = 1) -> DiskInputs:
    """`disk_items`' figures from the merged rows: each shard's tokens and rows, the copies in
    `trainer_layouts`, and for `engine: vllm` the connector files at their peak: `shard_runs` runs, each with
    `vllm_requests.rows_ahead` rows fetched ahead of its copy, taken as the longest rows. With `layout:
    speculators` and the connector's storage on the export folder's filesystem those files are renamed to
    `hs_{i}` (`vllm_handoff`), so they are no bytes beyond the states; with `quantize: fp8` they are not (the client
    writes the FP8 `hs_{i}` beside them), so they count."""
    import pyarrow.parquet as pq

    from eagle_pipeline.hidden_states.engines.vllm.vllm_requests import rows_ahead
    from eagle_pipeline.hidden_states.store.merged import merged_parts

    lengths = [
        n
        for p in merged_parts(paths.merged_dir)
        for n in pq.read_table(p, columns=["n_tokens"])["n_tokens"].to_pylist()
    ]
    size = settings.shard_size
    inputs = DiskInputs(
        trainer_layouts=tuple(settings.trainer_layouts),
        shard_tokens=[int(sum(lengths[i : i + size])) for i in range(0, len(lengths), size)],
        shard_rows=[len(lengths[i : i + size]) for i in range(0, len(lengths), size)],
    )
    if settings.engine != "vllm":
        return inputs
    v = settings.vllm
    k = min(len(lengths), shard_runs * rows_ahead(v.concurrency, max(len(v.endpoints), 1)))
    inputs = replace(inputs, scratch_rows=sorted(lengths, reverse=True)[:k])
    same_fs = os.stat(existing_parent(v.storage_path)).st_dev == os.stat(existing_parent(paths.exports_dir)).st_dev
    if layout_of(settings.layout).takes_connector_file and same_fs and settings.quantize == QUANTIZE_NONE:
        note = "renamed to hs_{i} on the exports' filesystem, so the states' item holds them"
        inputs = replace(inputs, scratch_counted=False, scratch_note=note)
    return inputs


def disk_places(settings: HiddenStatesConfig, paths: ExtractionPaths) -> dict[str, Path]:
    """The folder each item of the disk plan is written to (HIDDEN_STATES, EXPORTS, CONNECTOR)."""
    return {
        HIDDEN_STATES: Path(paths.out_dir),
        EXPORTS: Path(paths.exports_dir),
        CONNECTOR: Path(settings.vllm.storage_path),
    }


def check_disk_budget(
    plan_path: str | Path,
    disk_budget_gb: float | None,
    *,
    places: Mapping[str, Path] | None = None,
    done_shards: Collection[int] = (),
    free_space: Callable[[Path], int] = free_bytes,
) -> list[FilesystemNeed]:
    """Raise `DiskBudgetExceeded` when the plan at `plan_path` ('this_run') exceeds the budget in force now, or,
    with `places` (each item's folder: `disk_places`), when what remains to be written on a filesystem (all but
    `done_shards`) exceeds its free space (`check_disk`); return each filesystem's figures.

    The budget is the caller's current setting, not the one plan.json was made under, so lowering it takes effect
    without replanning. A missing plan is a FileNotFoundError that says how to make one.
    """
    plan_path = Path(plan_path)
    if not plan_path.exists():
        raise FileNotFoundError(f"No extraction plan at {plan_path}: materialize hidden_state_plan first.")
    plan = read_json(plan_path)["this_run"]
    if places is None or "disk_items" not in plan:  # a plan.json written before the items: the budget alone
        if disk_budget_gb is not None and int(plan["bytes_on_disk"]) > disk_budget_gb * 1e9:
            raise DiskBudgetExceeded(int(plan["bytes_on_disk"]), disk_budget_gb, plan)
        return []
    return check_disk(plan, disk_budget_gb, places=places, done_shards=done_shards, free_space=free_space)


def check_disk_for_run(
    settings: HiddenStatesConfig, paths: ExtractionPaths, *, free_space: Callable[[Path], int] | None = None
) -> list[FilesystemNeed]:
    """Before a shard run's first request: raise `DiskBudgetExceeded` when plan.json's total exceeds
    `hidden_states.disk_budget_gb`, or when what remains to be written (every shard not done yet, the connector's
    peak, the exports) exceeds a filesystem's free space (`free_space(path)`, default `free_bytes`: a seam for
    tests); return each filesystem's figures.

    Which shards are done is read from their indexes and the files' sizes, never their bytes: every shard run
    makes this check, and hashing the finished shards (51 GB each for Kimi-K2.5) would make a whole extraction
    quadratic in the shards done. A shard's own digest is checked by its own run and by the export."""
    from eagle_pipeline.hidden_states.store.format import shard_numbers, shard_status

    done = {i for i in shard_numbers(paths.out_dir) if shard_status(paths.out_dir, i, check_hash=False) == "done"}
    return check_disk_budget(
        paths.out_dir / PLAN_FILE,
        settings.disk_budget_gb,
        places=disk_places(settings, paths),
        done_shards=done,
        free_space=free_space or free_bytes,
    )


def states_bytes(hs_dir: str | Path, *, skip_layout: str | None = None) -> int:
    """Bytes of the shards' states (from their indexes), leaving out shards already in `skip_layout`: about what
    converting them to a trainer layout writes again."""
    from eagle_pipeline.hidden_states.store.fingerprint import recorded_fingerprint
    from eagle_pipeline.hidden_states.store.shard_index import shard_indexes

    return sum(
        int(meta["size_bytes"])
        for _shard, meta, _ids in shard_indexes(hs_dir)
        if skip_layout is None or recorded_fingerprint(meta).layout != skip_layout
    )


def check_export_room(hs_dir: str | Path, out_dir: str | Path, layout: str) -> None:
    """Raise before writing trainer layout `layout` under `out_dir` when its disk has no room for it: each layout is
    a second copy of the states (7.94 TB at Kimi scale, docs/hidden_states.md §14), but for the shards extraction
    wrote in that layout directly."""
    need = states_bytes(hs_dir, skip_layout=layout)
    free = free_bytes(out_dir)
    if need > free:
        raise OSError(
            f"{layout} export needs about {need:,} bytes ({need / 1e12:.3g} TB) under {out_dir}, but only {free:,} are "
            "free. Export fewer trainer layouts (hidden_states.trainer_layouts) or free disk."
        )
