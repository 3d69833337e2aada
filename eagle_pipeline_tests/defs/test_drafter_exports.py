"""The drafter hand-off through Dagster: `trainer_exports` writes each listed drafter's keys and commands, and the
blocking `draft_config_matches` check holds the configured draft config against the captured layers."""

from __future__ import annotations

import json

import dagster as dg
import torch

from eagle_pipeline.definitions import build_defs
from eagle_pipeline.hidden_states.store.merged import num_shards

from .test_scale_out import N_ROWS, SHARD_SIZE, _config, _merged, _run_shard


def test_the_check_blocks_a_draft_config_of_other_layers(tmp_path, monkeypatch, instance):
    from eagle_pipeline.defs.hidden_states import draft_config_matches, trainer_exports
    from eagle_pipeline.defs.resources import PipelineResource

    draft = tmp_path / "dflash.json"
    # Five layers by count: SpecForge's spread over the tiny model's 8; its EAGLE-3 (3 layers only) is served by
    # speculators alone, so the configuration loads.
    _config(tmp_path, monkeypatch, aux_layers=5, drafters=["eagle3", "dflash", "dspark"], draft_config=str(draft))
    root = _merged(tmp_path, instance)
    defs = build_defs()
    for i in range(num_shards(N_ROWS, SHARD_SIZE)):
        run = _run_shard(instance, f"{i:05d}", defs)
        assert run.success
        # the shard's checks (layers_as_configured among them) resolve the count as extraction did
        assert all(e.passed for e in run.get_asset_check_evaluations())

    def export() -> dg.ExecuteInProcessResult:
        return dg.materialize(
            [trainer_exports, draft_config_matches],
            instance=instance,
            resources={"pipeline": PipelineResource()},
            raise_on_error=False,
        )

    captured = [1, 2, 3, 4, 5]  # round(1 + i·(8-4)/4)
    draft.write_text(json.dumps({"hidden_size": 64, "dflash_config": {"target_layer_ids": captured}}))
    result = export()
    assert result.success
    (check,) = result.get_asset_check_evaluations()
    assert check.passed and check.metadata["judged"].value is True
    sf = root.exports_dir / "specforge"
    ckpt = torch.load(next((sf / "train").glob("*.ckpt")), mmap=True)
    assert {"hidden_states", "target_last_hidden_states", "aux_hidden_state"} <= set(ckpt)
    entries = json.loads((sf / "export.json").read_text())["extra"]["drafters"]
    assert [(e["type"], e["served"]) for e in entries] == [("eagle3", False), ("dflash", True), ("dspark", True)]
    assert "exactly 3" in entries[0]["reason"]
    sp = json.loads((root.exports_dir / "speculators" / "export.json").read_text())["extra"]["drafters"]
    assert all(e["served"] for e in sp) and "--target-layer-ids 2 3 4 5 6" in sp[0]["command"]

    draft.write_text(json.dumps({"hidden_size": 64, "dflash_config": {"target_layer_ids": [1, 3, 4]}}))
    result = export()
    (check,) = result.get_asset_check_evaluations()
    assert not check.passed
    assert "reads 3 target layers" in check.description and "captured 5 ([1, 2, 3, 4, 5])" in check.description
