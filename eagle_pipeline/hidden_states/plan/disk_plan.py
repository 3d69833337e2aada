"""The bytes extraction writes, item by item, and the refusal before the first request when they do not fit.

`disk_items` lists what a run writes under the settings (docs/hidden_states.md §1): the states in the chosen layout
(the project's shards, speculators' `hs_{i}.safetensors`, or SpecForge's `.ckpt`, each with its per-file bytes), the
ids and masks a shard keeps beside a trainer's files, speculators' Arrow dataset, the vLLM connector's files at
their peak (the rows fetched ahead of the copy), and each trainer copy listed in `hidden_states.trainer_layouts`.
`check_disk` compares them, before a shard run sends its first request, with `hidden_states.disk_budget_gb` (the
whole plan) and with the free space of each filesystem they land on (only what is still to be written: done shards
are already on disk). Each layout's bytes per token and per sample are its object's
(`trainer_layouts.Layout.disk_rates`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle_pipeline.hidden_states.layouts.trainer_layouts import (
    HIDDEN_STATES,
    SPECULATORS_FILE_BYTES,
    layout_of,
)
from eagle_pipeline.hidden_states.settings import SHARDS

# Beyond the tensors' bytes, measured with the writers (test_hs_disk_plan holds the plan within 1 % of real files):
SHARD_FILE_BYTES = 10_000  # per shard: its header's metadata (~1.4 KB) and the index's Parquet footer (~8.3 KB)
FP8_SCALE_BYTES = 4  # one fp32 scale per state vector (per token per layer)
CONNECTOR = "connector"  # where the vLLM connector's files land; a layout's own places: `trainer_layouts`


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
    """One connector file: `hidden_states` [T, n_states, H] in the model dtype, `token_ids` [T] int64, its header."""
    return n_tokens * (shape.token_bytes + 8) + SPECULATORS_FILE_BYTES


def disk_items(
    shape: StateShape,
    *,
    layout: str = SHARDS,
    trainer_layouts: Sequence[str] = (),
    shard_tokens: Sequence[int],
    shard_rows: Sequence[int],
    scratch_rows: Sequence[int] = (),
    scratch_counted: bool = True,
    scratch_note: str = "",
) -> list[dict[str, Any]]:
    """What extraction and its exports write, one dict per item: `what`, `place` (HIDDEN_STATES, EXPORTS,
    CONNECTOR), `bytes`, `per_shard` (bytes of each shard, for items written shard by shard; None otherwise),
    `counted` (False: bytes that become another item's, e.g. connector files renamed to hs_{i}) and `note`.
    `scratch_rows`: the token counts of the connector files on disk at the peak (empty: no connector)."""
    items: list[dict[str, Any]] = []
    for what, place, per_token, per_sample in layout_rates(layout, shape):
        per_file = SHARD_FILE_BYTES if place == HIDDEN_STATES else 0
        per_shard = [t * per_token + r * per_sample + per_file for t, r in zip(shard_tokens, shard_rows)]
        items.append(dict(what=what, place=place, bytes=sum(per_shard), per_shard=per_shard, counted=True, note=""))
    n_tokens, n_samples = sum(shard_tokens), sum(shard_rows)
    for extra in dict.fromkeys(t for t in trainer_layouts if t != layout):
        for what, place, per_token, per_sample in layout_rates(extra, shape, direct=False):
            nbytes = n_tokens * per_token + n_samples * per_sample
            items.append(dict(what=what, place=place, bytes=nbytes, per_shard=None, counted=True, note=""))
    if scratch_rows:
        peak = sum(connector_file_bytes(shape, t) for t in scratch_rows)
        what = f"connector files at their peak ({len(scratch_rows)} rows in flight, the longest)"
        items.append(
            dict(what=what, place=CONNECTOR, bytes=peak, per_shard=None, counted=scratch_counted, note=scratch_note)
        )
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
