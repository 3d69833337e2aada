"""Batched extraction: numerics against per-sample forwards, file format, streaming reads, NaN accounting."""

from __future__ import annotations

import dataclasses
import json
import types

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagle_pipeline.hidden_states.checks.verify import verify_shard
from eagle_pipeline.hidden_states.engines.batching import padding_of, plan_batches
from eagle_pipeline.hidden_states.layouts.trainer_layouts import load_sample
from eagle_pipeline.hidden_states.models.layers import get_backbone
from eagle_pipeline.hidden_states.models.model import build_tiny_model
from eagle_pipeline.hidden_states.run import extract_shard
from eagle_pipeline.hidden_states.store.fingerprint import ExtractionFingerprint, recorded_fingerprint
from eagle_pipeline.hidden_states.store.format import FORMAT_VERSION, TENSOR_NAMES, read_index_meta
from eagle_pipeline.hidden_states.store.merged import read_rows

from ..tolerances import assert_forwards_close
from .conftest import VOCAB, make_rows


def _reference(model, ids: list[int], aux: tuple[int, ...]):
    """One sample, no padding, through transformers' own output_hidden_states."""
    with torch.no_grad():
        out = get_backbone(model)(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    return torch.cat([hs[k + 1][0] for k in aux], dim=-1), hs[-1][0]


@pytest.mark.parametrize("family", ["deepseek_v3", "llama"])
def test_batched_extraction_equals_per_sample_forward(family, tiny_ds, tiny_llama, merged_factory, tmp_path):
    model = tiny_ds if family == "deepseek_v3" else tiny_llama
    rows = make_rows(20, seed=1, min_len=1, max_len=60)
    merged = merged_factory(rows, [7, 13])
    s = extract_shard(
        model,
        merged,
        shard_index=0,
        shard_size=20,
        out_dir=tmp_path / "hs",
        max_tokens_per_batch=150,
        final_state="post_norm",
    )
    # The test is only meaningful if it really batched rows of different lengths together.
    assert 1 < s.batches < 20 and s.padded_tokens > 0
    assert s.aux_layers == [1, 3, 4] and s.final_state_is_post_norm
    tensors = load_file(s.path)
    for r in rows:
        aux_ref, final_ref = _reference(model, r["input_ids"], (1, 3, 4))
        aux = tensors[f"{r['sample_id']}/aux_hidden_states"]
        final = tensors[f"{r['sample_id']}/final_hidden_state"]
        assert_forwards_close(aux, aux_ref, model.config, what=r["sample_id"])
        assert_forwards_close(final, final_ref, model.config, what=r["sample_id"])
    # Distinct layers really differ (a layer off-by-one would not pass silently).
    h = 64
    a = tensors[f"{rows[0]['sample_id']}/aux_hidden_states"]
    assert not torch.allclose(a[:, :h], a[:, h : 2 * h], atol=1e-3)


def test_pre_norm_final_state_is_last_layer_output(tiny_ds, merged_factory, tmp_path):
    rows = make_rows(6, seed=2)
    merged = merged_factory(rows)
    s = extract_shard(tiny_ds, merged, shard_index=0, shard_size=6, out_dir=tmp_path / "hs", final_state="pre_norm")
    assert not s.final_state_is_post_norm
    backbone = get_backbone(tiny_ds)
    captured = {}
    h = backbone.layers[-1].register_forward_hook(lambda _m, _a, out: captured.__setitem__("x", out))
    try:
        with torch.no_grad():
            post = backbone(input_ids=torch.tensor([rows[0]["input_ids"]]), use_cache=False).last_hidden_state[0]
    finally:
        h.remove()
    final = load_sample(tmp_path / "hs", rows[0]["sample_id"])["final_hidden_state"]
    assert_forwards_close(final, captured["x"][0], tiny_ds.config, what="pre-norm")
    assert not torch.allclose(final, post, atol=1e-2)
    with torch.no_grad():
        assert_forwards_close(backbone.norm(final), post, tiny_ds.config, what="post-norm")
    with safe_open(s.path, "pt") as f:
        assert recorded_fingerprint(f.metadata()).final_state == "pre_norm"


def test_safetensors_and_index_read_back(tiny_ds, merged_factory, tmp_path):
    rows = make_rows(14, seed=3)
    merged = merged_factory(rows, [5, 9])
    s = extract_shard(tiny_ds, merged, shard_index=1, shard_size=6, out_dir=tmp_path / "hs", max_tokens_per_batch=64)
    shard_rows = rows[6:12]
    assert (s.row_start, s.row_stop, s.rows) == (6, 12, 6)
    assert s.tokens == sum(r["n_tokens"] for r in shard_rows)
    assert s.padding_fraction == pytest.approx(s.padded_tokens / (s.tokens + s.padded_tokens))
    with safe_open(s.path, "pt") as f:
        keys = set(f.keys())
        meta = f.metadata()
    assert keys == {f"{r['sample_id']}/{n}" for r in shard_rows for n in TENSOR_NAMES}
    assert recorded_fingerprint(meta).aux_layers == (1, 3, 4)
    assert json.loads(meta["hf_hidden_states_indices"]) == [2, 4, 5]
    assert meta["dtype"] == "float32" and meta["hidden_size"] == "64" and meta["format_version"] == str(FORMAT_VERSION)
    assert (meta["shard_index"], meta["row_start"], meta["row_stop"]) == ("1", "6", "12")
    assert json.loads(meta["model"])["model_type"] == "deepseek_v3"
    t = load_file(s.path)
    for r in shard_rows:
        sid, n = r["sample_id"], r["n_tokens"]
        assert t[f"{sid}/aux_hidden_states"].shape == (n, 3 * 64)
        assert t[f"{sid}/final_hidden_state"].shape == (n, 64)
        assert t[f"{sid}/aux_hidden_states"].dtype == torch.float32
        assert t[f"{sid}/input_ids"].dtype == torch.int32
        assert t[f"{sid}/loss_mask"].dtype == torch.int8
        assert t[f"{sid}/input_ids"].tolist() == r["input_ids"]
        assert t[f"{sid}/loss_mask"].tolist() == r["loss_mask"]
    index = pq.read_table(s.index_path).to_pylist()
    assert [x["sample_id"] for x in index] == [r["sample_id"] for r in shard_rows]
    assert [x["row_index"] for x in index] == list(range(6, 12))
    assert [x["n_supervised"] for x in index] == [sum(r["loss_mask"]) for r in shard_rows]
    assert [x["dataset"] for x in index] == [r["dataset"] for r in shard_rows]
    assert all(x["n_nonfinite"] == 0 for x in index)
    assert index[0]["keys"] == [f"{shard_rows[0]['sample_id']}/{n}" for n in TENSOR_NAMES]
    imeta = read_index_meta(s.index_path)
    assert imeta["sha256"] == s.sha256 and imeta["size_bytes"] == s.size_bytes
    assert all(c.passed for c in verify_shard(tmp_path / "hs", 1, merged).values())


def test_each_fact_of_a_shard_is_recorded_once_in_each_file(tiny_ds, merged_factory, tmp_path):
    """The fingerprint is the record of the facts it covers: neither the header nor the index repeats them beside
    it (the top-level `model` and `dtype` are other facts: the target's description beside its identity, the
    stored dtype beside the pinned one, which the vLLM engine leaves open), and the index
    embeds no summary: the summary a reuse reports is derived from the index, equal to the one the run reported."""
    merged = merged_factory(make_rows(8, seed=5), [8])
    s = extract_shard(tiny_ds, merged, shard_index=0, shard_size=8, out_dir=tmp_path / "hs", max_tokens_per_batch=64)
    covered = {f.name for f in dataclasses.fields(ExtractionFingerprint)}
    with safe_open(s.path, "pt") as f:
        header = f.metadata()
    index = read_index_meta(s.index_path)
    for meta in (header, index):
        assert set(meta) & covered == {"model", "dtype"} and "final_state_is_post_norm" not in meta
        assert recorded_fingerprint(meta).to_dict() == s.fingerprint
    assert "summary" not in index and set(index["run"]) >= {"seconds", "batches", "padded_tokens"}
    again = extract_shard(
        tiny_ds, merged, shard_index=0, shard_size=8, out_dir=tmp_path / "hs", max_tokens_per_batch=64
    )
    assert again.skipped and dataclasses.replace(again, skipped=False) == s


def test_bf16_output_matches_fp32(tiny_ds, merged_factory, tmp_path):
    rows = make_rows(5, seed=4)
    merged = merged_factory(rows)
    s32 = extract_shard(tiny_ds, merged, shard_index=0, shard_size=5, out_dir=tmp_path / "a")
    s16 = extract_shard(tiny_ds, merged, shard_index=0, shard_size=5, out_dir=tmp_path / "b", dtype=torch.bfloat16)
    assert s16.dtype == "bfloat16"
    a, b = load_file(s32.path), load_file(s16.path)
    for k in a:
        if k.endswith("hidden_states") or k.endswith("hidden_state"):
            assert b[k].dtype == torch.bfloat16
            assert_forwards_close(b[k], a[k], tiny_ds.config, what=k)
    assert all(c.passed for c in verify_shard(tmp_path / "b", 0, merged).values())


def test_reads_only_the_shards_row_groups(tiny_ds, merged_factory, tmp_path, monkeypatch):
    rows = make_rows(24, seed=5, max_len=8)
    merged = merged_factory(rows, [8, 8, 8], row_group_size=4)
    seen: list[tuple[str, tuple[int, ...]]] = []
    original = pq.ParquetFile.read_row_groups

    def spy(self, row_groups, *args, **kwargs):
        seen.append((self.metadata.num_rows, tuple(row_groups)))
        return original(self, row_groups, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", spy)
    got = read_rows(merged, 6, 10)
    assert got.sample_ids == [r["sample_id"] for r in rows[6:10]]
    # rows 6..9 are part 0's row group 1 and part 1's row group 0; nothing else is decoded.
    assert seen == [(8, (1,)), (8, (0,))]


def test_plan_batches_respects_budget_and_sorting_cuts_padding():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 500, 300).tolist()
    batches = plan_batches(lengths, 2048)
    assert sorted(i for b in batches for i in b) == list(range(300))
    assert all(len(b) * max(lengths[i] for i in b) <= 2048 for b in batches)
    _, sorted_pad = padding_of(lengths, batches)
    _, naive_pad = padding_of(lengths, plan_batches(lengths, 2048, sort=False))
    assert sorted_pad < naive_pad / 4
    # A row longer than the budget still runs, alone.
    assert plan_batches([10, 5000, 10], 100) == [[1], [0, 2]]


def test_nonfinite_samples_are_recorded_not_dropped(merged_factory, tmp_path):
    model = build_tiny_model(VOCAB, family="deepseek_v3", seed=0)
    poison = 7
    with torch.no_grad():
        get_backbone(model).embed_tokens.weight[poison] = float("nan")
    rows = make_rows(10, seed=6)
    for r in rows:
        r["input_ids"] = [t if t != poison else poison + 1 for t in r["input_ids"]]
    for k in (2, 5):
        rows[k]["input_ids"][-1] = poison
    merged = merged_factory(rows)
    s = extract_shard(model, merged, shard_index=0, shard_size=10, out_dir=tmp_path / "hs", max_tokens_per_batch=4096)
    assert s.rows == 10 and s.n_nonfinite_samples == 2
    index = pq.read_table(s.index_path).to_pylist()
    bad = {x["sample_id"] for x in index if x["n_nonfinite"] > 0}
    assert bad == {rows[2]["sample_id"], rows[5]["sample_id"]}
    checks = verify_shard(tmp_path / "hs", 0, merged)
    assert not checks["finite"].passed and checks["finite"].failing == 2
    assert set(checks["finite"].failing_sample_ids) == bad
    assert checks["shapes"].passed and checks["ids_match"].passed


def test_bad_inputs_are_refused(tiny_ds, merged_factory, tmp_path):
    rows = make_rows(4, seed=7)
    rows[1]["input_ids"][0] = VOCAB + 5
    merged = merged_factory(rows)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        extract_shard(tiny_ds, merged, shard_index=0, shard_size=4, out_dir=tmp_path / "hs")
    rows = make_rows(4, seed=7)
    rows[3]["sample_id"] = rows[0]["sample_id"]
    merged = merged_factory(rows)
    with pytest.raises(ValueError, match="duplicate sample_id"):
        extract_shard(tiny_ds, merged, shard_index=0, shard_size=4, out_dir=tmp_path / "hs2")
    with pytest.raises(IndexError):
        extract_shard(tiny_ds, merged, shard_index=1, shard_size=4, out_dir=tmp_path / "hs3")
    with pytest.raises(ValueError, match="out of range"):
        extract_shard(tiny_ds, merged, shard_index=0, shard_size=4, out_dir=tmp_path / "hs4", aux_layers=(1, 8))


class _DeviceRecorder(torch.nn.Module):
    """A model that says its parameters live on `device` (no GPU needed) and records where it is moved."""

    def __init__(self, device: str):
        super().__init__()
        self.on, self.moved_to = torch.device(device), []

    def parameters(self, recurse: bool = True):
        yield types.SimpleNamespace(device=self.on)

    def to(self, dev):
        self.moved_to.append(dev)
        self.on = dev
        return self


@pytest.mark.parametrize(
    ("on", "leased", "moved"),
    [("cuda:0", "cuda:1", True), ("cpu", "cuda:0", True), ("cuda:1", "cuda:1", False), ("cpu", "cpu", False)],
)
def test_a_preloaded_model_is_moved_to_the_leased_gpu(on, leased, moved):
    from eagle_pipeline.hidden_states.engines.extract import _place_model

    model = _DeviceRecorder(on)
    _place_model(model, torch.device(leased))
    assert model.moved_to == ([torch.device(leased)] if moved else [])
