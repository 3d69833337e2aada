"""Atomic file writes and the data-root layout.

Every file the pipeline produces is written to a temporary name in the same directory, fsynced, then renamed
into place: a reader (or a resumed run) never sees a partial file, even after kill -9.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

TMP_SUFFIX = ".tmp"
ERRORS_SUBDIR = "errors"  # a dataset's errors shards, under its responses directory


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success fsync it and rename it onto `path`, with the mode a new file
    gets under the umask (0666 less the umask) whatever the writer in between did to it."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _create_tmp(final)
    mode = stat.S_IMODE(tmp.stat().st_mode)  # what this umask (and the directory's default ACL) gives a new file
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            # A writer that replaced the file by its own temporary (safetensors' save_file does: 0600) gets the
            # mode every other file of the pipeline has; the rename would otherwise keep its 0600.
            if stat.S_IMODE(os.fstat(fh.fileno()).st_mode) != mode:
                os.fchmod(fh.fileno(), mode)
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        fsync_dir(final.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def _create_tmp(final: Path) -> Path:
    """A new, empty hidden file beside `final`, created with mode 0666 less the umask like any other file writer's
    (tempfile.mkstemp would make it 0600, and the rename would keep that mode)."""
    while True:
        tmp = final.parent / f".{final.name}.{secrets.token_hex(6)}{TMP_SUFFIX}"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in `directory` durable (best effort where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_parquet_atomic(table: pa.Table, path: str | os.PathLike, **kwargs: Any) -> Path:
    """Write `table` to `path` atomically (zstd-compressed Parquet)."""
    kwargs.setdefault("compression", "zstd")
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, **kwargs)
    return Path(path)


def write_json_atomic(obj: Any, path: str | os.PathLike) -> Path:
    """Write `obj` as indented JSON to `path` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    return Path(path)


def write_bytes_atomic(data: bytes, path: str | os.PathLike) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def read_json(path: str | os.PathLike) -> Any:
    p = Path(path)
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}: invalid JSON at line {exc.lineno}: {exc.msg}") from exc


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    return _file_digest(path, hashlib.sha256(), chunk)


def file_xxh3_128(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """The file's XXH3-128 (an integrity record, not a security one: ~12x cheaper than sha256 per GB)."""
    return _file_digest(path, xxhash.xxh3_128(), chunk)


def _file_digest(path: str | os.PathLike, h: Any, chunk: int) -> str:
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return str(h.hexdigest())


def numbered_files(directory: str | os.PathLike, pattern: re.Pattern[str]) -> list[Path]:
    """The files of `directory` whose names `pattern` matches, in the order of the number its first group captures
    (never subdirectories, never other names such as temporaries); none where the directory does not exist."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := pattern.match(p.name)) and p.is_file()]
    return [p for _, p in sorted(found)]


def clean_stale_tmp(directory: str | os.PathLike) -> int:
    """Remove temporary files a killed writer left behind; returns how many were removed."""
    d = Path(directory)
    if not d.exists():
        return 0
    n = 0
    for p in d.glob(f".*{TMP_SUFFIX}"):
        p.unlink(missing_ok=True)
        n += 1
    return n


@dataclass(frozen=True)
class DataRoot:
    """The layout of everything the pipeline writes under one data root."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root).resolve())

    def prompts(self, dataset: str) -> Path:
        return self.root / "prompts" / f"{dataset}.parquet"

    def responses_dir(self, dataset: str) -> Path:
        return self.root / "responses" / dataset

    def errors_dir(self, dataset: str) -> Path:
        return self.root / "responses" / dataset / ERRORS_SUBDIR

    def tokens(self, dataset: str) -> Path:
        return self.root / "tokens" / f"{dataset}.parquet"

    def audit_report(self, dataset: str) -> Path:
        return self.root / "audit" / f"{dataset}.json"

    @property
    def merged_dir(self) -> Path:
        return self.root / "merged"

    @property
    def draft_vocab_dir(self) -> Path:
        return self.root / "draft_vocab"

    @property
    def hidden_states_dir(self) -> Path:
        return self.root / "hidden_states"

    @property
    def exports_dir(self) -> Path:
        return self.root / "exports"

    @property
    def dagster_home(self) -> Path:
        return self.root / "dagster_home"


def iter_jsonl_objects(path: str | os.PathLike) -> Iterator[tuple[int, str, dict | None, str | None]]:
    """(line number, "file:line", object or None, problem or None) for each non-blank line of a JSONL file.

    A malformed line yields its problem instead of raising, so each caller decides whether it is fatal; the
    location string names the file and line for the error message either way.
    """
    p = Path(path)
    with p.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            text = line.rstrip("\r\n")  # with its newline, a line cut short is "line 2, column 1" of the text
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                end = ", the end of the line" if exc.pos >= len(text.rstrip()) else ""
                yield lineno, where, None, f"invalid JSON ({exc.msg} at column {exc.pos + 1}{end})"
                continue
            if not isinstance(obj, dict):
                yield lineno, where, None, f"expected a JSON object, got {type(obj).__name__}"
                continue
            yield lineno, where, obj, None
