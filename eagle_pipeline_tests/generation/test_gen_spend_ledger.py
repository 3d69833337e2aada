"""The data root's shared spend ledger: runs in other processes see each other's spend and reservations, a run killed
-9 keeps its spend and drops its reservation, a run that ends leaves its spend on disk, and where the ledger cannot
be used a run refuses to start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle_pipeline.generation.spend.ledger import LEDGER_DIR, SharedSpend, SpendLedgerError
from eagle_pipeline.generation.store.rows import RESPONSES_SCHEMA, ColumnBuffer
from eagle_pipeline.generation.store.shards import write_shard
from eagle_pipeline.simulation import SimulatedOpenRouterServer

from .generation_helpers import REPO, make_prompts, run, sim_backend


def _child(responses: Path, dataset: str, committed: float, answered: float, reserved: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagle_pipeline_tests.generation.ledger_child", str(responses), dataset]
        + [repr(committed), repr(answered), repr(reserved)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", proc.communicate()
    return proc


def _commit_spend(out_dir: Path, dataset: str, costs: list[float]) -> None:
    """A committed shard of `dataset` whose rows cost `costs`."""
    buf = ColumnBuffer(RESPONSES_SCHEMA)
    for i, c in enumerate(costs):
        buf.append({"sample_id": f"{dataset}-{out_dir.name}-{i}", "dataset": dataset, "cost_usd": c})
    table = buf.take()
    assert table is not None
    out_dir.mkdir(parents=True, exist_ok=True)
    write_shard(table, out_dir, len(list(out_dir.glob("part-*.parquet"))))


def _until(predicate, what: str, deadline_s: float = 60.0) -> None:
    """Poll `predicate` (each call publishes and refreshes); fail naming `what` if it never holds."""
    end = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < end, f"never: {what}"
        time.sleep(0.02)


def test_runs_of_one_data_root_see_each_others_spend_and_reservations(tmp_path):
    responses = tmp_path / "responses"
    _commit_spend(responses / "B3", "B3", [0.125])  # a dataset that is not running: its spend on disk counts
    other = _child(responses, "B2", 0.25, 0.5, 0.0625)
    try:
        shared = SharedSpend(1.0, [responses / n for n in ("B1", "B2", "B3")])
        with shared.join("B1", 0.0) as mine:
            # B2: 0.25 committed + 0.5 answered + 0.0625 in flight; B3: 0.125 on disk. Total 0.9375 of 1.0.
            assert mine.spent_usd == pytest.approx(0.875)
            assert not mine.reached(0.0625 - 1e-9)
            assert mine.reached(0.0625)
            assert "generation.budget_usd $1.0000 reached" in (mine.why_reached() or "")
            mine.add(0.03125)
            mine.reached(0.0)
            mine.publish()
            # A third party (a run starting now) counts both live runs' figures.
            assert shared.spent_usd == pytest.approx(0.875 + 0.03125)
    finally:
        other.communicate("", timeout=30)
    # Both left: their slots are empty, their spend is what is on disk (B1 and B2 committed nothing here).
    assert SharedSpend(1.0, [responses / n for n in ("B1", "B2", "B3")]).spent_usd == pytest.approx(0.125)


def test_a_run_killed_keeps_its_spend_and_frees_its_reservation(tmp_path):
    responses = tmp_path / "responses"
    _commit_spend(responses / "B2", "B2", [0.25])
    shared = SharedSpend(1.0, [responses / "B1", responses / "B2"], probe_every_s=0.05)
    victim = _child(responses, "B2", 0.25, 0.5, 0.2)
    with shared.join("B1", 0.0) as mine:
        mine.publish()
        assert mine.reached(0.06)  # 0.25 + 0.5 + 0.2 in flight + 0.06 >= 1.0
        os.kill(victim.pid, signal.SIGKILL)
        victim.communicate(timeout=30)

        def reservation_gone() -> bool:
            mine.publish()
            return not mine.reached(0.06)

        _until(reservation_gone, "the dead run's reservation stops counting")
        # Its answers stay counted: the slot's last figures (0.75) although only 0.25 is on disk.
        assert mine.spent_usd == pytest.approx(0.75)
        assert mine.reached(0.25)
        # A run that joins after the death counts them too, from the dead run's slot.
        assert shared.spent_usd == pytest.approx(0.75)
    # More on disk than the slot said (its answer log, folded): the disk wins.
    _commit_spend(responses / "B2", "B2", [0.5, 0.125])
    assert shared.spent_usd == pytest.approx(0.875)


def test_a_run_that_ends_is_counted_from_disk(tmp_path):
    responses = tmp_path / "responses"
    shared = SharedSpend(10.0, [responses / "B1", responses / "B2"])
    other = _child(responses, "B2", 0.0, 0.5, 0.25)
    with shared.join("B1", 0.0) as mine:
        mine.publish()
        assert mine.spent_usd == pytest.approx(0.5)
        _commit_spend(responses / "B2", "B2", [0.5, 0.0625])  # what it committed before it ended
        other.communicate("", timeout=30)

        def left() -> bool:
            mine.publish()
            return mine.spent_usd == pytest.approx(0.5625)

        _until(left, "the ended run counted from its committed rows")
        assert not mine.reached(9.4375 - 1e-9) and mine.reached(9.4375)  # no reservation of it is left


def test_without_a_usable_ledger_a_run_refuses_before_any_request(tmp_path, monkeypatch):
    blocker = tmp_path / "responses"
    blocker.mkdir()
    (blocker / LEDGER_DIR).write_text("not a directory")  # the ledger cannot be created
    shared = SharedSpend(1.0, [blocker / "B1"])
    with SimulatedOpenRouterServer() as srv:
        with pytest.raises(SpendLedgerError, match=rf"{LEDGER_DIR}.*Nothing was requested"):
            run(make_prompts(4), sim_backend(srv.url), tmp_path, run_budget=shared)
        assert srv.total_requests == 0

    # A volume without flock (some network filesystems): refused the same way.
    import fcntl

    def no_locks(fd, op):
        raise OSError(37, "No locks available")

    (blocker / LEDGER_DIR).unlink()
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(SpendLedgerError, match="No locks available"):
        with shared.join("B1", 0.0):
            pass


def test_a_run_stops_when_its_view_goes_stale_or_the_ledger_fails(tmp_path):
    responses = tmp_path / "responses"
    shared = SharedSpend(10.0, [responses / "B1"], interval_s=3600.0, stale_after_s=0.2)
    with shared.join("B1", 0.0) as mine:
        assert not mine.reached(0.0)
        _until(lambda: mine.reached(0.0), "a view older than stale_after_s stops new requests")
        assert "old" in (mine.why_reached() or "")
    shared = SharedSpend(10.0, [responses / "B1"])
    with shared.join("B1", 0.0) as mine:
        ledger = responses / LEDGER_DIR / "ledger"
        ledger.unlink()
        ledger.mkdir()  # the ledger can no longer be opened
        mine.publish()
        assert mine.reached(0.0) and "failed" in (mine.why_reached() or "")
