"""A shard run's cost does not grow with the shards already done: it opens no other shard's state file (the disk
check reads the done shards' indexes and file sizes, never their bytes). Measured by the files the run opens
through Python (an audit hook on `open`: where the shard digests and trainer-file hashes are read), with one done
shard against many, through the stage's core call (`run.run_shard`) with
the disk check on (plan.json written as the `hidden_state_plan` asset writes it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from eagle_pipeline.hidden_states.engines.engine import ExtractionPaths
from eagle_pipeline.hidden_states.plan.disk_plan import PLAN_FILE, disk_inputs
from eagle_pipeline.hidden_states.plan.estimate import Workload
from eagle_pipeline.hidden_states.plan.run_plan import plan_for_run
from eagle_pipeline.hidden_states.run import run_shard
from eagle_pipeline.hidden_states.settings import HiddenStatesConfig
from eagle_pipeline.shared.storage import write_json_atomic

from .conftest import VOCAB, make_rows

_OPENED: list[str] | None = None  # the files opened while a test records them


def _record(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], str | Path):
        _OPENED.append(str(args[0]))


sys.addaudithook(_record)  # an audit hook cannot be removed: it records only while _OPENED is a list


def _opened_during(fn) -> list[str]:
    global _OPENED
    _OPENED = []
    try:
        fn()
        return list(_OPENED)
    finally:
        _OPENED = None


def _plan(settings: HiddenStatesConfig, paths: ExtractionPaths, rows: list[dict]) -> None:
    plans = plan_for_run(
        settings,
        Workload(sum(r["n_tokens"] for r in rows), len(rows)),
        target_model_config=None,
        vocab_size=VOCAB,
        disk=disk_inputs(settings, paths),
    )
    write_json_atomic({k: p.to_dict() for k, p in plans.items()}, paths.out_dir / PLAN_FILE)


@pytest.mark.parametrize("layout", ["shards", "speculators"])
def test_a_shard_run_reads_no_other_shard_s_states(layout, merged_factory, tmp_path):
    rows = make_rows(36, seed=12, min_len=2, max_len=24)
    merged = merged_factory(rows, [36])
    paths = ExtractionPaths(merged, tmp_path / "hs", tmp_path / "exports")
    paths.out_dir.mkdir()
    settings = HiddenStatesConfig(shard_size=4, layout=layout, max_tokens_per_batch=128)  # 9 shards
    _plan(settings, paths, rows)

    def run(shard: int) -> list[str]:
        return _opened_during(lambda: run_shard(settings, paths, shard, vocab_size=VOCAB))

    def other_shards_states(opened: list[str], shard: int) -> list[str]:
        """Other shards' state files among `opened`: their shard files and, in speculators' layout, their hs_{i}."""
        names = [Path(p).name for p in opened]
        shard_files = [n for n in names if n.startswith("shard-") and n.endswith(".safetensors")]
        trainer_files = [p for p in opened if "/hidden_states/hs_" in p and not _is_own_trainer_file(shard, p)]
        return [n for n in shard_files if n != f"shard-{shard:05d}.safetensors"] + trainer_files

    def data_files(opened: list[str], shard: int) -> set[str]:
        """What the run opened of the data root through Python (pyarrow reads the indexes on its own), but other
        shards' files: the same whatever the shards done."""
        own = f"shard-{shard:05d}"
        return {
            Path(p).name
            for p in opened
            if str(tmp_path) in p
            and not Path(p).name.startswith(".")  # the atomic writes' temporaries, randomly named
            and not (Path(p).name.startswith("shard-") and own not in p)
        }

    assert not other_shards_states(run(0), 0)
    few = run(1)  # one shard done before this run
    for shard in range(2, 8):
        run(shard)
    many = run(8)  # seven more done
    assert not other_shards_states(few, 1) and not other_shards_states(many, 8)
    assert data_files(many, 8) == {n.replace("00001", "00008") for n in data_files(few, 1)}


def _is_own_trainer_file(shard: int, path: str) -> bool:
    """Whether a speculators `hs_{i}` file holds a row of shard `shard` (4 rows per shard, in merged-row order)."""
    i = int(Path(path).name.split("_", 1)[1].split(".", 1)[0])
    return shard * 4 <= i < (shard + 1) * 4
