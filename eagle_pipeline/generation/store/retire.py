"""Retire a dataset's committed responses (all, or one backend's or provider's): archived, never deleted.

Retired rows move to `responses/<dataset>/retired/<stamp>/`, out of the shards a run reads, so their prompts count as
unanswered and the next run requests them again. A selected turn of a regenerated conversation takes the
conversation's later turns with it (they answer a history that contained it), so the rerun continues from it. A shard whose rows are all retired moves whole; a shard that mixes
kept and retired rows is split: its retired rows are written to the archive under the shard's name and the shard is
rewritten, atomically, with the rows it keeps.

Crash safety: the archive (retired rows + `retirement.json`, which lists every live shard it changes with that shard's
sha256) is written under a hidden staging name and renamed into place first; that rename is the commit point. Only
then are the live shards moved or rewritten, and `retirement.json` is marked applied. An interrupted retirement is
completed by the next `retire_responses` or generation run on the dataset (`complete_pending_retirements`).

The spend ledger stays whole: `shards.retired_spend` counts the money spent on retired rows (an entry of an unapplied
retirement counts only once its live shard has changed, so no row is counted twice or never), and
`shards.committed_sample_ids` adds it to the committed spend that dataset and pipeline budgets read.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle_pipeline.generation.store import shards
from eagle_pipeline.shared import storage

STAGING_PREFIX = ".staging-"


@dataclass(frozen=True)
class RetirementSummary:
    """What one retirement moved out of a dataset's shards."""

    dataset: str
    archive: str | None  # the archive directory; None when no row matched
    selection: dict[str, str | None]
    rows_retired: int
    rows_kept: int
    spend_usd_retired: float
    shards_moved: int
    shards_rewritten: int
    by_backend_provider: dict[str, int] = field(default_factory=dict)
    completed_interrupted: int = 0  # earlier, interrupted retirements completed first

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        where = f" -> {self.archive}" if self.archive else ""
        return (
            f"{self.dataset}: retired {self.rows_retired} rows (${self.spend_usd_retired:.4f} spent on them, still "
            f"counted by the budgets), kept {self.rows_kept}; {self.shards_moved} shards moved, "
            f"{self.shards_rewritten} rewritten{where}"
        )


def _match(
    table: pa.Table, backend: str | None, provider: str | None, from_turn: Mapping[str, int] | None = None
) -> pa.Array:
    """The rows selected by backend and provider, and every turn of a regenerated conversation from the first of its
    turns selected anywhere on (`from_turn`): later turns answer the history the retired turn was part of."""
    mask = pa.array([True] * table.num_rows, pa.bool_())
    if backend is not None:
        mask = pc.and_(mask, pc.fill_null(pc.equal(table.column("backend"), backend), False))
    if provider is not None:
        mask = pc.and_(mask, pc.fill_null(pc.equal(table.column("provider"), provider), False))
    if from_turn and "conversation_id" in table.column_names:
        conv, turn = table.column("conversation_id").to_pylist(), table.column("turn_index").to_pylist()
        later = pa.array([c in from_turn and k >= from_turn[c] for c, k in zip(conv, turn)], pa.bool_())
        mask = pc.or_(mask, later)
    return mask


def _first_turns_selected(responses_dir: Path, backend: str | None, provider: str | None) -> dict[str, int]:
    """Conversation id -> the first of its turns the selection matches, over every committed shard."""
    first: dict[str, int] = {}
    for part in shards.part_files(responses_dir):
        t = shards.read_shard_columns(part, ["backend", "provider", "conversation_id", "turn_index"])
        if "conversation_id" not in t.column_names:
            continue
        hit = _match(t, backend, provider).to_pylist()
        for c, k, h in zip(t.column("conversation_id").to_pylist(), t.column("turn_index").to_pylist(), hit):
            if h and c is not None:
                first[c] = min(k, first.get(c, k))
    return first


def _spend(table: pa.Table) -> float:
    return float(pc.sum(table.column("cost_usd")).as_py() or 0.0) if table.num_rows else 0.0


def complete_pending_retirements(responses_dir: str | os.PathLike) -> int:
    """Finish retirements a crash interrupted after their commit point; returns how many. Hold the DirLock."""
    d = Path(responses_dir)
    done = 0
    for archive in shards.retirement_archives(d):
        manifest = shards.read_retirement(archive)
        if not manifest["applied"]:
            _apply(d, archive, manifest)
            done += 1
    return done


def _apply(responses_dir: Path, archive: Path, manifest: dict[str, Any]) -> None:
    for entry in manifest["shards"]:
        if not shards.live_shard_unchanged(responses_dir, entry):
            continue  # already moved or rewritten before the interruption
        live = responses_dir / entry["shard"]
        if entry["action"] == "moved":
            os.replace(live, archive / entry["shard"])
        else:
            table = pq.read_table(live)
            sel = manifest["selection"]
            keep = pc.invert(_match(table, sel["backend"], sel["provider"], manifest.get("conversations_from")))
            storage.write_parquet_atomic(table.filter(keep), live)
    storage.fsync_dir(archive)
    storage.fsync_dir(responses_dir)
    storage.write_json_atomic({**manifest, "applied": True}, archive / shards.RETIREMENT_MANIFEST)


def _stage_matching_rows(
    d: Path, staging: Path, backend: str | None, provider: str | None, from_turn: dict[str, int]
) -> tuple[list[dict[str, Any]], int, int, dict[str, int]]:
    """Each shard's rows that the selection retires: a shard's manifest entry, and its retired rows written to
    `staging` when the shard is split (a wholly retired shard is moved by rename after the commit point).
    Returns (entries, rows kept, rows retired, retired rows by backend/provider)."""
    entries: list[dict[str, Any]] = []
    kept = retired = 0
    by_source: dict[str, int] = {}
    for part in shards.part_files(d):
        table = pq.read_table(part)
        mask = _match(table, backend, provider, from_turn)
        n_match = int(pc.sum(mask.cast(pa.int64())).as_py() or 0)
        kept += table.num_rows - n_match
        if n_match == 0:
            continue
        gone = table.filter(mask)
        retired += n_match
        for b, p in zip(gone.column("backend").to_pylist(), gone.column("provider").to_pylist()):
            key = f"{b}/{p or 'unknown'}"
            by_source[key] = by_source.get(key, 0) + 1
        moved = n_match == table.num_rows
        if not moved:
            storage.write_parquet_atomic(gone, staging / part.name)
        entries.append(
            {
                "shard": part.name,
                "sha256_before": storage.file_sha256(part),
                "action": "moved" if moved else "split",
                "rows": n_match,
                "spend_usd": _spend(gone),
            }
        )
    return entries, kept, retired, by_source


def retire_responses(
    responses_dir: str | os.PathLike,
    *,
    dataset: str,
    backend: str | None = None,
    provider: str | None = None,
    now: dt.datetime | None = None,
    errors_dir: str | os.PathLike | None = None,
) -> RetirementSummary:
    """Archive the committed rows of `dataset` that match `backend` and `provider` (all rows when both are None).

    Takes the dataset's generation lock, so it never races a run. An answer log a killed run left is folded into
    shards first, its errors rows into `errors_dir` (default: `errors/` under the responses directory, the data-root
    layout). Raises FileNotFoundError when the dataset has no responses directory.
    """
    d = Path(responses_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: no committed responses for dataset {dataset!r}")
    selection = {"backend": backend, "provider": provider}
    with shards.DirLock(d):
        storage.clean_stale_tmp(d)
        completed = complete_pending_retirements(d)
        # Rows a killed run left in its answer log join the shards first: retiring a shard whose rows the log still
        # held would otherwise bring them back at the next run's fold.
        shards.recover_answer_log(d, errors_dir if errors_dir is not None else d / storage.ERRORS_SUBDIR)
        retired_root = d / shards.RETIRED_DIR
        if retired_root.is_dir():  # staging dirs of a retirement that never reached its commit point
            for p in retired_root.iterdir():
                if p.name.startswith(STAGING_PREFIX):
                    shutil.rmtree(p)
        stamp = (now or dt.datetime.now(dt.UTC)).strftime("%Y%m%dT%H%M%S%fZ")
        staging = retired_root / f"{STAGING_PREFIX}{stamp}"
        from_turn = _first_turns_selected(d, backend, provider)
        entries, kept, retired, by_source = _stage_matching_rows(d, staging, backend, provider, from_turn)
        if not entries:
            return RetirementSummary(dataset, None, selection, 0, kept, 0.0, 0, 0, {}, completed)
        manifest = {
            "dataset": dataset,
            "retired_at": stamp,
            "selection": selection,
            "conversations_from": from_turn,  # regenerated conversations retired from this turn on
            "applied": False,
            "rows": retired,
            "spend_usd": sum(e["spend_usd"] for e in entries),
            "by_backend_provider": dict(sorted(by_source.items())),
            "shards": entries,
        }
        storage.write_json_atomic(manifest, staging / shards.RETIREMENT_MANIFEST)
        archive = retired_root / stamp
        if archive.exists():
            raise FileExistsError(f"{archive}: a retirement with this timestamp already exists")
        os.replace(staging, archive)  # the commit point
        storage.fsync_dir(retired_root)
        _apply(d, archive, manifest)
        return RetirementSummary(
            dataset=dataset,
            archive=str(archive),
            selection=selection,
            rows_retired=retired,
            rows_kept=kept,
            spend_usd_retired=manifest["spend_usd"],
            shards_moved=sum(e["action"] == "moved" for e in entries),
            shards_rewritten=sum(e["action"] == "split" for e in entries),
            by_backend_provider=manifest["by_backend_provider"],
            completed_interrupted=completed,
        )
