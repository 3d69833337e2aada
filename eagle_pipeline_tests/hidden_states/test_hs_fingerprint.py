"""A done shard is reused only under the settings it was extracted with: the extraction fingerprint, the refusal
that names what differs, the explicit redo that keeps the old files, and the check of every shard before export."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open

from eagle_pipeline.hidden_states.checks.verify import verify_shard
from eagle_pipeline.hidden_states.layouts.trainer_layouts import load_sample
from eagle_pipeline.hidden_states.models.layers import get_backbone
from eagle_pipeline.hidden_states.models.model import build_tiny_model
from eagle_pipeline.hidden_states.run import extract_shard
from eagle_pipeline.hidden_states.store.fingerprint import merged_version, model_identity
from eagle_pipeline.hidden_states.store.format import (
    FORMAT_VERSION,
    INDEX_META_KEY,
    build_sample_index,
    read_index_meta,
    shard_paths,
)
from eagle_pipeline.hidden_states.store.shards import (
    SUPERSEDED_DIR,
    ShardMismatchError,
    ShardsNotReadyError,
    require_shards_ready,
    stored_fingerprint,
)

from ..tolerances import assert_forwards_close
from .conftest import VOCAB, make_rows, write_merged

SHARD = 5


@pytest.fixture
def merged(merged_factory):
    return merged_factory(make_rows(12, seed=21), [5, 7])


def _extract(model, merged, out, shard=0, **kw):
    kw.setdefault("shard_size", SHARD)
    kw.setdefault("final_state", "post_norm")  # these tests were written when post-norm was extract_shard's default
    return extract_shard(model, merged, shard_index=shard, out_dir=out, max_tokens_per_batch=128, **kw)


def _files(out, shard=0):
    return [(p.stat().st_mtime_ns, p.read_bytes()) for p in shard_paths(out, shard)]


@pytest.fixture(scope="module")
def other_seed():
    return build_tiny_model(VOCAB, family="deepseek_v3", seed=1)


# The repro of issue 14 item 3: each of these used to return skipped=True with the old states left in place.
CHANGES = {
    "another model (same shape, other weights)": ({"model": "other_seed"}, "model.weights_sha256"),
    "another model family": ({"model": "tiny_llama"}, "model.config_sha256"),
    "other aux_layers": ({"aux_layers": (0, 2, 5)}, "aux_layers: [1, 3, 4] (on disk) -> [0, 2, 5] (now)"),
    "pre-norm final state": ({"final_state": "pre_norm"}, "final_state: post_norm (on disk) -> pre_norm (now)"),
    "another shard_size": ({"shard_size": 6}, "shard_size: 5 (on disk) -> 6 (now)"),
    "another dtype": ({"dtype": torch.bfloat16}, "dtype: float32 (on disk) -> bfloat16 (now)"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_done_shard_under_other_settings_is_refused_naming_what_differs(change, request, tiny_ds, merged, tmp_path):
    out = tmp_path / "hs"
    first = _extract(tiny_ds, merged, out)
    before = _files(out)
    kwargs, expected = CHANGES[change]
    kwargs = dict(kwargs)
    model = request.getfixturevalue(kwargs.pop("model")) if "model" in kwargs else tiny_ds
    with pytest.raises(ShardMismatchError) as err:
        _extract(model, merged, out, **kwargs)
    message = str(err.value)
    assert expected in message and "shard 00000" in message
    assert "hidden_states.on_settings_change: redo" in message and "on_mismatch='redo'" in message
    assert err.value.shard_index == 0 and err.value.differences
    assert str(pickle.loads(pickle.dumps(err.value))) == message  # survives a process pool
    assert _files(out) == before  # neither reused nor touched
    # The same settings still reuse it.
    again = _extract(tiny_ds, merged, out)
    assert again.skipped and again.sha256 == first.sha256


def test_a_changed_merged_table_is_refused(tiny_ds, merged, tmp_path):
    out = tmp_path / "hs"
    _extract(tiny_ds, merged, out)
    old_version = merged_version(merged)
    write_merged(merged, make_rows(12, seed=22), [5, 7])  # re-merged: other rows under the same file names
    assert merged_version(merged) != old_version
    with pytest.raises(ShardMismatchError, match=r"merged_version: .* \(on disk\) -> .* \(now\)"):
        _extract(tiny_ds, merged, out)


def test_redo_on_request_extracts_anew_and_keeps_the_old_shard(tiny_ds, merged, tmp_path):
    out = tmp_path / "hs"
    first = _extract(tiny_ds, merged, out)
    old_fp = stored_fingerprint(out, 0)
    redo = _extract(tiny_ds, merged, out, aux_layers=(0, 2, 5), on_mismatch="redo")
    assert not redo.skipped and redo.aux_layers == [0, 2, 5] and redo.sha256 != first.sha256
    assert stored_fingerprint(out, 0).aux_layers == (0, 2, 5)
    assert all(c.passed for c in verify_shard(out, 0, merged).values())
    sid = make_rows(12, seed=21)[0]["sample_id"]
    assert load_sample(out, sid)["aux_hidden_states"].shape[1] == 3 * 64
    # The old files were moved (not deleted) under the old fingerprint's digest, out of the readers' sight.
    kept = out / SUPERSEDED_DIR / old_fp.digest()
    st_old, idx_old = (kept / p.name for p in shard_paths(out, 0))
    assert read_index_meta(idx_old)["sha256"] == first.sha256 and st_old.stat().st_size == first.size_bytes
    assert {loc.path for loc in build_sample_index(out).values()} == {shard_paths(out, 0)[0]}
    # And now the new settings are the ones that are reused.
    assert _extract(tiny_ds, merged, out, aux_layers=(0, 2, 5)).skipped


def test_a_shard_of_an_older_format_version_is_refused_then_extracted_again(tiny_ds, merged, tmp_path):
    """Its facts are not read (an older version may record them elsewhere): the version alone makes it stale, the
    refusal says to extract it again, and a redo moves it aside under its version's name."""
    out = tmp_path / "hs"
    first = _extract(tiny_ds, merged, out)
    _, idx = shard_paths(out, 0)
    table = pq.read_table(idx)
    meta = json.loads(table.schema.metadata[INDEX_META_KEY])
    old = {k: v for k, v in meta.items() if k != "fingerprint"}
    old["format_version"] = FORMAT_VERSION - 1
    pq.write_table(table.replace_schema_metadata({INDEX_META_KEY: json.dumps(old).encode()}), idx)
    refused = rf"format_version: {FORMAT_VERSION - 1} \(on disk\) -> {FORMAT_VERSION} \(now\).*extracted again"
    with pytest.raises(ShardMismatchError, match=refused):
        _extract(tiny_ds, merged, out)
    redone = _extract(tiny_ds, merged, out, on_mismatch="redo")
    assert not redone.skipped and redone.sha256 == first.sha256
    assert (out / "superseded" / f"format-v{FORMAT_VERSION - 1}" / idx.name).exists()


def test_the_fingerprint_is_stored_with_the_shard(tiny_ds, merged, tmp_path):
    out = tmp_path / "hs"
    s = _extract(tiny_ds, merged, out)
    fp = stored_fingerprint(out, 0)
    assert fp.to_dict() == s.fingerprint
    assert (fp.aux_layers, fp.final_state, fp.shard_size, fp.dtype) == ((1, 3, 4), "post_norm", SHARD, "float32")
    assert (fp.engine, fp.layout, fp.merged_version) == ("in_process", "shards", merged_version(merged))
    assert fp.model == model_identity(tiny_ds) and fp.model["kind"] == "in_memory"
    with safe_open(s.path, "pt") as f:
        assert json.loads(f.metadata()["fingerprint"]) == s.fingerprint


def test_model_identity_of_a_checkpoint_directory(tiny_ds, tmp_path):
    from transformers import AutoModelForCausalLM

    from eagle_pipeline.hidden_states.engines.runtime import model_identity_for_spec

    ckpt = tmp_path / "ckpt"
    tiny_ds.save_pretrained(ckpt)
    loaded = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True)
    spec = model_identity_for_spec(str(ckpt), family="deepseek_v3", seed=0, vocab_size=VOCAB)
    assert model_identity(loaded) == spec and spec["kind"] == "local_dir" and spec["weight_files"] >= 1
    with torch.no_grad():  # a fine-tune of the same shape: same config, same file sizes, other bytes
        for p in loaded.parameters():
            p.add_(0.01)
    loaded.save_pretrained(ckpt)
    tuned = model_identity_for_spec(str(ckpt), family="deepseek_v3", seed=0, vocab_size=VOCAB)
    assert tuned["config_sha256"] == spec["config_sha256"] and tuned["weight_bytes"] == spec["weight_bytes"]
    assert tuned["weights_sha256"] != spec["weights_sha256"]


def test_export_guard_names_every_shard_that_is_not_ready(tiny_ds, merged, tmp_path):
    out = tmp_path / "hs"
    for shard in (0, 1):
        _extract(tiny_ds, merged, out, shard=shard)
    wanted = stored_fingerprint(out, 0)
    with pytest.raises(ShardsNotReadyError, match=r"missing: \['00002'\]") as err:
        require_shards_ready(out, merged, wanted)
    assert [s.status for s in err.value.states] == ["done", "done", "missing"]
    _extract(tiny_ds, merged, out, shard=2)
    assert [s.status for s in require_shards_ready(out, merged, wanted)] == ["done"] * 3

    _extract(tiny_ds, merged, out, shard=1, aux_layers=(0, 2, 5), on_mismatch="redo")
    st, _ = shard_paths(out, 2)
    st.write_bytes(b"truncated")
    with pytest.raises(ShardsNotReadyError) as err:
        require_shards_ready(out, merged, wanted)
    message = str(err.value)
    assert "partial: ['00002']" in message
    assert "00001 (aux_layers: [0, 2, 5] (on disk) -> [1, 3, 4] (now))" in message
    assert "nothing was exported" in message


def test_export_guard_leaves_dtype_open_but_wants_one_fingerprint(tiny_ds, merged, tmp_path):
    out = tmp_path / "hs"
    _extract(tiny_ds, merged, out, shard=0)
    _extract(tiny_ds, merged, out, shard=1, dtype=torch.bfloat16)
    _extract(tiny_ds, merged, out, shard=2)
    open_dtype = dataclasses.replace(stored_fingerprint(out, 0), dtype=None)  # what a CPU export step asks for
    with pytest.raises(ShardsNotReadyError, match="2 different fingerprints"):
        require_shards_ready(out, merged, open_dtype)
    _extract(tiny_ds, merged, out, shard=1, on_mismatch="redo")  # now float32 like the others
    assert len(require_shards_ready(out, merged, open_dtype)) == 3


def test_export_guard_names_shard_files_beyond_the_table(tiny_ds, merged, tmp_path):
    out = tmp_path / "hs"
    for shard in (0, 1, 2):
        _extract(tiny_ds, merged, out, shard=shard)
    small = write_merged(tmp_path / "small", make_rows(12, seed=21)[:10], [5, 5])  # the table shrank to 2 shards
    for shard in (0, 1):
        _extract(tiny_ds, small, out, shard=shard, on_mismatch="redo")
    beyond = r"beyond the 2 shards .*\['shard-00002.index.parquet', 'shard-00002.safetensors'\]"
    with pytest.raises(ShardsNotReadyError, match=beyond):
        require_shards_ready(out, small, stored_fingerprint(out, 0))


# ---------------------------------------------------------------- issue 14 item 7: hf_hidden_states_indices


@pytest.mark.parametrize("final_state", ["post_norm", "pre_norm"])
def test_recorded_hf_indices_hold_the_stored_tensors(final_state, tiny_ds, merged_factory, tmp_path):
    rows = make_rows(3, seed=23)
    merged = merged_factory(rows)
    n_layers = 8
    aux = (1, 4, n_layers - 1)  # the last decoder layer's raw output is not in transformers' tuple
    s = extract_shard(
        tiny_ds, merged, shard_index=0, shard_size=3, out_dir=tmp_path / "hs", aux_layers=aux, final_state=final_state
    )
    with safe_open(s.path, "pt") as f:
        meta = f.metadata()
    indices = json.loads(meta["hf_hidden_states_indices"])
    final_index = json.loads(meta["hf_hidden_states_final_index"])
    assert indices == [2, 5, None]
    assert final_index == (n_layers if final_state == "post_norm" else None)
    with torch.no_grad():
        out = get_backbone(tiny_ds)(input_ids=torch.tensor([rows[0]["input_ids"]]), output_hidden_states=True)
    hs = [h[0] for h in out.hidden_states]
    stored = load_sample(tmp_path / "hs", rows[0]["sample_id"])
    parts = stored["aux_hidden_states"].split(64, dim=-1)
    for part, index in zip(parts, indices):
        if index is not None:
            assert_forwards_close(part, hs[index], tiny_ds.config, what=f"aux {index}")
        else:  # no tuple entry holds it: in particular not the last one, which is post-norm
            assert not any(torch.allclose(part, h, atol=1e-3) for h in hs)
    if final_index is not None:
        assert_forwards_close(stored["final_hidden_state"], hs[final_index], tiny_ds.config, what="final")
    else:
        assert not any(torch.allclose(stored["final_hidden_state"], h, atol=1e-3) for h in hs)
