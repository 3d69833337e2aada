"""A real Dagster run of one shard through the torchrun engine: the step starts a 2-process gloo world on the CPU
(transformers' DistributedConfig(tp_size=2)) over the tiny model, and the shard equals the in-process one."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from eagle_pipeline.hidden_states.checks.verify import verify_shard
from eagle_pipeline.hidden_states.run import extract_shard
from eagle_pipeline.hidden_states.store.fingerprint import recorded_fingerprint
from eagle_pipeline.hidden_states.store.format import read_index_meta, shard_paths, shard_status

from ..tolerances import assert_forwards_close
from .test_scale_out import SHARD_SIZE, _engine_shard_run, _run_shard

pytest.importorskip("accelerate")  # transformers' tensor parallelism needs it (a dev dependency)
pytestmark = pytest.mark.slow


def test_a_shard_materializes_through_the_torchrun_engine(tmp_path, monkeypatch, instance):
    from eagle_pipeline.defs.resources import PipelineResource
    from eagle_pipeline.hidden_states.engines.runtime import load_extraction_model

    root, result, verdicts = _engine_shard_run(tmp_path, monkeypatch, instance, "torchrun", {"tp_size": 2})
    assert verdicts["norm_convention_holds"] == "pass"  # rank 0 recorded the gathered head
    (mat,) = result.asset_materializations_for_node("hidden_states")
    assert mat.metadata["engine"].value == "torchrun" and mat.metadata["device"].value == "torchrun: tp_size 2"
    assert shard_status(root.hidden_states_dir, 1) == "done"
    assert all(c.passed for c in verify_shard(root.hidden_states_dir, 1, root.merged_dir).values())
    st, idx = shard_paths(root.hidden_states_dir, 1)
    assert recorded_fingerprint(read_index_meta(idx)).engine == "torchrun"

    cfg = PipelineResource().config().hidden_states
    vocab = PipelineResource().tokenizer().vocab_size
    model = load_extraction_model(cfg.model, family=cfg.family, seed=cfg.seed, vocab_size=vocab, device="cpu")
    ref = extract_shard(
        model, root.merged_dir, shard_index=1, shard_size=SHARD_SIZE, out_dir=tmp_path / "one", final_state="pre_norm"
    )  # the final state of the `shards` layout, as every engine stores it
    assert recorded_fingerprint(read_index_meta(idx)).final_state == "pre_norm"
    tp, one = load_file(str(st)), load_file(ref.path)
    assert tp.keys() == one.keys() and len(tp) == 4 * ref.rows
    for key, want in one.items():
        if want.is_floating_point():
            assert_forwards_close(tp[key], want, model.config, what=key)
        else:
            assert torch.equal(tp[key], want)

    again = _run_shard(instance, "00001")  # a done shard starts no world
    assert again.success
    (mat,) = again.asset_materializations_for_node("hidden_states")
    assert mat.metadata["skipped_already_done"].value is True


@pytest.mark.parametrize("layout", ["speculators", "specforge"])
def test_a_trainer_layout_through_the_torchrun_engine(layout, tmp_path, monkeypatch, instance):
    """`layout: speculators | specforge` with `engine: torchrun` (gloo, 2 ranks): rank 0 writes the trainer's files
    once, under exports/<layout>, and the seven checks read them; the other rank's go to its scratch folder."""
    from eagle_pipeline.defs.resources import PipelineResource
    from eagle_pipeline.hidden_states.engines.runtime import load_extraction_model
    from eagle_pipeline.hidden_states.layouts.trainer_layouts import load_sample

    root, _, _ = _engine_shard_run(tmp_path, monkeypatch, instance, "torchrun", {"tp_size": 2}, layout=layout)
    meta = read_index_meta(shard_paths(root.hidden_states_dir, 1)[1])
    want_final = "pre_norm" if layout == "speculators" else "post_norm"
    fp = recorded_fingerprint(meta)
    assert fp.layout == layout and fp.final_state == want_final
    files = [(root.hidden_states_dir / f["path"]).resolve() for f in meta["sample_files"]]
    assert files and all(p.is_relative_to(root.exports_dir / layout) and p.exists() for p in files)
    cfg = PipelineResource().config().hidden_states
    vocab = PipelineResource().tokenizer().vocab_size
    model = load_extraction_model(cfg.model, family=cfg.family, seed=cfg.seed, vocab_size=vocab, device="cpu")
    ref = tmp_path / "one"
    extract_shard(model, root.merged_dir, shard_index=1, shard_size=SHARD_SIZE, out_dir=ref, final_state=want_final)
    for sid in [f["sample_id"] for f in meta["sample_files"]]:
        got, want = load_sample(root.hidden_states_dir, sid), load_sample(ref, sid)
        for key, w in want.items():
            if w.is_floating_point():
                assert_forwards_close(got[key], w, model.config, what=f"{sid} {key}")
            else:
                assert torch.equal(got[key], w)
    inodes = [(p.stat().st_dev, p.stat().st_ino) for p in root.root.rglob("*") if p.is_file()]
    assert len(inodes) == len(set(inodes))
