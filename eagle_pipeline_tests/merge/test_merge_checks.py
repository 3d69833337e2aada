from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle_pipeline.merge import (
    MERGED_SCHEMA,
    MergeInput,
    MergeSettings,
    check_loss_mask_aligned,
    check_row_count,
    check_shard_hashes,
    check_supervised_spans_end_with_eot,
    check_unique_sample_ids,
    merge_datasets,
)

EOT = 163586  # Kimi <|im_end|>; the conftest builds outputs ending in it


@pytest.fixture
def merged(tmp_path, write_tokens) -> Path:
    pa_path, _ = write_tokens("A", 30, seed=11)
    pb_path, _ = write_tokens("B", 30, seed=12)
    out = tmp_path / "m"
    merge_datasets([MergeInput("A", pa_path), MergeInput("B", pb_path)], out, MergeSettings(rows_per_shard=25))
    return out


def _edit_shard(path: Path, edit) -> None:
    """Rewrite one shard after `edit(rows)` mutates its rows (a list of dicts) in place."""
    rows = pq.read_table(path).to_pylist()
    edit(rows)
    pq.write_table(pa.Table.from_pylist(rows, schema=MERGED_SCHEMA), path)


def test_clean_merge_passes_every_check(merged):
    assert check_row_count(merged, 60).passed
    assert check_unique_sample_ids(merged).passed
    r = check_loss_mask_aligned(merged)
    assert r.passed and r.counts["rows"] == 60
    e = check_supervised_spans_end_with_eot(merged, EOT)
    assert e.passed and e.counts["spans"] == 60 and e.failing_sample_ids == []


def test_wrong_row_count_caught(merged):
    r = check_row_count(merged, 61)
    assert not r.passed and r.counts == {"rows": 60, "expected_rows": 61, "failing_rows": 1}


def test_duplicate_id_caught(merged):
    shard = merged / "part-00001.parquet"

    def dup(rows):
        rows[3]["sample_id"] = rows[0]["sample_id"]

    victim = pq.read_table(shard)["sample_id"][0].as_py()
    _edit_shard(shard, dup)
    r = check_unique_sample_ids(merged)
    assert not r.passed and r.failing_sample_ids == [victim] and r.counts["duplicated_ids"] == 1


def test_misaligned_mask_caught(merged):
    shard = merged / "part-00000.parquet"
    victim = pq.read_table(shard)["sample_id"][4].as_py()

    def cut(rows):
        rows[4]["loss_mask"] = rows[4]["loss_mask"][:-1]

    _edit_shard(shard, cut)
    r = check_loss_mask_aligned(merged)
    assert not r.passed and r.failing_sample_ids == [victim] and r.counts["misaligned"] == 1
    # The eot check cannot judge that row and must say so rather than pass it.
    e = check_supervised_spans_end_with_eot(merged, EOT)
    assert not e.passed and e.counts["unchecked_misaligned"] == 1 and victim in e.failing_sample_ids


def test_non_binary_mask_caught(merged):
    shard = merged / "part-00002.parquet"
    victim = pq.read_table(shard)["sample_id"][1].as_py()

    def two(rows):
        rows[1]["loss_mask"][-1] = 2

    _edit_shard(shard, two)
    r = check_loss_mask_aligned(merged)
    assert not r.passed and r.failing_sample_ids == [victim] and r.counts["non_binary_mask"] == 1


def test_span_not_ending_in_eot_caught(merged):
    shard = merged / "part-00001.parquet"
    table = pq.read_table(shard)
    end_victim = table["sample_id"][2].as_py()
    inner_victim = table["sample_id"][6].as_py()

    def corrupt(rows):
        rows[2]["input_ids"][-1] = 5  # truncated target: last supervised token is not eot
        # Two supervised spans; the first ends on a non-eot token, the second (final) one is fine.
        r = rows[6]
        r["input_ids"] = [1, 2, 3, 4, EOT]
        r["loss_mask"] = [0, 1, 0, 1, 1]
        r["n_tokens"] = 5

    _edit_shard(shard, corrupt)
    e = check_supervised_spans_end_with_eot(merged, EOT)
    assert not e.passed
    assert sorted(e.failing_sample_ids) == sorted([end_victim, inner_victim])
    assert e.counts["spans_not_ending_in_eot"] == 2 and e.counts["spans"] == 61
    assert check_loss_mask_aligned(merged).passed


def test_row_without_supervised_tokens_is_counted_not_failed(merged):
    shard = merged / "part-00000.parquet"

    def unsupervise(rows):
        rows[0]["loss_mask"] = [0] * len(rows[0]["loss_mask"])

    _edit_shard(shard, unsupervise)
    e = check_supervised_spans_end_with_eot(merged, EOT)
    assert e.passed and e.counts["rows_without_supervised_tokens"] == 1 and e.counts["spans"] == 59


def test_shard_hashes_match_manifest_and_catch_edits(merged):
    assert check_shard_hashes(merged).passed
    (merged / "part-00009.parquet").write_bytes(b"stray")
    _edit_shard(merged / "part-00000.parquet", lambda rows: rows.pop())
    r = check_shard_hashes(merged)
    assert not r.passed and r.counts["unlisted"] == 1 and r.counts["hash_mismatch"] == 1
    (merged / "part-00001.parquet").unlink()
    assert check_shard_hashes(merged).counts["missing"] == 1


def test_the_check_registry_runs_each_check_and_asks_for_the_eot_id_only_where_needed(merged):
    """MERGED_CHECKS (the four blocking checks the UI shows): all pass on a clean merge, the row count against the
    manifest's admitted rows; only the end-of-turn check asks for the id (it loads the tokenizer)."""
    from eagle_pipeline.merge.checks import MERGED_CHECKS, MergedCheckContext

    asked: list[str] = []

    def eot_for(name: str):
        return MergedCheckContext(merged, lambda: asked.append(name) or EOT)

    results = {spec.name: spec.run(eot_for(spec.name)) for spec in MERGED_CHECKS}
    assert all(results[spec.name].name == spec.result for spec in MERGED_CHECKS)
    assert all(r.passed for r in results.values()), results
    assert results["rows_match_admitted"].counts["expected_rows"] == 60
    assert asked == ["spans_end_with_eot"]
    _edit_shard(sorted(merged.glob("part-*.parquet"))[0], lambda r: r.pop())  # one admitted row lost
    assert not MERGED_CHECKS[0].run(eot_for("again")).passed
