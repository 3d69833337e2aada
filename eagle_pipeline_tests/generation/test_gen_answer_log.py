"""The answer log (issue 15, item 5): framing, torn tails at every byte offset, damaged frames, the writer thread,
the fold into shards (idempotent), and the sink keeping a failed commit's rows in the log."""

from __future__ import annotations

import asyncio
import time
import zlib

import pyarrow.parquet as pq
import pytest

from eagle_pipeline.generation.backends.wire import ParsedResponse, PromptItem
from eagle_pipeline.generation.spend.budget import pipeline_budget
from eagle_pipeline.generation.store import answer_log as L
from eagle_pipeline.generation.store.rows import (
    ERRORS_SCHEMA,
    RESPONSE_COLUMNS,
    RESPONSES_SCHEMA,
    ColumnBuffer,
    RowProvenance,
    error_row,
    response_values,
)
from eagle_pipeline.generation.store.shards import (
    committed_sample_ids,
    part_files,
    read_errors,
    read_responses,
    recover_answer_log,
    write_shard,
)
from eagle_pipeline.generation.store.sink import ShardSink

PROV = RowProvenance("B1", "simulated", "sim", "http://127.0.0.1:1", "m", None, '{"seed":7}', True)


def _values(i: int, *, ids: bool = False) -> tuple:
    """A responses row as the live runner builds it (unicode text, optional token ids, timestamps, floats)."""
    p = ParsedResponse(
        reasoning=f"thinking {i} 🤔 " * (i % 3 + 1),
        content=f'answer {i}: ünïcødé, quotes " and \\ and a newline\n' * (i % 4 + 1),
        tool_calls_json=None,
        finish_reason="stop",
        native_finish_reason="stop",
        provider="Sim",
        model="m",
        usage_prompt_tokens=10 + i,
        usage_completion_tokens=20 + i,
        usage_reasoning_tokens=5,
        cost_usd=0.1 + i / 3,
        generation_id=f"gen-{i}",
        prompt_token_ids=list(range(i, i + 40)) if ids else None,
        output_token_ids=[163585, 7, 2**31 - 1] if ids else None,
        stream_chunks=i if i % 2 else None,
    )
    item = PromptItem(f"B1-{i:04d}", f'[{{"role":"user","content":"q{i}"}}]', None)
    return response_values(
        PROV,
        item,
        p,
        latency_s=1.0 / (i + 3),
        attempts=1 + i % 2,
        started_us=1_767_225_600_123_456 + i,
        finished_us=1_767_225_601_654_321 + i,
        raw_response_json=f'{{"id": "gen-{i}"}}',
    )


def _row(i: int) -> dict:
    return dict(zip(RESPONSE_COLUMNS, _values(i, ids=i % 2 == 0)))


def _err(i: int) -> dict:
    row = error_row(
        sample_id=f"B1-{i:04d}",
        dataset="B1",
        backend="sim",
        error_class="timeout",
        http_status=None,
        message=f"no byte for 10 s ({i})",
        attempts=3,
    )
    row["at"] += i  # distinct times even within one microsecond
    return row


def _frames(n: int) -> tuple[bytes, list[int], list[tuple[bytes, dict]]]:
    """n frames (responses and errors mixed), their end offsets, and what they hold."""
    data, ends, rows = b"", [], []
    for i in range(n):
        kind, row = (L.ERROR_ROW, _err(i)) if i % 3 == 2 else (L.RESPONSE_ROW, _row(i))
        data += L.encode_frame(kind, row)
        ends.append(len(data))
        rows.append((kind, row))
    return data, ends, rows


def test_torn_tail_at_every_byte_offset_drops_only_the_cut_frame():
    data, ends, rows = _frames(5)
    for cut in range(len(data) + 1):
        d = L.decode_frames(data[:cut])
        whole = sum(1 for e in ends if e <= cut)
        assert d.rows == rows[:whole], cut
        assert d.torn_tail_bytes == cut - (ends[whole - 1] if whole else 0), cut
        assert d.damaged == [], cut


@pytest.mark.parametrize("where", ["payload", "crc", "magic", "length_longer", "length_shorter"])
def test_a_damaged_middle_frame_is_skipped_reported_and_the_rest_kept(where):
    data, ends, rows = _frames(6)
    start, end = ends[1], ends[2]  # the third frame
    buf = bytearray(data)
    if where == "payload":
        buf[end - 5] ^= 0x40
    elif where == "crc":
        buf[start + 8] ^= 0x01
    elif where == "magic":
        buf[start] ^= 0xFF
    else:
        length = int.from_bytes(buf[start + 4 : start + 8], "little")
        new = length + 300 if where == "length_longer" else length - 7
        buf[start + 4 : start + 8] = new.to_bytes(4, "little")
    d = L.decode_frames(bytes(buf))
    assert d.rows == rows[:2] + rows[3:]  # never a wrong row: every kept frame passed its crc
    assert d.damaged == [(start, end - start)] and d.torn_tail_bytes == 0


def test_damage_in_the_last_frame_is_a_torn_tail_and_zeros_mid_file_are_skipped():
    data, ends, rows = _frames(4)
    buf = bytearray(data)
    buf[-3] ^= 0x10
    d = L.decode_frames(bytes(buf))
    assert d.rows == rows[:3] and d.torn_tail_bytes == ends[3] - ends[2] and d.damaged == []
    # A hole of zeros (a power loss before the fsync, later data on disk) between frames 2 and 3.
    holed = data[: ends[1]] + bytes(4096) + data[ends[1] :]
    d = L.decode_frames(holed)
    assert d.rows == rows and d.damaged == [(ends[1], 4096)]
    assert L.decode_frames(bytes(100)).torn_tail_bytes == 100  # nothing but zeros: no row, no damage claimed
    # A frame with a valid crc but a kind or a payload the log never writes is damage too.
    bogus = b"X" + b"{}"
    frame = L.MAGIC + len(bogus).to_bytes(4, "little") + zlib.crc32(bogus).to_bytes(4, "little") + bogus
    d = L.decode_frames(data[: ends[0]] + frame + data[ends[0] :])
    assert d.rows == rows and d.damaged == [(ends[0], len(frame))]


def test_log_rows_fold_into_the_table_the_buffer_would_have_committed(tmp_path):
    """Exact round trip: a row recovered from the log is the row the commit would have written."""
    values = [_values(i, ids=i % 2 == 0) for i in range(7)]
    buf = ColumnBuffer(RESPONSES_SCHEMA)
    log = L.AnswerLog(tmp_path, flush_interval_s=0.01)
    for v in values:
        buf.append_values(v)
        log.append(L.RESPONSE_ROW, dict(zip(RESPONSE_COLUMNS, v)))
    log.append(L.ERROR_ROW, _err(99))
    log.close()  # no release: the segments stay, as after a kill
    expected = buf.take()
    rec = recover_answer_log(tmp_path, tmp_path / "errors")
    assert (rec.responses, rec.errors, rec.already_committed, rec.torn_tail_bytes) == (7, 1, 0, 0)
    assert read_responses(tmp_path).equals(expected.replace_schema_metadata({"duplicates_dropped": "0"}))
    errors = read_errors(tmp_path / "errors")
    assert errors.num_rows == 1 and errors.to_pylist()[0]["message"] == "no byte for 10 s (99)"
    assert L.segment_files(tmp_path) == []


def test_fold_is_idempotent_and_keeps_rows_already_committed_once(tmp_path):
    errors_dir = tmp_path / "errors"
    # Shard 0 (and an errors shard) was committed, then the run was killed before its log segment was deleted.
    committed = ColumnBuffer(RESPONSES_SCHEMA)
    for i in range(3):
        committed.append(_row(i))
    write_shard(committed.take(), tmp_path, 0)
    err0 = _err(0)
    errs = ColumnBuffer(ERRORS_SCHEMA)
    errs.append(err0)
    write_shard(errs.take(), errors_dir, 0)
    log = L.AnswerLog(tmp_path, flush_interval_s=0.01)
    for i in range(6):
        log.append(L.RESPONSE_ROW, _row(i))
    log.append(L.ERROR_ROW, err0)
    log.append(L.ERROR_ROW, _err(1))
    log.rotate()
    log.append(L.RESPONSE_ROW, _row(6))
    log.close()
    segs = L.segment_files(tmp_path)
    assert len(segs) == 2
    # A kill mid-write of the second segment left a torn frame behind it.
    torn = L.encode_frame(L.RESPONSE_ROW, _row(7))
    with open(segs[1], "ab") as fh:
        fh.write(torn[: len(torn) // 2])
    with pytest.raises(RuntimeError, match="not folded"):
        L.AnswerLog(tmp_path)
    # The ledger counts the logged answers no shard holds, each once, before the fold as after it.
    spend = sum(_row(i)["cost_usd"] for i in range(7))
    ids_before, spend_before = committed_sample_ids(tmp_path)
    assert len(ids_before) == 3 and spend_before == pytest.approx(spend)
    assert pipeline_budget(100.0, [tmp_path]).spent_usd == pytest.approx(spend)
    rec = recover_answer_log(tmp_path, errors_dir)
    assert committed_sample_ids(tmp_path)[1] == pytest.approx(spend)
    assert (rec.responses, rec.errors, rec.already_committed) == (4, 1, 4)
    assert rec.torn_tail_bytes == len(torn) // 2 and rec.damaged == []
    ids = read_responses(tmp_path).column("sample_id").to_pylist()
    assert ids == [f"B1-{i:04d}" for i in range(7)]  # each once; the torn row is not there
    assert sorted(read_errors(errors_dir).column("sample_id").to_pylist()) == ["B1-0000", "B1-0001"]
    assert L.segment_files(tmp_path) == [] and len(part_files(tmp_path)) == 2
    assert recover_answer_log(tmp_path, errors_dir).responses == 0  # nothing left to fold


def test_writer_thread_makes_rows_readable_without_close_and_deletes_released_segments(tmp_path):
    log = L.AnswerLog(tmp_path, flush_interval_s=0.02)
    try:
        for i in range(5):
            log.append(L.RESPONSE_ROW, _row(i))
        # Another reader (the next run after a kill -9) sees the rows while this writer is still open.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(L.read_log(tmp_path).responses) < 5:
            time.sleep(0.01)
        assert [r["sample_id"] for r in L.read_log(tmp_path).responses] == [f"B1-{i:04d}" for i in range(5)]
        first = log.rotate()
        assert first is not None and log.rotate() is None  # an empty segment is not a commit
        log.append(L.RESPONSE_ROW, _row(5))
        log.release(first)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and first.path.exists():
            time.sleep(0.01)
        assert not first.path.exists()
        assert log.fsyncs >= 1
    finally:
        log.close()
    assert [r["sample_id"] for r in L.read_log(tmp_path).responses] == ["B1-0005"]  # not released: kept


def test_a_failed_commit_keeps_its_rows_in_the_log_for_the_next_run(tmp_path):
    out = tmp_path / "responses"
    out.mkdir()
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the errors directory should be")

    async def run() -> None:
        sink = ShardSink(out, blocker / "errors", answer_log_s=0.01)
        for i in range(4):
            sink.add_response(_values(i))
        sink.add_error(_err(9))
        await sink.close()

    with pytest.raises(RuntimeError, match="writing a shard failed"):
        asyncio.run(run())
    rec = recover_answer_log(out, tmp_path / "errors")
    # The responses shard was written before the errors shard failed: only the error is new.
    assert (rec.responses, rec.errors, rec.already_committed) == (0, 1, 4)
    assert read_responses(out).num_rows == 4 and read_errors(tmp_path / "errors").num_rows == 1


def test_sink_commit_deletes_the_log_and_without_the_log_writes_none(tmp_path):
    async def run(answer_log_s: float | None, d) -> ShardSink:
        sink = ShardSink(d, d / "errors", answer_log_s=answer_log_s)
        for i in range(3):
            sink.add_response(_values(i))
        await sink.commit()
        sink.add_response(_values(3))
        await sink.close()
        return sink

    for flush, d in ((0.01, tmp_path / "a"), (None, tmp_path / "b")):
        d.mkdir()
        sink = asyncio.run(run(flush, d))
        assert sink.shards_written == 2
        assert [pq.read_table(p).num_rows for p in part_files(d)] == [3, 1]
        assert L.segment_files(d) == []


def test_fold_dedupes_regenerated_turns_by_row_not_by_conversation(tmp_path):
    """Turns of a conversation not yet whole answer no prompt, but each is a committed row: folded once."""

    def turn(k: int) -> dict:
        return dict(_row(k), sample_id=f"B1-conv-t{k}", conversation_id="B1-conv", turn_index=k)

    committed = ColumnBuffer(RESPONSES_SCHEMA)
    committed.append(turn(0))
    write_shard(committed.take(), tmp_path, 0)
    log = L.AnswerLog(tmp_path, flush_interval_s=0.01)
    for k in (0, 1):  # turn 0 was committed, then the run was killed before its segment was deleted
        log.append(L.RESPONSE_ROW, turn(k))
    log.close()
    spend = turn(0)["cost_usd"] + turn(1)["cost_usd"]
    assert committed_sample_ids(tmp_path)[1] == pytest.approx(spend)
    rec = recover_answer_log(tmp_path, tmp_path / "errors")
    assert (rec.responses, rec.already_committed) == (1, 1)
    t = read_responses(tmp_path)
    assert t.column("sample_id").to_pylist() == ["B1-conv-t0", "B1-conv-t1"]
    assert t.column("turn_index").to_pylist() == [0, 1]
    assert committed_sample_ids(tmp_path)[1] == pytest.approx(spend)
