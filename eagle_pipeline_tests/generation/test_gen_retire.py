"""Retiring committed responses: archived (never deleted), whole shards moved, mixed shards split, the spend ledger
exact at every step, an interrupted retirement completed; and coverage of the current prompts by sample id."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from eagle_pipeline.generation.run.options import RunOptions
from eagle_pipeline.generation.store import retire
from eagle_pipeline.generation.store.coverage import coverage_of, current_responses, dataset_coverage
from eagle_pipeline.generation.store.retire import complete_pending_retirements, retire_responses
from eagle_pipeline.generation.store.shards import committed_sample_ids, part_files, read_responses, write_shard
from eagle_pipeline.shared.storage import file_sha256, read_json
from eagle_pipeline.simulation import SimulatedOpenRouterServer
from eagle_pipeline_tests.generation.generation_helpers import make_prompts, out_dirs, run, sim_backend

# Shard 0 answered only by "Bad", shard 1 by both, shard 2 only by "Good".
PROVIDERS = [["Bad", "Bad", "Bad"], ["Bad", "Good", "Good"], ["Good", "Good"]]


@pytest.fixture
def committed(tmp_path):
    """Eight real responses in three shards (3, 3, 2 rows), their provider relabelled per PROVIDERS."""
    prompts = make_prompts(8)
    with SimulatedOpenRouterServer(price_per_m_prompt=1.0, price_per_m_completion=2.0) as srv:
        summary = run(prompts, sim_backend(srv.url, concurrency=1), tmp_path, options=RunOptions(commit_every_rows=3))
    assert summary.completed == 8
    out, _ = out_dirs(tmp_path)
    parts = part_files(out)
    assert [pq.read_metadata(p).num_rows for p in parts] == [3, 3, 2]
    for i, (p, names) in enumerate(zip(parts, PROVIDERS)):
        t = pq.read_table(p)
        t = t.set_column(t.schema.get_field_index("provider"), "provider", pa.array(names, pa.string()))
        write_shard(t, out, i)
    return tmp_path, prompts, out


def _retire_bad_crashing_mid_apply(out, monkeypatch) -> None:
    """Retire provider "Bad" and crash after the commit point: shard 0 moved, the mixed shard 1 not yet rewritten."""
    real_write = retire.storage.write_parquet_atomic
    calls = []

    def crash_on_rewrite(table, path, **kw):  # 1st call: staging the mixed shard's rows; 2nd: rewriting it live
        calls.append(path)
        if len(calls) == 2:
            raise OSError("simulated crash while rewriting a mixed shard")
        return real_write(table, path, **kw)

    monkeypatch.setattr(retire.storage, "write_parquet_atomic", crash_on_rewrite)
    with pytest.raises(OSError, match="simulated crash"):
        retire_responses(out, dataset="B1", provider="Bad")
    monkeypatch.undo()


def _archive_rows(archive) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in sorted(archive.glob("part-*.parquet"))])


def test_retire_one_provider_moves_whole_shards_splits_mixed_ones_and_keeps_the_ledger(committed):
    root, prompts, out = committed
    ids_before, spend_before = committed_sample_ids(out)
    bad_ids = {r["sample_id"] for r in read_responses(out).to_pylist() if r["provider"] == "Bad"}
    assert len(bad_ids) == 4 and spend_before > 0

    s = retire_responses(out, dataset="B1", provider="Bad")
    assert (s.rows_retired, s.rows_kept, s.shards_moved, s.shards_rewritten) == (4, 4, 1, 1)
    assert s.by_backend_provider == {"sim/Bad": 4}
    live = read_responses(out)
    assert set(live.column("provider").to_pylist()) == {"Good"} and live.num_rows == 4
    assert [p.name for p in part_files(out)] == ["part-00001.parquet", "part-00002.parquet"]
    archived = _archive_rows(out / "retired" / s.archive.rsplit("/", 1)[1])
    assert set(archived.column("sample_id").to_pylist()) == bad_ids
    assert set(archived.column("provider").to_pylist()) == {"Bad"}
    manifest = read_json(f"{s.archive}/retirement.json")
    assert manifest["applied"] is True and manifest["selection"] == {"backend": None, "provider": "Bad"}
    # The money spent on the retired rows is still spent: the ledger is unchanged, the ids are free again.
    ids_after, spend_after = committed_sample_ids(out)
    assert ids_after == ids_before - bad_ids
    assert spend_after == pytest.approx(spend_before, rel=1e-12)
    assert s.spend_usd_retired == pytest.approx(float(pc.sum(archived.column("cost_usd")).as_py()))

    # The next run requests exactly the retired prompts again; the ledger adds their new cost.
    with SimulatedOpenRouterServer(price_per_m_prompt=1.0, price_per_m_completion=2.0) as srv:
        again = run(prompts, sim_backend(srv.url), root)
    assert again.requested == 4 and again.completed == 4
    assert committed_sample_ids(out)[0] == ids_before
    assert committed_sample_ids(out)[1] == pytest.approx(spend_before + again.spend_usd, rel=1e-12)


def test_retire_by_backend_or_all_and_a_selection_that_matches_nothing(committed):
    _, _, out = committed
    ids_before, spend_before = committed_sample_ids(out)
    hashes = {p.name: file_sha256(p) for p in part_files(out)}
    none = retire_responses(out, dataset="B1", backend="another-backend")
    assert none.archive is None and none.rows_retired == 0 and none.rows_kept == 8
    assert {p.name: file_sha256(p) for p in part_files(out)} == hashes
    s = retire_responses(out, dataset="B1", backend="sim")
    assert s.rows_retired == 8 and s.shards_moved == 3 and s.shards_rewritten == 0
    assert part_files(out) == [] and read_responses(out).num_rows == 0
    assert committed_sample_ids(out) == (set(), pytest.approx(spend_before, rel=1e-12))
    assert {p.name for p in (out / "retired").iterdir()} == {s.archive.rsplit("/", 1)[1]}
    assert _archive_rows(out / "retired" / s.archive.rsplit("/", 1)[1]).num_rows == len(ids_before)


def test_an_interrupted_retirement_counts_every_row_once_and_is_completed_next_time(committed, monkeypatch):
    _, _, out = committed
    _, spend_before = committed_sample_ids(out)
    _retire_bad_crashing_mid_apply(out, monkeypatch)
    # Past the commit point: shard 0 is already in the archive, shard 1 still live and unchanged.
    [archive] = [p for p in (out / "retired").iterdir()]
    assert read_json(archive / "retirement.json")["applied"] is False
    assert [p.name for p in part_files(out)] == ["part-00001.parquet", "part-00002.parquet"]
    assert committed_sample_ids(out)[1] == pytest.approx(spend_before, rel=1e-12)  # no row counted twice or never
    assert read_responses(out).num_rows == 5

    assert complete_pending_retirements(out) == 1
    assert read_json(archive / "retirement.json")["applied"] is True
    assert set(read_responses(out).column("provider").to_pylist()) == {"Good"}
    assert committed_sample_ids(out)[1] == pytest.approx(spend_before, rel=1e-12)
    assert _archive_rows(archive).num_rows == 4


def test_a_retirement_that_never_reached_its_commit_point_changes_nothing(committed, monkeypatch):
    _, _, out = committed
    hashes = {p.name: file_sha256(p) for p in part_files(out)}
    spend = committed_sample_ids(out)[1]
    real_replace = os.replace

    def crash_at_commit(src, dst):  # every other rename (the staging files' atomic writes) goes through
        if os.path.basename(src).startswith(retire.STAGING_PREFIX):
            raise OSError("crash before commit")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_at_commit)
    with pytest.raises(OSError, match="crash before commit"):
        retire_responses(out, dataset="B1", provider="Bad")
    monkeypatch.undo()
    [staging] = list((out / "retired").iterdir())
    assert staging.name.startswith(retire.STAGING_PREFIX)
    assert {p.name: file_sha256(p) for p in part_files(out)} == hashes
    assert committed_sample_ids(out)[1] == pytest.approx(spend, rel=1e-12)
    # The next retirement clears the abandoned staging directory and retires normally.
    s = retire_responses(out, dataset="B1", provider="Bad")
    assert s.rows_retired == 4
    assert [p.name for p in (out / "retired").iterdir()] == [s.archive.rsplit("/", 1)[1]]


def test_coverage_is_by_sample_id_not_by_row_count(committed):
    _, prompts, out = committed
    ids = prompts.column("sample_id").to_pylist()
    assert dataset_coverage("B1", ids, out).describe() == "8/8 current prompts answered"
    # Other settings, other ids: as many rows on disk as prompts, none of them current.
    other = make_prompts(8, start=100).column("sample_id").to_pylist()
    cov = dataset_coverage("B1", other, out)
    assert (cov.prompts, cov.answered, cov.other_rows, cov.complete) == (8, 0, 8, False)
    assert cov.describe().startswith("0/8 current prompts answered (8 committed rows answer other prompts")
    table, cov = current_responses("B1", read_responses(out), ids[:3])
    assert sorted(table.column("sample_id").to_pylist()) == sorted(ids[:3]) and (cov.answered, cov.other_rows) == (3, 5)
    assert coverage_of("B1", ["a", "a", "b"], ["b", "c"]).metadata() == {
        "current_prompts": 2,
        "current_prompts_answered": 1,
        "current_prompts_missing": 1,
        "rows_answering_other_prompts": 1,
    }


def test_a_generation_run_completes_an_interrupted_retirement_before_it_resumes(committed, monkeypatch):
    root, prompts, out = committed
    _retire_bad_crashing_mid_apply(out, monkeypatch)
    with SimulatedOpenRouterServer() as srv:
        again = run(prompts, sim_backend(srv.url), root)
    # Every "Bad" row was retired before the run looked for missing prompts, so all four were requested again.
    assert again.requested == 4
    assert set(read_responses(out).column("provider").to_pylist()) == {"Good", "Simulated"}
    assert read_responses(out).num_rows == 8


def test_a_foreign_directory_among_the_archives_is_named_not_ignored(committed):
    _, _, out = committed
    (out / "retired" / "by-hand").mkdir(parents=True)
    with pytest.raises(RuntimeError, match=r"by-hand: a directory under retired/ without retirement.json"):
        committed_sample_ids(out)
