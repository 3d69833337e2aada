"""The vLLM engine records the target's final norm and lm_head from the checkpoint's safetensors files (only those
two tensors), so the audit's norm and teacher checks judge engine shards as they judge in-process ones: a tiny target
served by the loopback double over real HTTP passes every check JUDGED; a head from another checkpoint fails; a head
rewritten in place makes the shards cut with the old one stale."""

from __future__ import annotations

import ctypes
import json
import os
import re
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle_pipeline.hidden_states.checks.audit import (
    FAIL,
    NOT_JUDGED,
    PASS,
    TeacherJudgement,
    audit_shard,
)
from eagle_pipeline.hidden_states.checks.stored_audits import audit_shard_cached
from eagle_pipeline.hidden_states.engines.vllm.vllm_files import vllm_layer_ids
from eagle_pipeline.hidden_states.run import extract_shard
from eagle_pipeline.hidden_states.store.fingerprint import recorded_fingerprint
from eagle_pipeline.hidden_states.store.format import read_index_meta
from eagle_pipeline.hidden_states.store.head import (
    SAFETENSORS_INDEX,
    TARGET_HEAD_FILE,
    DamagedHeadWarning,
    checkpoint_head,
    checkpoint_head_key,
    load_target_head,
    save_target_head,
    save_target_head_from_checkpoint,
    verified_head_sha256,
)
from eagle_pipeline.hidden_states.store.shards import (
    ShardMismatchError,
    ShardsNotReadyError,
    require_shards_ready,
    shard_state,
    stored_fingerprint,
)
from eagle_pipeline.shared.storage import file_sha256
from eagle_pipeline.simulation.vllm_hidden_states import VLLMHiddenStatesDouble
from eagle_pipeline_tests.hidden_states.engine_runs import vllm_shard

from .conftest import VOCAB, greedy_rows

L, AUX = 8, (1, 3, 4)
JUDGE = TeacherJudgement(True)


@pytest.fixture(scope="module")
def texts(normed_model):
    return greedy_rows(normed_model, 8, seed=11)


def _engine_shard(model, checkpoint, merged, tmp_path, n, out="eng", shard_index=0, **kw):
    """Shard `shard_index` of `n` rows through the double, its head recorded from `checkpoint` (`kw`: more
    arguments of `engine_runs.vllm_shard`)."""
    storage = tmp_path / "storage"
    with VLLMHiddenStatesDouble(model, layer_ids=vllm_layer_ids(AUX, L), storage_path=storage) as srv:
        return vllm_shard(
            merged,
            shard_index=shard_index,
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
            **kw,
        )


def test_engine_shards_are_judged_with_the_checkpoint_head(normed_model, texts, merged_factory, tmp_path):
    checkpoint = tmp_path / "ckpt"
    normed_model.save_pretrained(checkpoint)
    merged = merged_factory(texts)
    s = _engine_shard(normed_model, checkpoint, merged, tmp_path, len(texts))
    meta = read_index_meta(s.index_path)
    assert (
        recorded_fingerprint(meta).final_state == "pre_norm"
        and meta["final_norm_eps"] == 1e-5
        and meta["target_head_sha256"]
    )
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


def _head_meta(path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def test_later_shard_runs_verify_the_recorded_head_not_the_checkpoint(normed_model, texts, merged_factory, tmp_path):
    checkpoint = tmp_path / "ckpt"
    normed_model.save_pretrained(checkpoint)
    merged = merged_factory(texts)
    n = len(texts) // 4  # four shards of one data root, recorded beside each other
    first_shard = _engine_shard(normed_model, checkpoint, merged, tmp_path, n)
    found = checkpoint_head(checkpoint)
    path = tmp_path / "eng" / TARGET_HEAD_FILE
    assert _head_meta(path)["checkpoint_head_key"] == checkpoint_head_key(found)
    assert not (tmp_path / "head_cache").exists()
    first, sha = path.stat(), read_index_meta(first_shard.index_path)["target_head_sha256"]
    norm, head = found.load()

    later = _engine_shard(normed_model, checkpoint, merged, tmp_path, n, shard_index=1)
    again = path.stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)  # verified, not rewritten
    assert read_index_meta(later.index_path)["target_head_sha256"] == sha == file_sha256(path)
    recorded = load_target_head(tmp_path / "eng")
    assert torch.equal(recorded.norm_weight, norm) and torch.equal(recorded.lm_head, head)

    # A head recorded under this checkpoint's key holding other values is what the next run keeps: it verifies the
    # recorded file, it does not compare it with the checkpoint.
    _, planted = save_target_head(
        tmp_path / "eng",
        norm_weight=norm + 1,
        eps=found.eps,
        lm_head=head,
        source={},
        checkpoint_key=checkpoint_head_key(found),
    )
    third = _engine_shard(normed_model, checkpoint, merged, tmp_path, n, shard_index=2)
    assert torch.equal(load_target_head(tmp_path / "eng").norm_weight, norm + 1)
    assert read_index_meta(third.index_path)["target_head_sha256"] == planted != sha


class _Opens:
    """Which of the watched files any process opens (Linux inotify): safetensors opens and maps files in Rust, past
    any Python hook, and a `chmod 000` would prove nothing here (it moves the ctime, so the key, and root reads
    anyway)."""

    IN_OPEN = 0x20

    def __init__(self, *paths):
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK)
        assert self._fd >= 0, os.strerror(ctypes.get_errno())
        self._names = {}
        for p in paths:
            wd = self._libc.inotify_add_watch(self._fd, str(p).encode(), self.IN_OPEN)
            assert wd >= 0, os.strerror(ctypes.get_errno())
            self._names[wd] = Path(p).name

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        os.close(self._fd)

    def opened(self) -> list[str]:
        try:
            data = os.read(self._fd, 1 << 16)
        except BlockingIOError:
            return []
        names, i = [], 0
        while i < len(data):
            wd, mask, _, length = struct.unpack_from("iIII", data, i)
            if mask & self.IN_OPEN:
                names.append(self._names[wd])
            i += 16 + length
        return names


def test_an_unchanged_checkpoint_has_none_of_its_head_files_opened(tmp_path):
    ckpt, out = tmp_path / "kimi", tmp_path / "hs"
    _, files = _kimi_style_checkpoint(ckpt)
    head_files = sorted({ckpt / f for f in files.values()})
    found = checkpoint_head(ckpt)  # reads the files' headers (before every shard run's first request)
    with _Opens(*head_files) as opens:
        _, sha = save_target_head_from_checkpoint(found, out)
        assert set(opens.opened()) == {f.name for f in head_files}  # the first record reads both: the watch sees it
    found = checkpoint_head(ckpt)
    with _Opens(*head_files) as opens:
        assert save_target_head_from_checkpoint(found, out) == (out / TARGET_HEAD_FILE, sha)
        assert opens.opened() == []
    assert sha == file_sha256(out / TARGET_HEAD_FILE)

    # New bytes in place, size and mtime put back: the ctime moves, the key with it, and the checkpoint is read.
    time.sleep(0.05)
    before = {f: f.stat() for f in head_files}
    newer, _ = _kimi_style_checkpoint(ckpt, seed=4)
    for f, st in before.items():
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert (f.stat().st_size, f.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    found = checkpoint_head(ckpt)
    with _Opens(*head_files) as opens:
        _, changed = save_target_head_from_checkpoint(found, out)
        assert opens.opened() != []
    assert changed != sha
    assert torch.equal(load_target_head(out).lm_head, newer["language_model.lm_head.weight"])


def test_a_changed_checkpoint_is_read_again(tmp_path):
    ckpt, out = tmp_path / "kimi", tmp_path / "hs"
    _kimi_style_checkpoint(ckpt)
    save_target_head_from_checkpoint(checkpoint_head(ckpt), out)
    path = out / TARGET_HEAD_FILE

    # New weights in the same files (same shapes, so the same sizes), written a second later.
    new, files = _kimi_style_checkpoint(ckpt, seed=2)
    for file in set(files.values()):
        st = (ckpt / file).stat()
        os.utime(ckpt / file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    save_target_head_from_checkpoint(checkpoint_head(ckpt), out)
    recorded = load_target_head(out)
    assert torch.equal(recorded.lm_head, new["language_model.lm_head.weight"])
    assert _head_meta(path)["checkpoint_head_key"] == checkpoint_head_key(checkpoint_head(ckpt))  # the new key

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
    save_target_head_from_checkpoint(checkpoint_head(ckpt), out)
    assert torch.equal(load_target_head(out).norm_weight, newer["language_model.model.norm.weight"])

    # Another checkpoint directory with the same files (mtimes kept) has its own key; its head, equal tensor for
    # tensor, leaves the recorded file as it is (bytes whose sha256 earlier shards recorded).
    other = tmp_path / "copy"
    other.mkdir()
    for f in ckpt.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
        os.utime(other / f.name, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns))
    assert checkpoint_head_key(checkpoint_head(other)) != checkpoint_head_key(checkpoint_head(ckpt))
    kept = (path.stat().st_ino, file_sha256(path))
    save_target_head_from_checkpoint(checkpoint_head(other), out)
    assert (path.stat().st_ino, file_sha256(path)) == kept


def test_a_head_recorded_without_a_key_is_compared_with_the_checkpoint(tmp_path):
    """A head recorded by a version before keys (or by the in-process engine) has the checkpoint read and compared:
    equal, it is left as it is, key-less; different, it is replaced under the key."""
    tensors, files = _kimi_style_checkpoint(tmp_path / "kimi")
    found = checkpoint_head(tmp_path / "kimi")
    norm, head = found.load()
    path, sha = save_target_head(tmp_path / "hs", norm_weight=norm, eps=found.eps, lm_head=head, source={})
    assert verified_head_sha256(path, checkpoint_head_key(found)) is None
    with _Opens(*{tmp_path / "kimi" / f for f in files.values()}) as opens:
        assert save_target_head_from_checkpoint(found, tmp_path / "hs") == (path, sha)
        assert opens.opened() != []
    assert "checkpoint_head_key" not in _head_meta(path)

    save_target_head(tmp_path / "hs", norm_weight=norm + 1, eps=found.eps, lm_head=head, source={})
    _, replaced = save_target_head_from_checkpoint(found, tmp_path / "hs")
    assert replaced == verified_head_sha256(path, checkpoint_head_key(found)) != sha  # now under the key
    assert torch.equal(load_target_head(tmp_path / "hs").norm_weight, tensors["language_model.model.norm.weight"])


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
def test_a_damaged_recorded_head_is_named_and_rewritten(tmp_path, damage):
    tensors, _ = _kimi_style_checkpoint(tmp_path / "kimi")
    found = checkpoint_head(tmp_path / "kimi")
    path, _ = save_target_head_from_checkpoint(found, tmp_path / "a")
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        del data[len(data) // 2 :]
    else:
        data[-3] ^= 0x40  # inside the last tensor's data
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": damaged recorded target head"):
        verified_head_sha256(path, checkpoint_head_key(found))
    logged = []
    with pytest.warns(DamagedHeadWarning, match=re.escape(str(path))):
        _, rewritten = save_target_head_from_checkpoint(found, tmp_path / "a", log=logged.append)
    assert any(str(path) in line and line.startswith("warning:") for line in logged)
    recorded = load_target_head(tmp_path / "a")
    assert torch.equal(recorded.lm_head, tensors["language_model.lm_head.weight"])
    # Sound again, under the key (not byte for byte the first file: safetensors orders its metadata at random).
    assert verified_head_sha256(path, checkpoint_head_key(found)) == rewritten == file_sha256(path)


def test_a_head_rewritten_in_place_makes_the_shards_cut_with_the_old_one_stale(
    normed_model, tiny_ds, texts, merged_factory, tmp_path
):
    """Like any other setting change: the state says so, asking for the shard again is refused with what to redo,
    the export guard names it, its head checks fail saying to extract it again, and `redo` does."""
    checkpoint, out = tmp_path / "ckpt", tmp_path / "eng"
    normed_model.save_pretrained(checkpoint)
    merged = merged_factory(texts)
    n = len(texts) // 2
    first = _engine_shard(normed_model, checkpoint, merged, tmp_path, n)
    wanted = stored_fingerprint(out, 0)
    assert wanted is not None and shard_state(out, 0, wanted).status == "done"
    judge = dict(expected_aux_layers=AUX, judgement=JUDGE)
    assert all(r.passed for r in audit_shard_cached(out, 0, merged, **judge).values())

    # The checkpoint rewritten in place: same directory, same shapes, other weights. Nothing in the fingerprint
    # names them; the next shard records the new head beside the shards.
    tiny_ds.save_pretrained(checkpoint)
    second = _engine_shard(normed_model, checkpoint, merged, tmp_path, n, shard_index=1)
    old, new = (read_index_meta(s.index_path)["target_head_sha256"] for s in (first, second))
    assert old != new == file_sha256(out / TARGET_HEAD_FILE)

    state = shard_state(out, 0, wanted)
    assert state.status == "stale" and state.differences == {"target_head_sha256": (old, new)}
    assert shard_state(out, 1, wanted).status == "done"
    with pytest.raises(ShardMismatchError, match=r"target_head_sha256: .* was rewritten since.*on_settings_change"):
        _engine_shard(normed_model, checkpoint, merged, tmp_path, n)
    with pytest.raises(ShardsNotReadyError, match=r"other settings: 00000 \(target_head_sha256"):
        require_shards_ready(out, merged, wanted)
    # Its checks, which judged it with the old head (cached), now say it is stale and what to do.
    results = audit_shard_cached(out, 0, merged, **judge)
    for name in ("norm_convention", "teacher_agreement"):
        assert results[name].verdict == FAIL and "STALE" in results[name].detail, results[name]
        assert "on_settings_change: redo" in results[name].detail
    assert results["degenerate_states"].passed and results["layer_layout"].passed  # the states themselves are sound

    # redo: moved aside and extracted again; cut with the head recorded now, it is done.
    again = _engine_shard(normed_model, checkpoint, merged, tmp_path, n, on_mismatch="redo")
    assert read_index_meta(again.index_path)["target_head_sha256"] == new
    assert shard_state(out, 0, wanted).status == "done"
    assert [s.status for s in require_shards_ready(out, merged, wanted)] == ["done", "done"]
    assert not any("STALE" in r.detail for r in audit_shard_cached(out, 0, merged, **judge).values())
