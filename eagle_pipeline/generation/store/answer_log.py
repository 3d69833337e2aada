"""The answer log: every row a run produced, durable within ~0.1 s, until a Parquet shard holds it.

Rows reach the committed shards only at the commit window (`commit_every_rows` / `commit_every_s`); a kill -9 before
that would lose answers that were paid for. So every row is also appended to a log beside the shards, in segments
`answers-NNNNNN.log`: one segment per commit window, deleted once the shards holding its rows are committed. The next
run (or `retire-responses`) folds what a killed run left into shards first (`shards.recover_answer_log`).

Format: a sequence of frames `MAGIC | length (u32 LE) | crc32 of the payload (u32 LE) | payload`, the payload one
kind byte (`R` a responses row, `E` an errors row) and the row as a JSON object (orjson; a float NaN or infinity,
which no JSON body can carry, would be stored as null). The magic holds two control bytes JSON never contains raw.

Reading: a frame whose magic, length or crc is wrong is damaged. If a whole frame follows it, the damage is in the
middle of the file (outside damage: a killed writer can only cut the tail, and a segment is never appended to after a
restart); its bytes are skipped, reported, and every whole frame after them kept, so only the rows in the damaged
bytes are requested again (never a wrong row: each kept frame passed its crc). Otherwise it is a torn tail (a kill or
power loss mid-write) and dropped.

Writing: the event loop only encodes a frame and appends it to a buffer; one writer thread writes the buffers every
`flush_interval_s` (`generation.answer_log_s` in the configuration) and fsyncs them, so a worker never waits for the
disk.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from eagle_pipeline.shared import storage

log = logging.getLogger("eagle_pipeline.generation")

MAGIC = b"\xe5\x1fA\x0b"
_HEADER = struct.Struct("<4sII")
HEADER_SIZE = _HEADER.size
MAX_PAYLOAD = 1 << 30  # a larger length field is damage, not a row
RESPONSE_ROW = b"R"
ERROR_ROW = b"E"
KINDS = (RESPONSE_ROW, ERROR_ROW)
DEFAULT_FLUSH_S = 0.05  # rows written and fsynced within ~0.05 s plus one fsync: well inside 0.1 s

_SEGMENT = re.compile(r"^answers-(\d{6,})\.log$")


def segment_path(directory: str | os.PathLike, seq: int) -> Path:
    return Path(directory) / f"answers-{seq:06d}.log"


def segment_files(directory: str | os.PathLike) -> list[Path]:
    """The log segments of a directory, oldest first."""
    return storage.numbered_files(directory, _SEGMENT)


def encode_frame(kind: bytes, row: dict[str, Any]) -> bytes:
    """One frame: the header, then the kind byte and the row as JSON."""
    payload = kind + orjson.dumps(row)
    return _HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


@dataclass
class DecodedFrames:
    """The rows of one segment's bytes, and what was damaged."""

    rows: list[tuple[bytes, dict[str, Any]]] = field(default_factory=list)  # (kind, row), in write order
    torn_tail_bytes: int = 0  # bytes after the last whole frame (a cut write)
    damaged: list[tuple[int, int]] = field(default_factory=list)  # (offset, length) of skipped bytes mid-file


def _frame_at(data: bytes, pos: int) -> tuple[bytes, dict[str, Any], int] | None:
    """The frame starting at `pos` and the offset after it, or None if there is no whole, valid frame there."""
    if len(data) - pos < HEADER_SIZE:
        return None
    magic, length, crc = _HEADER.unpack_from(data, pos)
    start, end = pos + HEADER_SIZE, pos + HEADER_SIZE + length
    if magic != MAGIC or length < 1 or length > MAX_PAYLOAD or end > len(data):
        return None
    payload = data[start:end]
    if zlib.crc32(payload) != crc or payload[:1] not in KINDS:
        return None
    try:
        row = orjson.loads(payload[1:])
    except orjson.JSONDecodeError:
        return None
    if not isinstance(row, dict):
        return None
    return payload[:1], row, end


def decode_frames(data: bytes) -> DecodedFrames:
    """Every whole, valid frame of `data`; a damaged stretch is skipped up to the next valid frame, or is the tail."""
    out = DecodedFrames()
    pos = 0
    while pos < len(data):
        frame = _frame_at(data, pos)
        if frame is not None:
            kind, row, pos = frame
            out.rows.append((kind, row))
            continue
        nxt = data.find(MAGIC, pos + 1)
        while nxt >= 0 and _frame_at(data, nxt) is None:
            nxt = data.find(MAGIC, nxt + 1)
        if nxt < 0:
            out.torn_tail_bytes = len(data) - pos
            break
        out.damaged.append((pos, nxt - pos))
        pos = nxt
    return out


@dataclass
class LogContents:
    """What the segments of a directory hold."""

    files: list[Path]
    responses: list[dict[str, Any]]
    errors: list[dict[str, Any]]
    torn_tail_bytes: int
    damaged: list[str]  # "file: N bytes at offset O"


def read_log(directory: str | os.PathLike) -> LogContents:
    """The rows of every segment of `directory` in write order, torn tails dropped and damaged stretches reported."""
    files = segment_files(directory)
    contents = LogContents(files, [], [], 0, [])
    for path in files:
        decoded = decode_frames(path.read_bytes())
        for kind, row in decoded.rows:
            (contents.responses if kind == RESPONSE_ROW else contents.errors).append(row)
        contents.torn_tail_bytes += decoded.torn_tail_bytes
        contents.damaged += [f"{path}: {n} bytes at offset {off}" for off, n in decoded.damaged]
    return contents


def remove_segments(paths: list[Path]) -> None:
    """Delete folded segments (their rows are in committed shards), durably."""
    for p in paths:
        p.unlink(missing_ok=True)
    if paths:
        storage.fsync_dir(paths[0].parent)


class Segment:
    """One commit window's frames: appended by the event loop, written by the log's thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pending: list[bytes] = []
        self.frames = 0
        self.fd: int | None = None
        self.sealed = False  # no more frames: the commit window ended
        self.released = False  # its rows are in committed shards: delete it


class AnswerLog:
    """The writer of a directory's answer log: `append` on the event loop, writes and fsyncs on one thread.

    `rotate` ends the current segment at a commit (it holds exactly the rows that commit takes) and `release` deletes
    it once the commit's shards are durable. Construct it only after folding what an earlier run left
    (`shards.recover_answer_log`): a segment found here would otherwise be overwritten or folded twice.
    """

    def __init__(self, directory: str | os.PathLike, flush_interval_s: float = DEFAULT_FLUSH_S) -> None:
        self.directory = Path(directory)
        left = segment_files(self.directory)
        if left:
            raise RuntimeError(
                f"{left[0]}: an answer log an earlier run left is not folded into shards yet "
                "(shards.recover_answer_log folds it)"
            )
        self.flush_interval_s = flush_interval_s
        self._seq = 0
        self._lock = threading.Lock()
        self._segments: list[Segment] = []
        self._current = self._new_segment()
        self._closing = threading.Event()
        self.error: BaseException | None = None
        self.fsyncs = 0
        self._thread = threading.Thread(target=self._run, name="eagle-answer-log", daemon=True)
        self._thread.start()

    def _new_segment(self) -> Segment:
        self._seq += 1
        seg = Segment(segment_path(self.directory, self._seq))
        self._segments.append(seg)
        return seg

    def append(self, kind: bytes, row: dict[str, Any]) -> None:
        """Add one row to the current segment (written and fsynced within `flush_interval_s`)."""
        frame = encode_frame(kind, row)
        with self._lock:
            self._current.pending.append(frame)
            self._current.frames += 1

    def rotate(self) -> Segment | None:
        """End the current segment (None if it has no frame) and start the next one."""
        with self._lock:
            seg = self._current
            if not seg.frames:
                return None
            seg.sealed = True
            self._current = self._new_segment()
            return seg

    def release(self, seg: Segment) -> None:
        """The segment's rows are in committed shards: it is deleted (any thread may call this)."""
        with self._lock:
            seg.released = True

    def _take(self) -> tuple[list[tuple[Segment, list[bytes]]], list[Segment]]:
        """Frames to write per segment, and the segments that are done (sealed, nothing left to write)."""
        writes, done = [], []
        with self._lock:
            for seg in self._segments:
                if seg.released:
                    seg.pending = []  # already in a shard: no need to write it
                if seg.pending:
                    writes.append((seg, seg.pending))
                    seg.pending = []
                elif seg.sealed:
                    done.append(seg)
        return writes, done

    def _flush(self) -> None:
        writes, done = self._take()
        created = False
        for seg, frames in writes:
            if seg.fd is None:
                seg.fd = os.open(seg.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
                created = True
            data = memoryview(b"".join(frames))
            while data:
                data = data[os.write(seg.fd, data) :]
        for seg, _ in writes:
            if seg.fd is not None:
                os.fsync(seg.fd)
                self.fsyncs += 1
        if created:
            storage.fsync_dir(self.directory)  # the new segment's name survives a power loss too
        removed = False
        for seg in done:
            if seg.fd is not None:
                os.close(seg.fd)
                seg.fd = None
            if seg.released:
                seg.path.unlink(missing_ok=True)
                removed = True
                with self._lock:
                    self._segments.remove(seg)
        if removed:
            storage.fsync_dir(self.directory)

    def _run(self) -> None:
        try:
            while True:
                closing = self._closing.wait(self.flush_interval_s)
                self._flush()
                if closing:
                    self._flush()  # segments released by the last pass's writes are deleted now
                    return
        except BaseException as exc:  # surfaced by the sink: the run must not report unlogged rows as safe
            self.error = exc
            log.error("answer log %s: %s: %s", self.directory, type(exc).__name__, exc)

    def close(self) -> None:
        """Write and fsync what is left, delete released segments, stop the thread. Unreleased segments stay on disk
        for the next run to fold."""
        with self._lock:
            self._current.sealed = True
        self._closing.set()
        self._thread.join()
        for seg in self._segments:
            if seg.fd is not None:
                os.close(seg.fd)
                seg.fd = None
