"""The drafter hand-off through Dagster: `trainer_exports` writes each listed drafter's keys and commands, and the
blocking `draft_config_matches_capture` check holds the configured draft config against the captured layers."""

from __future__ import annotations

import json

import dagster as dg
import torch

from eagle_pipeline.definitions import build_defs
from eagle_pipeline.hidden_states import num_shards

from .test_scale_out import N_ROWS, SHARD_SIZE, _config, _merged, _run_shard


def test_the_check_blocks_a_draft_config_of_other_layers(tmp_path, monkeypatch, instance):
    from eagle_pipeline.defs.hidden_states import draft_config_matches_capture, trainer_exports
    from eagle_pipeline.defs.resources import PipelineResource

    draft = tmp_path / "dflash.json"
    _config(tmp_path, monkeypatch, drafters=["eagle3", "dflash", "dspark"], draft_config=str(draft))
    root = _merged(tmp_path, instance)
    defs = build_defs()
    for i in range(num_shards(N_ROWS, SHARD_SIZE)):
        assert _run_shard(instance, f"{i:05d}", defs).success

    def export() -> dg.ExecuteInProcessResult:
        return dg.materialize(
            [trainer_exports, draft_config_matches_capture],
            instance=instance,
            resources={"pipeline": PipelineResource()},
            raise_on_error=False,
        )

    captured = [1, 3, 4]  # the tiny model's low/mid/high (8 layers)
    draft.write_text(json.dumps({"hidden_size": 64, "dflash_config": {"target_layer_ids": captured}}))
    result = export()
    assert result.success
    (check,) = result.get_asset_check_evaluations()
    assert check.passed and check.metadata["judged"].value is True
    sf = root.exports_dir / "specforge"
    ckpt = torch.load(next((sf / "train").glob("*.ckpt")), mmap=True)
    assert {"hidden_states", "target_last_hidden_states", "aux_hidden_state"} <= set(ckpt)
    entries = json.loads((sf / "export.json").read_text())["extra"]["drafters"]
    assert [e["type"] for e in entries] == ["eagle3", "dflash", "dspark"] and all(e["served"] for e in entries)

    draft.write_text(json.dumps({"hidden_size": 64, "dflash_config": {"target_layer_ids": [1, 2, 3, 4, 5]}}))
    result = export()
    (check,) = result.get_asset_check_evaluations()
    assert not check.passed
    assert "reads 5 target layers" in check.description and "captured 3 ([1, 3, 4])" in check.description
