"""The state of extracted shards against the settings asked for now, and what to do about it.

One decision for every caller (the Python API's `extract_shard`, the Dagster asset before it loads a model, the
export guard): a shard is `done` (its files match its index and its fingerprint is the wanted one), `stale` (done,
but extracted under other settings, or cut with another target head than the one recorded beside it now), `partial`
or `missing` (`format.shard_status`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle_pipeline.drafter_types import POST_NORM
from eagle_pipeline.hidden_states.store.fingerprint import ExtractionFingerprint, describe_diff, recorded_fingerprint
from eagle_pipeline.hidden_states.store.format import (
    FORMAT_VERSION,
    read_index_meta,
    remove_shard,
    shard_number,
    shard_paths,
    shard_status,
)
from eagle_pipeline.hidden_states.store.head import TARGET_HEAD_FILE, head_changed
from eagle_pipeline.hidden_states.store.merged import count_rows, num_shards

ON_MISMATCH = ("refuse", "redo")
SUPERSEDED_DIR = "superseded"
HEAD_META_KEY = "target_head_sha256"  # the index's record of the head file the shard was cut with
RUN_META_KEY = "run"  # the index's record of what only the run knew (`shard_writer.ShardRun`)
FORMAT_META_KEY = "format_version"


@dataclass
class ShardSummary:
    shard_index: int
    row_start: int
    row_stop: int
    rows: int
    tokens: int
    padded_tokens: int
    padding_fraction: float
    batches: int
    seconds: float
    tokens_per_s: float
    path: str
    index_path: str
    sha256: str
    size_bytes: int
    dtype: str
    aux_layers: list[int]
    final_state_is_post_norm: bool
    n_nonfinite_samples: int
    compute_seconds: float = 0.0  # forward + device-to-host copy (the GPU-bound part)
    write_wait_seconds: float = 0.0  # time the forward loop stalled on the disk writer
    skipped: bool = False
    fingerprint: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_index(cls, meta: Mapping[str, Any], index_path: str | Path, *, skipped: bool = False) -> ShardSummary:
        """The summary of a shard from its index metadata (`shard_writer.ShardFacts.index_meta`): built here alone,
        for the run that wrote the shard and for every later run that reuses it."""
        fp, run = recorded_fingerprint(meta), meta[RUN_META_KEY]
        tokens, padded, seconds = int(meta["tokens"]), int(run["padded_tokens"]), float(run["seconds"])
        index_path = Path(index_path)
        return cls(
            shard_index=int(meta["shard_index"]),
            row_start=int(meta["row_start"]),
            row_stop=int(meta["row_stop"]),
            rows=int(meta["rows"]),
            tokens=tokens,
            padded_tokens=padded,
            padding_fraction=padded / max(tokens + padded, 1),
            batches=int(run["batches"]),
            seconds=seconds,
            tokens_per_s=tokens / seconds if seconds > 0 else float("inf"),
            path=str(index_path.with_name(meta["safetensors_file"])),
            index_path=str(index_path),
            sha256=str(meta["sha256"]),
            size_bytes=int(meta["size_bytes"]),
            dtype=str(meta["dtype"]),
            aux_layers=list(fp.aux_layers),
            final_state_is_post_norm=fp.final_state == POST_NORM,
            n_nonfinite_samples=int(run["n_nonfinite_samples"]),
            compute_seconds=float(run["compute_seconds"]),
            write_wait_seconds=float(run["write_wait_seconds"]),
            skipped=skipped,
            fingerprint=fp.to_dict(),
        )


@dataclass(frozen=True)
class ShardState:
    shard_index: int
    status: str  # done | stale | partial | missing
    differences: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # stale: field -> (on disk, wanted)


class ShardMismatchError(ValueError):
    """A finished shard was extracted under other settings than the ones asked for now."""

    def __init__(self, out_dir: Path, shard_index: int, differences: dict[str, tuple[Any, Any]]):
        self.out_dir = out_dir
        self.shard_index = shard_index
        self.differences = differences
        st_path, _ = shard_paths(out_dir, shard_index)
        older = (
            f" (written in format version {differences[FORMAT_META_KEY][0]} of this project's shard files; this "
            f"version reads {FORMAT_VERSION} only, so its states must be extracted again)"
            if FORMAT_META_KEY in differences
            else ""
        )
        head = (
            f" (the target's final norm / lm_head in {Path(out_dir) / TARGET_HEAD_FILE} was rewritten since: its "
            "checkpoint changed in place or another one was used)"
            if HEAD_META_KEY in differences
            else ""
        )
        super().__init__(
            f"hidden-state shard {shard_index:05d} ({st_path}) was extracted with other settings: "
            f"{describe_diff(differences)}{older}{head}. It is neither reused nor overwritten. To extract it again under the "
            f"current settings, set hidden_states.on_settings_change: redo (Python API: on_mismatch='redo'); the "
            f"old files are then moved to {Path(out_dir) / SUPERSEDED_DIR}/. To keep the old states, restore the "
            "settings they were extracted with."
        )

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across process pools despite the custom signature
        return type(self), (self.out_dir, self.shard_index, self.differences)


class ShardsNotReadyError(RuntimeError):
    """Not every shard of the merged table is done under the wanted fingerprint (raised before any export)."""

    def __init__(self, message: str, states: list[ShardState]):
        super().__init__(message)
        self.states = states

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.states)


def stored_fingerprint(out_dir: str | Path, shard_index: int) -> ExtractionFingerprint:
    """The fingerprint a shard's index records."""
    return recorded_fingerprint(read_index_meta(shard_paths(out_dir, shard_index)[1]))


def shard_state(
    out_dir: str | Path, shard_index: int, wanted: ExtractionFingerprint, *, check_hash: bool = True
) -> ShardState:
    """`format.shard_status`, plus `stale` for a done shard whose fingerprint differs from `wanted`, or that an
    older `format.FORMAT_VERSION` wrote (its facts are not read: the version alone decides)."""
    status = shard_status(out_dir, shard_index, check_hash=check_hash)
    if status != "done":
        return ShardState(shard_index, status)
    meta = read_index_meta(shard_paths(out_dir, shard_index)[1])
    written = meta.get(FORMAT_META_KEY)
    if written != FORMAT_VERSION:
        return ShardState(shard_index, "stale", {FORMAT_META_KEY: (written, FORMAT_VERSION)})
    differences = wanted.diff(recorded_fingerprint(meta))
    # The head recorded beside the shards was rewritten since this shard was cut (its checkpoint changed in place):
    # its states, and every check judged with its head, belong to the old one.
    recorded = meta.get(HEAD_META_KEY)
    current = head_changed(out_dir, recorded)
    if current is not None:
        differences[HEAD_META_KEY] = (recorded, current)
    return ShardState(shard_index, "stale", differences) if differences else ShardState(shard_index, "done")


def done_summary(out_dir: str | Path, shard_index: int) -> ShardSummary:
    """The summary a done shard's index records, marked `skipped`."""
    idx_path = shard_paths(out_dir, shard_index)[1]
    return ShardSummary.from_index(read_index_meta(idx_path), idx_path, skipped=True)


@dataclass(frozen=True)
class ShardDecision:
    state: ShardState  # as found, before anything was moved or removed
    reuse: ShardSummary | None  # the done shard's summary; None = extract it now


def prepare_shard(
    out_dir: str | Path,
    shard_index: int,
    wanted: ExtractionFingerprint,
    state: ShardState | None = None,
    *,
    on_mismatch: str = "refuse",
) -> ShardDecision:
    """Decide whether shard `shard_index` is reused or extracted, and clear the way for an extraction (its one
    caller is `run.run_shard`, the stage's one decision). `state`: the shard's `shard_state` under `wanted`, when
    the caller has it already (the digest is read once).

    done -> reused; partial -> its files are deleted (a broken shard holds nothing worth keeping); stale ->
    `ShardMismatchError` naming every differing field when `on_mismatch='refuse'` (the default: GPU-days are not
    thrown away on a typo), or, with 'redo', its files are moved to `superseded/<old fingerprint>/`.
    """
    if on_mismatch not in ON_MISMATCH:
        raise ValueError(f"on_mismatch must be one of {ON_MISMATCH}, got {on_mismatch!r}")
    out_dir = Path(out_dir)
    state = state or shard_state(out_dir, shard_index, wanted)
    if state.status == "done":
        return ShardDecision(state, done_summary(out_dir, shard_index))
    if state.status == "stale":
        if on_mismatch == "refuse":
            raise ShardMismatchError(out_dir, shard_index, state.differences)
        supersede_shard(out_dir, shard_index)
    remove_shard(out_dir, shard_index)
    return ShardDecision(state, None)


def supersede_shard(out_dir: str | Path, shard_index: int) -> Path:
    """Move a shard's two files to `superseded/<its fingerprint digest>/` (`format-v<N>/` for a shard of an older
    format: a rename, no copy, no data lost). The index goes first, so the main folder never holds an index without
    its file."""
    meta = read_index_meta(shard_paths(out_dir, shard_index)[1])
    written = meta.get(FORMAT_META_KEY)
    name = recorded_fingerprint(meta).digest() if written == FORMAT_VERSION else f"format-v{written}"
    dest = Path(out_dir) / SUPERSEDED_DIR / name
    dest.mkdir(parents=True, exist_ok=True)
    st_path, idx_path = shard_paths(out_dir, shard_index)
    os.replace(idx_path, dest / idx_path.name)
    os.replace(st_path, dest / st_path.name)
    return dest


def require_shards_ready(
    out_dir: str | Path, merged_dir: str | Path, wanted: ExtractionFingerprint, *, check_hash: bool = True
) -> list[ShardState]:
    """Every shard of the merged table is done under `wanted`, and all of them under one fingerprint; else
    `ShardsNotReadyError` naming each shard that is missing, partial, stale (with what differs), or a shard file
    beyond the table's shards (a trainer globbing the folder would read it). Nothing is written or moved."""
    out_dir = Path(out_dir)
    n = num_shards(count_rows(merged_dir), wanted.shard_size)
    states = [shard_state(out_dir, i, wanted, check_hash=check_hash) for i in range(n)]
    problems: list[str] = []
    for status in ("missing", "partial"):
        bad = [f"{s.shard_index:05d}" for s in states if s.status == status]
        if bad:
            problems.append(f"{status}: {bad}")
    stale = [s for s in states if s.status == "stale"]
    if stale:
        shown = "; ".join(f"{s.shard_index:05d} ({describe_diff(s.differences)})" for s in stale[:5])
        more = f" and {len(stale) - 5} more" if len(stale) > 5 else ""
        problems.append(f"extracted under other settings: {shown}{more}")
    extra = sorted(p.name for p in out_dir.glob("shard-*.*") if shard_number(p.name) >= n)
    if extra:
        problems.append(f"shard files beyond the {n} shards of the current merged table: {extra}")
    digests = {stored_fingerprint(out_dir, s.shard_index).digest() for s in states if s.status == "done"}
    if len(digests) > 1:
        problems.append(f"done shards were extracted under {len(digests)} different fingerprints (e.g. dtypes)")
    if problems:
        raise ShardsNotReadyError(
            f"hidden states in {out_dir} are not ready for export: " + " | ".join(problems) + ". Materialize "
            "hidden_states for those shards (see docs/troubleshooting.md); nothing was exported.",
            states,
        )
    return states
