"""A real Dagster run of one shard through the torchrun engine: the step starts a 2-process gloo world on the CPU
(transformers' DistributedConfig(tp_size=2)) over the tiny model, and the shard equals the in-process one."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from eagle_pipeline.hidden_states import extract_shard, shard_status, verify_shard
from eagle_pipeline.hidden_states.format import read_index_meta, shard_paths

from ..tolerances import assert_forwards_close
from .test_scale_out import SHARD_SIZE, _engine_shard_run, _run_shard

pytest.importorskip("accelerate")  # transformers' tensor parallelism needs it (a dev dependency)
pytestmark = pytest.mark.slow


def test_a_shard_materializes_through_the_torchrun_engine(tmp_path, monkeypatch, instance):
    from eagle_pipeline.defs.resources import PipelineResource
    from eagle_pipeline.hidden_states.runtime import load_extraction_model

    root, result, verdicts = _engine_shard_run(tmp_path, monkeypatch, instance, "torchrun", {"tp_size": 2})
    assert verdicts["norm_convention_matches_states"] == "pass"  # rank 0 recorded the gathered head
    (mat,) = result.asset_materializations_for_node("hidden_states")
    assert mat.metadata["engine"].value == "torchrun" and mat.metadata["device"].value == "torchrun: tp_size 2"
    assert shard_status(root.hidden_states_dir, 1) == "done"
    assert all(c.passed for c in verify_shard(root.hidden_states_dir, 1, root.merged_dir).values())
    st, idx = shard_paths(root.hidden_states_dir, 1)
    assert read_index_meta(idx)["fingerprint"]["engine"] == "torchrun"

    cfg = PipelineResource().config().hidden_states
    vocab = PipelineResource().tokenizer().vocab_size
    model = load_extraction_model(cfg.model, family=cfg.family, seed=cfg.seed, vocab_size=vocab, device="cpu")
    ref = extract_shard(
        model, root.merged_dir, shard_index=1, shard_size=SHARD_SIZE, out_dir=tmp_path / "one", final_state="post_norm"
    )
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
