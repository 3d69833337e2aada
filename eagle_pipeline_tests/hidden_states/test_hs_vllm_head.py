"""The vLLM engine records the target's final norm and lm_head from the checkpoint's safetensors files (only those
two tensors), so the audit's norm and teacher checks judge engine shards as they judge in-process ones: a tiny target
served by the loopback double over real HTTP passes every check JUDGED; a head from another checkpoint fails."""

from __future__ import annotations

import json
import os
import re
import time

import pytest
import torch
from safetensors.torch import save_file

from eagle_pipeline.hidden_states import extract_shard
from eagle_pipeline.hidden_states.audit import NOT_JUDGED, PASS, TeacherJudgement, audit_shard
from eagle_pipeline.hidden_states.engine_vllm import extract_shard_vllm
from eagle_pipeline.hidden_states.format import read_index_meta
from eagle_pipeline.hidden_states.head import (
    SAFETENSORS_INDEX,
    TARGET_HEAD_FILE,
    HeadCacheWarning,
    checkpoint_head,
    checkpoint_head_key,
    head_cache_path,
    load_target_head,
    read_head_cache,
    save_target_head_from_checkpoint,
    write_head_cache,
)
from eagle_pipeline.hidden_states.vllm_double import VLLMHiddenStatesDouble
from eagle_pipeline.hidden_states.vllm_files import vllm_layer_ids

from .conftest import VOCAB, greedy_rows

L, AUX = 8, (1, 3, 4)
JUDGE = TeacherJudgement(True)


@pytest.fixture(scope="module")
def texts(normed_model):
    return greedy_rows(normed_model, 8, seed=11)


def _engine_shard(model, checkpoint, merged, tmp_path, n, out="eng"):
    storage = tmp_path / "storage"
    with VLLMHiddenStatesDouble(model, layer_ids=vllm_layer_ids(AUX, L), storage_path=storage) as srv:
        return extract_shard_vllm(
            merged,
            shard_index=0,
            shard_size=n,
            out_dir=tmp_path / out,
            endpoints=[srv.url],
            storage_path=storage,
            num_layers=L,
            aux_layers=AUX,
            hidden_size=64,
            head_checkpoint=checkpoint,
            backoff_base_s=0.01,
            timeout_s=10.0,
        )


def test_engine_shards_are_judged_with_the_checkpoint_head(normed_model, texts, merged_factory, tmp_path):
    checkpoint = tmp_path / "ckpt"
    normed_model.save_pretrained(checkpoint)
    merged = merged_factory(texts)
    s = _engine_shard(normed_model, checkpoint, merged, tmp_path, len(texts))
    meta = read_index_meta(s.index_path)
    assert meta["final_state"] == "pre_norm" and meta["final_norm_eps"] == 1e-5 and meta["target_head_sha256"]
    head = load_target_head(tmp_path / "eng")
    assert head.meta["source"]["final_norm"] == "model.safetensors:model.norm.weight"
    # The recorded head is the one the in-process engine records from the loaded model, tensor for tensor.
    extract_shard(normed_model, merged, shard_index=0, shard_size=len(texts), out_dir=tmp_path / "inp")
    in_process = load_target_head(tmp_path / "inp")
    assert torch.equal(head.norm_weight, in_process.norm_weight) and torch.equal(head.lm_head, in_process.lm_head)
    assert head.eps == in_process.eps

    results = audit_shard(tmp_path / "eng", 0, merged, expected_aux_layers=AUX, judgement=JUDGE)
    assert {n: r.verdict for n, r in results.items()} == dict.fromkeys(results, PASS), {
        n: r.detail for n, r in results.items()
    }
    assert results["teacher_agreement"].metrics["top1_agreement"] == 1.0
    assert results["norm_convention"].metrics["recorded_convention"] == "pre_norm"


def test_a_head_from_another_checkpoint_fails_the_teacher_check(normed_model, tiny_ds, texts, merged_factory, tmp_path):
    wrong = tmp_path / "other"
    tiny_ds.save_pretrained(wrong)  # same shapes, other weights: the servers' model is not this checkpoint
    merged = merged_factory(texts)
    _engine_shard(normed_model, wrong, merged, tmp_path, len(texts))
    results = audit_shard(tmp_path / "eng", 0, merged, expected_aux_layers=AUX, judgement=JUDGE)
    teacher = results["teacher_agreement"]
    assert not teacher.passed and teacher.verdict == "fail" and teacher.metrics["top1_agreement"] < 0.2


def test_without_a_checkpoint_the_two_checks_say_not_judged(normed_model, texts, merged_factory, tmp_path):
    merged = merged_factory(texts)
    _engine_shard(normed_model, None, merged, tmp_path, len(texts))
    assert not (tmp_path / "eng" / TARGET_HEAD_FILE).exists()
    results = audit_shard(tmp_path / "eng", 0, merged, expected_aux_layers=AUX, judgement=JUDGE)
    for name in ("norm_convention", "teacher_agreement"):
        assert results[name].verdict == NOT_JUDGED and "NOT JUDGED" in results[name].detail


def _kimi_style_checkpoint(d, *, tied=False, drop=(), seed=1):
    """A sharded checkpoint under Kimi-K2.5's names (`language_model.` prefix, a VLM config with text_config)."""
    d.mkdir(exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "language_model.model.embed_tokens.weight": torch.randn(VOCAB, 64, generator=g),
        "language_model.model.layers.0.mlp.gate.weight": torch.randn(8, 64, generator=g),
        "language_model.model.norm.weight": torch.rand(64, generator=g) + 0.5,
        "language_model.lm_head.weight": torch.randn(VOCAB, 64, generator=g),
        "vision_tower.patch_embed.weight": torch.randn(4, 4, generator=g),
    }
    if tied:
        del tensors["language_model.lm_head.weight"]
    files = {name: f"model-{k % 2 + 1:05d}-of-00002.safetensors" for k, name in enumerate(tensors)}
    for file in sorted(set(files.values())):
        save_file({n: t for n, t in tensors.items() if files[n] == file and n not in drop}, str(d / file))
    (d / SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": files}))
    text = {"model_type": "kimi_k2", "hidden_size": 64, "vocab_size": VOCAB, "rms_norm_eps": 1e-6}
    config = {"model_type": "kimi_k25", "text_config": {**text, "tie_word_embeddings": tied}}
    (d / "config.json").write_text(json.dumps(config))
    return tensors, files


@pytest.mark.parametrize("tied", [False, True])
def test_a_sharded_kimi_style_checkpoint_gives_exactly_its_head(tmp_path, tied):
    tensors, files = _kimi_style_checkpoint(tmp_path / "kimi", tied=tied)
    found = checkpoint_head(tmp_path / "kimi")
    norm, head = found.load()
    want_head = "language_model.model.embed_tokens.weight" if tied else "language_model.lm_head.weight"
    assert found.norm_key == "language_model.model.norm.weight" and found.head_key == want_head
    assert torch.equal(norm, tensors["language_model.model.norm.weight"]) and torch.equal(head, tensors[want_head])
    assert found.eps == 1e-6  # from text_config
    assert (found.norm_file.name, found.head_file.name) == (files[found.norm_key], files[want_head])


def test_absent_tensors_and_files_are_named(tmp_path):
    _kimi_style_checkpoint(tmp_path / "a", drop=("language_model.lm_head.weight",))
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002.safetensors: has no tensor language_model\."):
        checkpoint_head(tmp_path / "a")
    _kimi_style_checkpoint(tmp_path / "b")
    (tmp_path / "b" / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00001-of-00002.safetensors: named by .*index.json.*absent"):
        checkpoint_head(tmp_path / "b")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text(json.dumps({"hidden_size": 64, "vocab_size": VOCAB}))
    with pytest.raises(FileNotFoundError, match=r"c: no model.safetensors.index.json and no \*.safetensors file"):
        checkpoint_head(tmp_path / "c")
    save_file({"model.norm.weight": torch.ones(64)}, str(tmp_path / "c" / "model.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"model.safetensors: no lm_head tensor \(looked for lm_head.weight"):
        checkpoint_head(tmp_path / "c")


def test_a_missing_head_stops_the_run_before_any_request(normed_model, texts, merged_factory, tmp_path):
    (tmp_path / "cfg").mkdir()
    normed_model.config.save_pretrained(tmp_path / "cfg")  # a config.json without weights
    merged = merged_factory(texts)
    with pytest.raises(FileNotFoundError, match=r"cfg: no model\.safetensors\.index\.json"):
        _engine_shard(normed_model, tmp_path / "cfg", merged, tmp_path, len(texts))
    assert not (tmp_path / "storage").exists() or list((tmp_path / "storage").iterdir()) == []


def test_later_shard_runs_read_the_head_cache_not_the_checkpoint(normed_model, texts, merged_factory, tmp_path):
    checkpoint = tmp_path / "ckpt"
    normed_model.save_pretrained(checkpoint)
    merged = merged_factory(texts)
    _engine_shard(normed_model, checkpoint, merged, tmp_path, len(texts))
    found = checkpoint_head(checkpoint)
    cache = head_cache_path(found, tmp_path / "head_cache")  # the data root's (`out_dir`'s parent) by default
    assert list((tmp_path / "head_cache").iterdir()) == [cache]
    first = cache.stat()
    norm, head = found.load()
    cached = read_head_cache(cache, checkpoint_head_key(found))
    assert cached is not None and torch.equal(cached[0], norm) and torch.equal(cached[1], head)

    _engine_shard(normed_model, checkpoint, merged, tmp_path, len(texts), out="eng2")
    again = cache.stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)  # read, not rebuilt
    recorded = load_target_head(tmp_path / "eng2")
    assert torch.equal(recorded.norm_weight, norm) and torch.equal(recorded.lm_head, head)

    # A cache entry under this checkpoint's key holding other values is what the next run records: it reads the
    # cache, not the checkpoint.
    write_head_cache(cache, checkpoint_head_key(found), norm + 1, head)
    _engine_shard(normed_model, checkpoint, merged, tmp_path, len(texts), out="eng3")
    assert torch.equal(load_target_head(tmp_path / "eng3").norm_weight, norm + 1)


def _record(checkpoint, tmp_path, out):
    return save_target_head_from_checkpoint(checkpoint_head(checkpoint), tmp_path / out, cache_dir=tmp_path / "cache")


def test_a_changed_checkpoint_invalidates_its_cache_entry(tmp_path):
    ckpt = tmp_path / "kimi"
    _kimi_style_checkpoint(ckpt)
    _record(ckpt, tmp_path, "a")
    cache = head_cache_path(checkpoint_head(ckpt), tmp_path / "cache")

    # New weights in the same files (same shapes, so the same sizes), written a second later.
    new, files = _kimi_style_checkpoint(ckpt, seed=2)
    for file in set(files.values()):
        st = (ckpt / file).stat()
        os.utime(ckpt / file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    _record(ckpt, tmp_path, "b")
    recorded = load_target_head(tmp_path / "b")
    assert torch.equal(recorded.lm_head, new["language_model.lm_head.weight"])
    assert list((tmp_path / "cache").iterdir()) == [cache]  # the checkpoint's one entry, replaced

    # Rewritten in place with every mtime put back: the ctime still moves (timestamps tick at the kernel's coarse
    # clock, a few ms; the sleep makes sure one tick passed).
    time.sleep(0.05)
    before = {f: (ckpt / f).stat() for f in set(files.values())}
    newer, _ = _kimi_style_checkpoint(ckpt, seed=3)
    for f, st in before.items():
        os.utime(ckpt / f, ns=(st.st_atime_ns, st.st_mtime_ns))
        after = (ckpt / f).stat()
        assert (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns)
        assert after.st_ctime_ns != st.st_ctime_ns
    _record(ckpt, tmp_path, "c")
    assert torch.equal(load_target_head(tmp_path / "c").norm_weight, newer["language_model.model.norm.weight"])

    # Another checkpoint directory with the same files (mtimes kept) gets its own entry.
    other = tmp_path / "copy"
    other.mkdir()
    for f in ckpt.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
        os.utime(other / f.name, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns))
    _record(other, tmp_path, "d")
    assert len(list((tmp_path / "cache").iterdir())) == 2


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
def test_a_damaged_cache_file_is_named_and_rebuilt(tmp_path, damage):
    tensors, _ = _kimi_style_checkpoint(tmp_path / "kimi")
    _record(tmp_path / "kimi", tmp_path, "a")
    found = checkpoint_head(tmp_path / "kimi")
    cache = head_cache_path(found, tmp_path / "cache")
    data = bytearray(cache.read_bytes())
    if damage == "truncated":
        del data[len(data) // 2 :]
    else:
        data[-3] ^= 0x40  # inside the last tensor's data
    cache.write_bytes(bytes(data))
    logged = []
    with pytest.warns(HeadCacheWarning, match=re.escape(str(cache))):
        save_target_head_from_checkpoint(found, tmp_path / "b", cache_dir=tmp_path / "cache", log=logged.append)
    assert any(str(cache) in line and line.startswith("warning:") for line in logged)
    recorded = load_target_head(tmp_path / "b")
    assert torch.equal(recorded.lm_head, tensors["language_model.lm_head.weight"])
    rebuilt = read_head_cache(cache, checkpoint_head_key(found))
    assert rebuilt is not None and torch.equal(rebuilt[1], tensors["language_model.lm_head.weight"])
