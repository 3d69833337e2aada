"""The disk plan: the bytes of what each layout writes (checked against files really written), the connector's peak,
the trainer copies, and the refusal against the budget and a filesystem's free space (injected through a seam),
before a shard run and before a trainer layout converted from the shards."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle_pipeline.hidden_states.layouts.trainer_layouts import EXPORTS, HIDDEN_STATES
from eagle_pipeline.hidden_states.plan.disk_plan import (
    CONNECTOR,
    SHARD_FILE_BYTES,
    DiskBudgetExceeded,
    DiskInputs,
    StateShape,
    check_disk,
    connector_file_bytes,
    disk_items,
    state_shape,
)

from .conftest import make_rows


def _sizes(root: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in root.glob(pattern) if p.is_file())


@pytest.mark.parametrize(
    "layout, quantize",
    [("shards", "none"), ("shards", "fp8"), ("speculators", "none"), ("speculators", "fp8"), ("specforge", "none")],
)
def test_the_plan_s_bytes_are_the_bytes_extraction_writes(layout, quantize, tiny_ds, merged_factory, tmp_path):
    """Two shards extracted in process into `layout`, stored as `quantize` says: each item of the plan (states, the shards' ids and masks)
    is within 1 % (or 100 B per sample and 2 KB per shard: headers and index rows grow with the sample ids' and
    paths' lengths) of the files on disk, and no file is left out of the plan."""
    import pyarrow.parquet as pq

    from eagle_pipeline.hidden_states.layouts.trainer_layouts import layout_of, plan_layout_target
    from eagle_pipeline.hidden_states.run import extract_shard

    rows = make_rows(12, seed=2, min_len=20, max_len=60)
    merged = merged_factory(rows, [7, 5])
    hs, exports = tmp_path / "hs", tmp_path / "exports" / layout
    target = plan_layout_target(layout, exports, merged, quantize=quantize)
    for shard in (0, 1):
        extract_shard(
            tiny_ds,
            merged,
            shard_index=shard,
            shard_size=6,
            out_dir=hs,
            final_state=layout_of(layout).final_state,
            layout_target=target,
            quantize=quantize,
        )
    cfg = tiny_ds.config
    shape = state_shape(4, cfg.hidden_size, 4, quantize)  # 3 aux + final, fp32 on CPU (or e4m3 and scales)
    lengths = [n for p in sorted(merged.glob("*.parquet")) for n in pq.read_table(p)["n_tokens"].to_pylist()]
    items = disk_items(
        shape, DiskInputs(shard_tokens=[sum(lengths[:6]), sum(lengths[6:])], shard_rows=[6, 6]), layout=layout
    )
    by_place: dict[str, int] = {}
    for d in items:
        if "Arrow" in d["what"]:  # written by trainer_exports, not by extraction
            continue
        by_place[d["place"]] = by_place.get(d["place"], 0) + d["bytes"]
    actual = {HIDDEN_STATES: _sizes(hs, "shard-*")}
    if layout != "shards":
        actual[EXPORTS] = _sizes(exports, "**/*")
    assert by_place.keys() == actual.keys()
    for place, planned in by_place.items():
        # the fixed part of a shard's files (SHARD_FILE_BYTES) varies by up to ~2 KB with the model's description
        # and the index's statistics: at 12 FP8 rows of a tiny model that is more than 1 %
        assert planned == pytest.approx(actual[place], rel=0.01, abs=100 * len(rows) + 2_000 * 2), place


def test_the_connector_peak_and_the_trainer_copies_are_items_of_their_own():
    shape = StateShape(4, 7168, 2)
    inputs = DiskInputs(
        trainer_layouts=("speculators", "specforge"),  # the layout itself is no copy
        shard_tokens=[1000, 500],
        shard_rows=[4, 2],
        scratch_rows=[400, 300],
    )
    items = disk_items(shape, inputs, layout="speculators")
    what = [d["what"] for d in items]
    assert what == [
        "ids and masks in the shards",
        "states: speculators hs_{i}.safetensors",
        "speculators Arrow dataset (ids, masks)",
        "copy for trainer_layouts: states: SpecForge {sample_id}.ckpt",
        "connector files at their peak (2 rows in flight, the longest)",
    ]
    states = items[1]
    assert states["per_shard"] == [1000 * (57_344 + 8) + 4 * 184, 500 * (57_344 + 8) + 2 * 184]
    assert items[0]["per_shard"] == [
        1000 * 5 + 4 * 600 + SHARD_FILE_BYTES,
        500 * 5 + 2 * 600 + SHARD_FILE_BYTES,
    ]  # + each shard's file
    assert items[3]["bytes"] == 1500 * (57_344 + 16) + 6 * 2_320 and items[3]["per_shard"] is None
    assert items[4]["bytes"] == connector_file_bytes(shape, 400) + connector_file_bytes(shape, 300)
    assert items[4]["place"] == CONNECTOR and items[4]["counted"]


def _plan(tmp_path: Path, budget_gb=None):
    from eagle_pipeline.hidden_states.plan.estimate import ModelShape, Storage, Workload, plan_extraction

    budget = None if budget_gb is None else int(budget_gb * 1e9)
    return plan_extraction(
        ModelShape("tiny", hidden_size=64, num_layers=8, total_params=1e6, active_params=1e6),
        Workload(n_tokens=3000, n_samples=30),
        Storage(dtype_bytes=4, shard_size=10, layout="speculators", disk_budget_bytes=budget),
        disk=DiskInputs(
            trainer_layouts=("specforge",), shard_tokens=[1000] * 3, shard_rows=[10] * 3, scratch_rows=[200] * 4
        ),
    ).to_dict()


def test_free_space_is_checked_for_what_remains_per_filesystem(tmp_path):
    plan = _plan(tmp_path)
    places = {
        HIDDEN_STATES: tmp_path / "data" / "hidden_states",
        EXPORTS: tmp_path / "data" / "exports",
        CONNECTOR: tmp_path / "shm" / "not-made-yet",
    }
    per_shard = sum(d["per_shard"][0] for d in plan["disk_items"] if d["per_shard"] is not None)
    whole = sum(d["bytes"] for d in plan["disk_items"])
    assert whole == plan["bytes_on_disk"]
    got = check_disk(plan, None, places=places, done_shards=(), free_space=lambda p: whole)
    assert [g.needed for g in got] == [whole]  # one filesystem here: every place's bytes add up
    with pytest.raises(DiskBudgetExceeded) as exc:
        check_disk(plan, None, places=places, done_shards=(), free_space=lambda p: whole - 1)
    msg = str(exc.value)
    assert f"needs {whole:,} bytes" in msg and f"{whole - 1:,} bytes" in msg and str(tmp_path / "data") in msg
    # Two done shards are on disk already: only the third, the exports and the connector's peak remain.
    got = check_disk(plan, None, places=places, done_shards={0, 1}, free_space=lambda p: whole - 2 * per_shard)
    assert got[0].needed == whole - 2 * per_shard
    # All shards done: the connector holds nothing any more; the trainer copy is still to be written.
    copy = next(d["bytes"] for d in plan["disk_items"] if d["what"].startswith("copy"))
    arrow = next(d["bytes"] for d in plan["disk_items"] if "Arrow" in d["what"])
    assert check_disk(plan, None, places=places, done_shards={0, 1, 2}, free_space=lambda p: 0 + copy + arrow)


def test_the_budget_is_held_against_the_whole_plan(tmp_path):
    plan = _plan(tmp_path)
    places = {k: tmp_path for k in (HIDDEN_STATES, EXPORTS, CONNECTOR)}
    total = plan["bytes_on_disk"]
    with pytest.raises(DiskBudgetExceeded) as exc:  # done shards do not make the plan smaller than the budget
        check_disk(plan, (total - 1) / 1e9, places=places, done_shards={0, 1, 2}, free_space=lambda p: 10**15)
    assert f"{total:,} bytes" in str(exc.value) and "hidden_states.disk_budget_gb" in str(exc.value)
    assert check_disk(plan, total / 1e9, places=places, done_shards=(), free_space=lambda p: 10**15)


def test_a_converted_trainer_layout_is_refused_before_writing_when_its_disk_has_no_room(
    tiny_ds, merged_factory, tmp_path, monkeypatch
):
    """The copy needs the shards' states again (from their indexes; none of a shard already in that layout), held
    against the free space under the export folder, which does not exist yet."""
    from eagle_pipeline.hidden_states.plan import disk_plan
    from eagle_pipeline.hidden_states.run import extract_shard

    merged = merged_factory(make_rows(6, seed=4), [6])
    hs = tmp_path / "hs"
    extract_shard(tiny_ds, merged, shard_index=0, shard_size=6, out_dir=hs)
    need = disk_plan.states_bytes(hs)
    assert need == _sizes(hs, "shard-*.safetensors") > 0
    assert disk_plan.states_bytes(hs, skip_layout="shards") == 0  # extraction wrote these shards in that layout
    out = tmp_path / "exports" / "speculators"
    monkeypatch.setattr(disk_plan, "free_bytes", lambda p: need - 1)
    with pytest.raises(OSError, match=rf"speculators export needs about {need:,} bytes .* only {need - 1:,} are free"):
        disk_plan.check_export_room(hs, out, "speculators")
    monkeypatch.setattr(disk_plan, "free_bytes", lambda p: need)
    disk_plan.check_export_room(hs, out, "speculators")
    assert not out.exists()


def test_the_cli_plan_prints_the_items_and_refuses_what_the_disk_cannot_hold(tmp_path, capsys, monkeypatch):
    """`eagle-pipeline plan`: the plan item by item, each filesystem's free space; exit 1 with the message a shard
    run would fail with when the budget is too small."""
    import yaml

    from eagle_pipeline.cli import main
    from eagle_pipeline.config import DEFAULT_CONFIG
    from eagle_pipeline.shared.storage import DataRoot, read_json

    from ..defs.test_scale_out import write_merged_with_manifest

    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    for d in raw["datasets"]:
        d["prompts"] = str(DEFAULT_CONFIG.parent / d["prompts"])
    raw["data_root"] = str(tmp_path / "data")
    raw["target"]["tokenizer"] = "demo"
    raw["hidden_states"].update(
        shard_size=4,
        engine="vllm",
        layout="speculators",
        trainer_layouts=["specforge"],
        vllm={"endpoints": ["simulated"], "storage_path": str(tmp_path / "connector"), "concurrency": 2},
        disk_budget_gb=None,
    )
    config = tmp_path / "pipeline.yaml"
    config.write_text(yaml.safe_dump(raw))
    monkeypatch.delenv("EAGLE_DATA_ROOT", raising=False)
    root = DataRoot(tmp_path / "data")
    write_merged_with_manifest(root, 10, 2560)

    assert main(["plan", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    plan = read_json(root.hidden_states_dir / "plan.json")["this_run"]
    total = plan["bytes_on_disk"]
    assert "| states: speculators hs_{i}.safetensors | exports |" in out and f"**{total:,}" in out
    assert "| copy for trainer_layouts: states: SpecForge {sample_id}.ckpt | exports |" in out
    assert f"{root.hidden_states_dir} (hidden_states, exports, connector): {total:,} bytes still to write" in out

    raw["hidden_states"]["disk_budget_gb"] = (total - 1) / 1e9
    config.write_text(yaml.safe_dump(raw))
    assert main(["plan", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert f"needs {total:,} bytes" in err and "over the budget of" in err and "hidden_states.disk_budget_gb" in err
