"""Committed shards of the responses and errors tables: atomic writes, resume scans (shards plus the answer log an
interrupted run left), reads."""

from __future__ import annotations

import fcntl
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle_pipeline.generation.store import answer_log
from eagle_pipeline.generation.store.identity import BackendIdentity, counting_identities
from eagle_pipeline.generation.store.rows import ERRORS_SCHEMA, RESPONSES_SCHEMA, ColumnBuffer
from eagle_pipeline.shared import storage

log = logging.getLogger("eagle_pipeline.generation")

_PART = re.compile(r"^part-(\d{5,})\.parquet$")
LOCK_NAME = ".generation.lock"
# Archives of retired rows (written by generation/store/retire.py): responses/<dataset>/retired/<stamp>/ + this
# manifest.
RETIRED_DIR = "retired"
RETIREMENT_MANIFEST = "retirement.json"


def part_files(directory: str | os.PathLike) -> list[Path]:
    """Committed shards of a directory, in commit order (never temporary files, never subdirectories)."""
    return storage.numbered_files(directory, _PART)


def next_part_index(directory: str | os.PathLike) -> int:
    files = part_files(directory)
    return int(_PART.match(files[-1].name).group(1)) + 1 if files else 0  # type: ignore[union-attr]


def part_path(directory: str | os.PathLike, index: int) -> Path:
    return Path(directory) / f"part-{index:05d}.parquet"


_CONVERSATION_COLUMNS = ("conversation_id", "turn_index", "conversation_end")


def read_shard_columns(p: Path, columns: list[str]) -> pa.Table:
    """Columns of a committed shard, from one open of the file."""
    try:
        with pq.ParquetFile(p) as f:
            missing = [c for c in columns if c not in f.schema_arrow.names]
            if not missing:
                return f.read(columns=columns)
    except Exception as exc:  # an atomically renamed file is complete; anything else is outside damage
        raise RuntimeError(f"{p}: committed shard unreadable ({exc}); move it aside to regenerate its rows") from exc
    raise RuntimeError(f"{p}: committed shard lacks the columns {missing}; move it aside to regenerate its rows")


def answered_ids(table: pa.Table) -> set[str]:
    """The prompts a responses table answers: each row's sample id, except that the turns of a regenerated
    conversation answer their conversation's id once every turn up to its last (`conversation_end`) is there."""
    sids = table.column("sample_id").to_pylist()
    if "conversation_id" not in table.column_names:
        return set(sids)
    conv, turn, end = (table.column(c).to_pylist() for c in _CONVERSATION_COLUMNS)
    turns: dict[str, set[int]] = {}
    last: dict[str, int] = {}
    for c, k, e in zip(conv, turn, end):
        if c is not None:
            turns.setdefault(c, set()).add(k)
            if e is not None:
                last[c] = k
    whole = {c for c, k in last.items() if turns[c] == set(range(k + 1))}  # a retired turn reopens it
    return {s for s, c in zip(sids, conv) if c is None} | whole


# What a run's start needs of every committed row: the prompts answered, the spend, the conversations to continue.
COMMITTED_COLUMNS = ("sample_id", "cost_usd", *_CONVERSATION_COLUMNS, "backend_identity")


@dataclass(frozen=True)
class CommittedState:
    """A dataset's committed rows as a run's start needs them, from one read of each shard (`read_committed`): the
    prompts they answer, the dataset's spend, the conversations to continue, and the rows themselves (counted by
    `coverage.current_row_count`). Read for a backend identity, only the rows it produced answer prompts (`rows`,
    `answered`, the conversations); the others are described in `mismatched` and still count in the spend."""

    out_dir: Path
    shards: tuple[tuple[Path, pa.Table], ...]  # each committed shard and its COMMITTED_COLUMNS, in commit order
    rows: pa.Table  # every committed row's COMMITTED_COLUMNS, in commit order (those an older shard lacks: null)
    answered: set[str]  # `answered_ids` of the rows
    spend_usd: float  # the dataset's committed spend (`read_committed`)
    counting: frozenset[str] | None = None  # the `backend_identity` values whose rows count (None: every row)
    mismatched: str = ""  # `identity.mismatch_report` of the rows that do not count ('' when every row counts)

    def open_conversations(self, wanted: set[str]) -> dict[str, tuple[int, dict[str, Any]]]:
        """The regenerated conversations of `wanted` (not answered: `answered_ids`) with committed turns: conversation
        id -> (index of its last committed turn, that row's messages and answer), what a resumed run continues from.
        Reads the wide columns of those last turns only, from the shards that hold them.

        Raises when one has committed turns after a missing one (a retired turn): those turns answer a history that
        no longer exists, and regenerating the missing turn would give a second row for them.
        """
        cols = ["conversation_id", "turn_index"]
        wide = ["messages_json", "reasoning", "content", "tool_calls_json", "finish_reason"]
        turns: dict[str, dict[int, tuple[Path, int]]] = {}
        for p, t in self.shards:
            if "conversation_id" not in t.column_names:
                continue
            ids = t.column("backend_identity").to_pylist() if "backend_identity" in t.column_names else [None] * len(t)
            for i, (c, k) in enumerate(zip(*(t.column(n).to_pylist() for n in cols))):
                if c in wanted and (self.counting is None or ids[i] in self.counting):
                    turns.setdefault(c, {})[int(k)] = (p, i)
        wanted_rows: dict[Path, list[tuple[str, int, int]]] = {}  # shard -> (conversation, last turn, row), read once
        for c, by_turn in turns.items():
            last = max(by_turn)
            if sorted(by_turn) != list(range(last + 1)):
                missing = sorted(set(range(last + 1)) - set(by_turn))
                raise RuntimeError(
                    f"{self.out_dir}: conversation {c} has committed turns {sorted(by_turn)} but not {missing} "
                    "(retired?); its later turns answer a history that no longer exists: retire the whole conversation"
                )
            path, row = by_turn[last]
            wanted_rows.setdefault(path, []).append((c, last, row))
        out: dict[str, tuple[int, dict[str, Any]]] = {}
        for path, picks in wanted_rows.items():
            rows = read_shard_columns(path, wide).take(pa.array([r for _, _, r in picks], pa.int64())).to_pylist()
            for (c, last, _), values in zip(picks, rows):
                out[c] = (last, values)
        return out


def read_committed(out_dir: str | os.PathLike, identity: BackendIdentity | None = None) -> CommittedState:
    """The committed rows of `out_dir` (their COMMITTED_COLUMNS, each shard read once), what they answer
    (`answered_ids`; with `identity`, only the rows that backend produced: `identity.matching_identities`), and the
    dataset's committed spend (for its budgets across resumes).

    The spend counts retired rows too (`retired_spend`): money spent stays spent when its rows are archived; and the
    answers in an answer log a killed run left that no shard holds yet (the next run of the dataset commits them),
    so a pipeline-wide budget read before that run counts them.
    """
    shards = tuple((p, read_shard_columns(p, list(COMMITTED_COLUMNS))) for p in part_files(out_dir))
    if shards:
        rows = pa.concat_tables([t for _, t in shards], promote_options="default")
    else:
        rows = pa.schema([RESPONSES_SCHEMA.field(c) for c in COMMITTED_COLUMNS]).empty_table()
    spend = float(pc.sum(rows.column("cost_usd")).as_py() or 0.0)
    logged = _logged_spend(out_dir, set(rows.column("sample_id").to_pylist()))
    counting, mismatched = None, ""
    if identity is not None:
        values, mismatched = counting_identities(identity, rows.column("backend_identity"))
        rows = rows.filter(pc.is_in(rows.column("backend_identity"), value_set=values))
        counting = frozenset(values.to_pylist())
    return CommittedState(
        out_dir=Path(out_dir),
        shards=shards,
        rows=rows,
        answered=answered_ids(rows),
        spend_usd=spend + logged + retired_spend(out_dir),
        counting=counting,
        mismatched=mismatched,
    )


def committed_sample_ids(out_dir: str | os.PathLike, identity: BackendIdentity | None = None) -> tuple[set[str], float]:
    """The prompts answered by committed rows (of `identity`'s backend, when given) and the dataset's committed spend
    (`read_committed`)."""
    state = read_committed(out_dir, identity)
    return state.answered, state.spend_usd


def _shard_row_ids(out_dir: str | os.PathLike) -> set[str]:
    """The sample ids of every committed row (each turn of a regenerated conversation has its own)."""
    ids: set[str] = set()
    for p in part_files(out_dir):
        ids.update(read_shard_columns(p, ["sample_id"]).column("sample_id").to_pylist())
    return ids


def _logged_spend(out_dir: str | os.PathLike, rows: set[str]) -> float:
    """The spend of the answer log's rows whose sample ids no shard row has (`rows`), each counted once."""
    if not answer_log.segment_files(out_dir):
        return 0.0
    seen = set(rows)
    total = 0.0
    for row in answer_log.read_log(out_dir).responses:
        sid = str(row.get("sample_id"))
        if sid not in seen:
            seen.add(sid)
            total += float(row.get("cost_usd") or 0.0)
    return total


def retirement_archives(out_dir: str | os.PathLike) -> list[Path]:
    """The committed retirement archives of a dataset, oldest first (never a hidden staging directory)."""
    d = Path(out_dir) / RETIRED_DIR
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))


def read_retirement(archive: Path) -> dict[str, Any]:
    """An archive's `retirement.json`: selection, rows, spend, and each live shard it changes (with its sha256)."""
    path = archive / RETIREMENT_MANIFEST
    if not path.is_file():  # every archive gets its manifest before it is renamed into place
        raise RuntimeError(
            f"{archive}: a directory under {RETIRED_DIR}/ without {RETIREMENT_MANIFEST}; it was not made by "
            f"retire-responses. Move it out of {archive.parent} (the spend ledger reads every archive there)"
        )
    return storage.read_json(path)


def live_shard_unchanged(out_dir: str | os.PathLike, entry: Mapping[str, Any]) -> bool:
    """Whether the live shard a retirement entry names is still as it was before that retirement."""
    live = Path(out_dir) / entry["shard"]
    return live.is_file() and storage.file_sha256(live) == entry["sha256_before"]


def retired_spend(out_dir: str | os.PathLike) -> float:
    """The spend recorded by every retired row of a dataset (the ledger's share of the archives)."""
    total = 0.0
    for archive in retirement_archives(out_dir):
        manifest = read_retirement(archive)
        for entry in manifest["shards"]:
            # Until the retirement is marked applied, a shard not yet moved or rewritten still counts as live.
            if manifest["applied"] or not live_shard_unchanged(out_dir, entry):
                total += float(entry["spend_usd"])
    return total


def write_shard(table: pa.Table, directory: str | os.PathLike, index: int) -> Path:
    return storage.write_parquet_atomic(table, part_path(directory, index))


@dataclass(frozen=True)
class LogRecovery:
    """What folding an interrupted run's answer log into shards did."""

    responses: int = 0  # rows the log held that no shard did: committed now, never requested again
    errors: int = 0
    already_committed: int = (
        0  # log rows a shard already held (the run was killed between a commit and the log's deletion)
    )
    torn_tail_bytes: int = 0  # a write cut by the kill: dropped
    damaged: list[str] = field(
        default_factory=list
    )  # stretches of outside damage skipped; their rows are requested again

    def describe(self) -> str:
        text = (
            f"folded the answer log of an interrupted run: {self.responses} responses and {self.errors} errors "
            f"committed ({self.already_committed} rows were committed already"
        )
        if self.torn_tail_bytes:
            text += f"; a torn tail of {self.torn_tail_bytes} bytes dropped"
        return text + ")"


def _committed_error_keys(errors_dir: str | os.PathLike) -> set[tuple[str | None, int]]:
    """(sample_id, at in microseconds) of every committed errors row: what makes a logged errors row committed."""
    keys: set[tuple[str | None, int]] = set()
    for p in part_files(errors_dir):
        t = pq.read_table(p, columns=["sample_id", "at"])
        keys.update(zip(t.column("sample_id").to_pylist(), t.column("at").cast(pa.int64()).to_pylist()))
    return keys


def recover_answer_log(out_dir: str | os.PathLike, errors_dir: str | os.PathLike) -> LogRecovery:
    """Fold the answer log a killed run left in `out_dir` into shards, then delete it. Hold the DirLock.

    Idempotent: rows already in a committed shard (a sample id in `out_dir`, an errors row with the same sample id and
    time in `errors_dir`) are not written again, so a kill during this fold, or between a commit and the deletion of
    its log segment, duplicates nothing. The segments go only after the new shards are durable.
    """
    contents = answer_log.read_log(out_dir)
    if not contents.files:
        return LogRecovery()
    for where in contents.damaged:
        log.warning(
            "answer log damaged (not by a kill: a kill only cuts the tail): %s skipped; the rows in them "
            "are requested again",
            where,
        )
    done = _shard_row_ids(out_dir)  # by row: each turn of a regenerated conversation is its own row
    responses = ColumnBuffer(RESPONSES_SCHEMA)
    for row in contents.responses:
        sid = str(row.get("sample_id"))
        if sid not in done:
            done.add(sid)
            responses.append(row)
    err_keys = _committed_error_keys(errors_dir)
    errors = ColumnBuffer(ERRORS_SCHEMA)
    for row in contents.errors:
        key = (row.get("sample_id"), int(row.get("at") or 0))
        if key not in err_keys:
            err_keys.add(key)
            errors.append(row)
    n_resp, n_err = len(responses), len(errors)
    table = responses.take()
    if table is not None:
        write_shard(table, out_dir, next_part_index(out_dir))
    table = errors.take()
    if table is not None:
        write_shard(table, errors_dir, next_part_index(errors_dir))
    answer_log.remove_segments(contents.files)
    recovery = LogRecovery(
        responses=n_resp,
        errors=n_err,
        already_committed=len(contents.responses) + len(contents.errors) - n_resp - n_err,
        torn_tail_bytes=contents.torn_tail_bytes,
        damaged=contents.damaged,
    )
    log.info("%s: %s", out_dir, recovery.describe())
    return recovery


def _read_parts(directory: str | os.PathLike, schema: pa.Schema) -> pa.Table:
    tables = [pq.read_table(p, schema=schema, columns=schema.names) for p in part_files(directory)]
    if not tables:
        return schema.empty_table()
    return pa.concat_tables(tables)


# What identifies a committed row: every read of the responses includes it.
_ROW_KEY = ("sample_id", "backend_identity")


def read_responses(out_dir: str | os.PathLike, columns: Sequence[str] | None = None) -> pa.Table:
    """All committed response shards, concatenated in commit order; with `columns`, only those and the row key
    (so that a reader of the texts does not read `raw_response_json`, 60% of a shard's bytes).

    A sample id appears once per backend identity by construction (a prompt is requested again only when the rows
    of it on disk came from another backend: generation/store/identity.py); should two shards ever hold the same pair
    (e.g. shards copied in by hand), the first is kept and the count of dropped rows is logged and stored in the schema
    metadata `duplicates_dropped`.
    """
    names = RESPONSES_SCHEMA.names if columns is None else list(dict.fromkeys([*_ROW_KEY, *columns]))
    table = _read_parts(out_dir, pa.schema([RESPONSES_SCHEMA.field(n) for n in names]))
    dropped = 0
    pair = list(_ROW_KEY)
    if table.num_rows and table.select(pair).group_by(pair).aggregate([]).num_rows < table.num_rows:
        keys = list(zip(*(table.column(c).to_pylist() for c in pair)))
        seen: set[tuple[str, str | None]] = set()
        keep = []
        for i, key in enumerate(keys):
            if key not in seen:
                seen.add(key)
                keep.append(i)
        dropped = table.num_rows - len(keep)
        table = table.take(pa.array(keep, type=pa.int64()))
        log.warning(
            "%s: dropped %d duplicate response rows (kept the first of each sample_id and backend)", out_dir, dropped
        )
    return table.replace_schema_metadata({"duplicates_dropped": str(dropped)})


def read_errors(errors_dir: str | os.PathLike) -> pa.Table:
    """All committed error shards (every failed request of every run, in commit order)."""
    return _read_parts(errors_dir, ERRORS_SCHEMA)


class DirLock:
    """An exclusive advisory lock on an output directory: two runs appending to one dataset would break exactly-once.

    flock is released by the kernel when the holder dies, so a kill -9 never leaves a stale lock.
    """

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / LOCK_NAME
        self._fd: int | None = None

    def __enter__(self) -> DirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"{self.path.parent}: another generation run holds {LOCK_NAME}") from None
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
