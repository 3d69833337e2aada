"""A real Dagster run of one shard through the vLLM engine, against the loopback double (`endpoints: [simulated]`)."""

from __future__ import annotations

import pytest
import yaml
from safetensors import safe_open

from eagle_pipeline.hidden_states.checks.verify import verify_shard
from eagle_pipeline.hidden_states.store.fingerprint import recorded_fingerprint
from eagle_pipeline.hidden_states.store.format import read_index_meta, shard_paths, shard_status
from eagle_pipeline.hidden_states.store.head import (
    checkpoint_head,
    checkpoint_head_key,
    load_target_head,
    verified_head_sha256,
)

from .test_scale_out import _config, _engine_shard_run, _merged

pytestmark = pytest.mark.slow


def test_a_shard_materializes_through_the_vllm_engine(tmp_path, monkeypatch, instance):
    storage = tmp_path / "connector"
    settings = {"endpoints": ["simulated"], "storage_path": str(storage), "concurrency": 2}
    root, result, verdicts = _engine_shard_run(tmp_path, monkeypatch, instance, "vllm", settings)
    # The head is read from the checkpoint of the model the double serves, so the norm check judges engine shards;
    # the teacher check cannot judge a tiny random stand-in on simulated texts, and says so.
    assert verdicts["norm_convention_holds"] == "pass" and verdicts["teacher_agreement"] == "not_judged"
    assert verdicts["states_not_degenerate"] == verdicts["layers_as_configured"] == "pass"
    (mat,) = result.asset_materializations_for_node("hidden_states")
    assert mat.metadata["engine"].value == "vllm" and mat.metadata["device"].value == "vllm: simulated"
    assert shard_status(root.hidden_states_dir, 1) == "done"
    assert all(c.passed for c in verify_shard(root.hidden_states_dir, 1, root.merged_dir).values())
    st, idx = shard_paths(root.hidden_states_dir, 1)
    meta = read_index_meta(idx)
    fp = recorded_fingerprint(meta)
    assert fp.engine == "vllm" and fp.final_state == "pre_norm" and meta["target_head_sha256"]
    # The recorded head carries the key of the checkpoint it was read from, so later shard runs only verify it.
    checkpoint = load_target_head(root.hidden_states_dir).meta["source"]["checkpoint"]
    key = checkpoint_head_key(checkpoint_head(checkpoint))
    assert verified_head_sha256(root.hidden_states_dir / "target_head.safetensors", key) == meta["target_head_sha256"]
    assert not (root.root / "head_cache").exists()
    assert meta["vllm_layer_ids"] == [2, 4, 5, 8] and fp.aux_layers == (1, 3, 4)  # the tiny model: 8 layers
    with safe_open(str(st), "pt") as f:
        assert recorded_fingerprint(f.metadata()).engine == "vllm"
    assert list(storage.iterdir()) == []  # the connector's per-request files are gone once the shard is committed


def test_the_plan_refuses_kimi_weights_in_process(tmp_path, monkeypatch, instance, kimi_dir):
    import dagster as dg

    from eagle_pipeline.defs.hidden_states import hidden_state_plan
    from eagle_pipeline.defs.resources import PipelineResource

    path = _config(tmp_path, monkeypatch)
    _merged(tmp_path, instance)  # merged rows and a plan for the tiny model
    raw = yaml.safe_load(path.read_text())
    raw["hidden_states"]["model"] = str(kimi_dir)  # a directory with Kimi-K2.5's config.json
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    result = dg.materialize(
        [hidden_state_plan], instance=instance, resources={"pipeline": PipelineResource()}, raise_on_error=False
    )
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    message = failure.event_specific_data.error.message
    assert "Extraction plan refused" in message and "at least 17 GPUs" in message and "engine: vllm" in message
    raw["hidden_states"]["engine"] = "vllm"
    raw["hidden_states"]["vllm"] = {"endpoints": ["http://gpu-node-0:8000"]}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    assert dg.materialize([hidden_state_plan], instance=instance, resources={"pipeline": PipelineResource()}).success


@pytest.mark.parametrize("layout", ["speculators", "specforge"])
def test_a_trainer_layout_through_the_vllm_engine(layout, tmp_path, monkeypatch, instance):
    """`layout: speculators | specforge` with `engine: vllm`: the run writes the trainer's files once (read back as
    the trainer reads them), its seven checks read those files and pass, and no state file exists twice."""
    import torch
    from safetensors.torch import load_file

    storage = tmp_path / "connector"
    vllm = {"endpoints": ["simulated"], "storage_path": str(storage), "concurrency": 2}
    root, _, _ = _engine_shard_run(tmp_path, monkeypatch, instance, "vllm", vllm, layout=layout)
    meta = read_index_meta(shard_paths(root.hidden_states_dir, 1)[1])
    fp = recorded_fingerprint(meta)
    assert fp.layout == layout and fp.engine == "vllm"
    assert fp.final_state == ("pre_norm" if layout == "speculators" else "post_norm")
    files = [root.hidden_states_dir / f["path"] for f in meta["sample_files"]]
    assert files and all(p.is_relative_to(root.exports_dir / layout) for p in (f.resolve() for f in files))
    for p in files:
        if layout == "speculators":  # hs_{i}.safetensors: hidden_states [T, 4, H], token_ids [T] int64
            t = load_file(str(p))
            assert t["hidden_states"].shape[1:] == (4, 64) and t["token_ids"].dtype == torch.int64
            assert t["hidden_states"].shape[0] == t["token_ids"].shape[0]
        else:  # {sample_id}.ckpt: input_ids/loss_mask int64 [T], aux_hidden_state [1, T, 3H], hidden_state [1, T, H]
            r = torch.load(p, weights_only=True)
            n = r["input_ids"].shape[0]
            assert r["aux_hidden_state"].shape == (1, n, 3 * 64) and r["hidden_state"].shape == (1, n, 64)
            assert r["input_ids"].dtype == r["loss_mask"].dtype == torch.int64
    assert list(storage.iterdir()) == []
    inodes = [(p.stat().st_dev, p.stat().st_ino) for p in root.root.rglob("*") if p.is_file()]
    assert len(inodes) == len(set(inodes))  # no file of the states twice on disk


def test_a_vllm_shard_over_the_disk_budget_is_refused_before_any_request(tmp_path, monkeypatch, instance):
    """`engine: vllm`, `layout: speculators` plus a SpecForge copy: the plan lists what is written (the hs_{i}
    files, the shards' ids and masks, the Arrow dataset, the copy, the connector's peak), and the shard run over
    the budget fails naming the planned bytes and the budget before it sends the server anything."""
    import dagster as dg

    from eagle_pipeline.hidden_states.models.model import build_tiny_model
    from eagle_pipeline.shared.storage import read_json
    from eagle_pipeline.simulation.vllm_hidden_states import VLLMHiddenStatesDouble

    from .test_scale_out import _run_shard

    storage = tmp_path / "connector"
    model = build_tiny_model(2560, family="deepseek_v3", seed=0)
    with VLLMHiddenStatesDouble(model, layer_ids=[2, 4, 5, 8], storage_path=storage) as srv:
        vllm = {"endpoints": [srv.url], "storage_path": str(storage), "concurrency": 2}
        _config(
            tmp_path,
            monkeypatch,
            budget_gb=1e-6,
            engine="vllm",
            vllm=vllm,
            layout="speculators",
            trainer_layouts=["specforge"],
        )
        root = _merged(tmp_path, instance)
        plan = read_json(root.hidden_states_dir / "plan.json")["this_run"]
        whats = [d["what"] for d in plan["disk_items"]]
        assert whats[:3] == [
            "ids and masks in the shards",
            "states: speculators hs_{i}.safetensors",
            "speculators Arrow dataset (ids, masks)",
        ]
        assert whats[3] == "copy for trainer_layouts: states: SpecForge {sample_id}.ckpt"
        assert whats[4].startswith("connector files at their peak (4 rows in flight")  # 2 x concurrency x 1
        scratch = plan["disk_items"][4]
        assert scratch["counted"] is False and "renamed to hs_{i}" in scratch["note"]  # one filesystem here
        planned = plan["bytes_on_disk"]
        assert planned == sum(d["bytes"] for d in plan["disk_items"] if d["counted"])
        mat = instance.fetch_materializations(dg.AssetKey("hidden_state_plan"), limit=1).records[0]
        md = mat.asset_materialization.metadata["this_run_plan"].value
        assert "| states: speculators hs_{i}.safetensors | exports |" in md and f"**{planned:,}" in md

        result = _run_shard(instance, "00000")
        assert not result.success
        failure = next(e for e in result.all_events if e.is_step_failure)
        message = failure.event_specific_data.error.message
        assert f"needs {planned:,} bytes" in message and "over the budget of 1,000 bytes" in message
        assert srv.total_requests == 0  # refused before the first request
    assert not list(root.hidden_states_dir.glob("shard-*")) and not (root.exports_dir / "speculators").exists()
