"""The trainer-facing files, read with code written from the trainers' contracts (docs/merge.md, trainer_formats),
not with the project's writer, and compared tensor by tensor with the shards and with the model itself."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from eagle_pipeline.drafter_types import SPECFORGE, SPECULATORS
from eagle_pipeline.hidden_states.layouts.trainer_exports import StatesExport, train_data_ratio
from eagle_pipeline.hidden_states.layouts.trainer_layouts import (
    LAYOUTS,
    load_sample,
    trainer_layout,
    trainer_layout_names,
)
from eagle_pipeline.hidden_states.models.layers import get_backbone
from eagle_pipeline.hidden_states.run import extract_shard

from ..tolerances import assert_forwards_close
from .conftest import VOCAB, make_rows

H = 64


@pytest.fixture
def extracted(normed_model, merged_factory, tmp_path):
    rows = make_rows(14, seed=11)
    for i in (2, 5, 9):
        rows[i]["split"] = "eval"
    merged = merged_factory(rows, [6, 8])
    hs = tmp_path / "hs"
    for shard in range(2):
        extract_shard(normed_model, merged, shard_index=shard, shard_size=8, out_dir=hs, max_tokens_per_batch=96)
    vocab = tmp_path / "vocab"
    vocab.mkdir()
    np.save(vocab / "d2t.npy", np.arange(4, dtype=np.int64))
    np.save(vocab / "t2d.npy", np.arange(VOCAB) < 4)
    torch.save({"d2t": torch.arange(4), "t2d": torch.arange(VOCAB) < 4}, vocab / "draft_vocab.pt")
    return rows, merged, hs, vocab


def _post_norm_forward(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return get_backbone(model)(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state[0]


def test_specforge_offline_files_follow_its_contract(extracted, normed_model, tmp_path):
    rows, merged, hs, vocab = extracted
    out = tmp_path / "exports" / "specforge"
    (out / "train").mkdir(parents=True)
    torch.save({}, out / "train" / "stale.ckpt")
    s = LAYOUTS[SPECFORGE].export(StatesExport(hs, merged, out, draft_vocab_dir=vocab))
    assert s.rows == {"train": 11, "eval": 3} and s.final_state == "post_norm"
    # SpecForge's reader: every *.ckpt under the folder (recursively), torch.load(mmap=True), one sample per file.
    found = {}
    for split in ("train", "eval"):
        for root, _dirs, names in os.walk(out / split):
            for name in names:
                if name.endswith((".ckpt", ".ckpt.gz")):
                    found[name[: -len(".ckpt")]] = (split, torch.load(os.path.join(root, name), mmap=True))
    assert set(found) == {r["sample_id"] for r in rows}
    for r in rows:
        split, rec = found[r["sample_id"]]
        t = r["n_tokens"]
        assert split == r["split"]
        assert set(rec) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
        assert rec["input_ids"].dtype == torch.int64 and rec["input_ids"].tolist() == r["input_ids"]
        assert rec["loss_mask"].dtype == torch.int64 and rec["loss_mask"].tolist() == r["loss_mask"]
        assert rec["aux_hidden_state"].shape == (1, t, 3 * H) and rec["hidden_state"].shape == (1, t, H)
        shard = load_sample(hs, r["sample_id"])
        assert torch.equal(rec["aux_hidden_state"][0], shard["aux_hidden_states"])
        # Post-norm: the model's own final norm of the stored pre-norm state, and the backbone's output.
        with torch.no_grad():
            assert torch.equal(rec["hidden_state"][0], get_backbone(normed_model).norm(shard["final_hidden_state"]))
        assert_forwards_close(
            rec["hidden_state"][0],
            _post_norm_forward(normed_model, r["input_ids"]),
            normed_model.config,
            what=r["sample_id"],
        )
    assert torch.load(out / "draft_vocab.pt")["d2t"].tolist() == [0, 1, 2, 3]


def test_speculators_offline_files_follow_its_contract(extracted, normed_model, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows, merged, hs, vocab = extracted
    out = tmp_path / "exports" / "speculators"
    (out / "hidden_states").mkdir(parents=True)
    (out / "hidden_states" / "hs_99.safetensors").write_bytes(b"stale")
    s = LAYOUTS[SPECULATORS].export(StatesExport(hs, merged, out, draft_vocab_dir=vocab))
    # speculators' ArrowDataset: load_from_disk(data_path), torch format, seq_len, then split by the ratio.
    data = datasets.load_from_disk(str(out))
    assert data.format["type"] == "torch"
    assert {"input_ids", "loss_mask", "seq_len", "sample_id"} <= set(data.column_names)
    train = [r for r in rows if r["split"] == "train"]
    evals = [r for r in rows if r["split"] == "eval"]
    assert list(data.with_format(None)["sample_id"]) == [r["sample_id"] for r in train + evals]
    ratio = s.extra["train_data_ratio"]
    assert 0 < ratio < 1 and int(len(data) * ratio) == len(train)
    assert sorted(p.name for p in (out / "hidden_states").iterdir()) == sorted(
        f"hs_{i}.safetensors" for i in range(len(rows))
    )
    for i, r in enumerate(train + evals):
        item = data[i]
        loaded = load_file(out / "hidden_states" / f"hs_{i}.safetensors")
        assert set(loaded) == {"hidden_states", "token_ids"}
        assert torch.equal(loaded["token_ids"], item["input_ids"])  # speculators drops the row otherwise
        assert item["seq_len"].item() == r["n_tokens"] and item["loss_mask"].tolist() == r["loss_mask"]
        states = loaded["hidden_states"]
        assert states.shape == (r["n_tokens"], 4, H)
        shard = load_sample(hs, r["sample_id"])
        assert torch.equal(states[:, :-1].flatten(1), shard["aux_hidden_states"])
        assert torch.equal(states[:, -1], shard["final_hidden_state"])
        # Pre-norm: speculators applies the verifier norm itself; that must give the model's post-norm state.
        with torch.no_grad():
            renormed = get_backbone(normed_model).norm(states[:, -1])
        assert_forwards_close(
            renormed, _post_norm_forward(normed_model, r["input_ids"]), normed_model.config, what=r["sample_id"]
        )
    assert np.array_equal(np.load(out / "d2t.npy"), np.arange(4)) and np.load(out / "t2d.npy").sum() == 4
    assert f"--train-data-ratio {ratio!r}" in (out / "README.md").read_text()


def test_speculators_refuses_post_norm_shards(normed_model, merged_factory, tmp_path):
    merged = merged_factory(make_rows(4, seed=12))
    hs = tmp_path / "hs"
    extract_shard(normed_model, merged, shard_index=0, shard_size=4, out_dir=hs, final_state="post_norm")
    with pytest.raises(ValueError, match="shard 0 stores the final state post-norm"):
        LAYOUTS[SPECULATORS].export(StatesExport(hs, merged, tmp_path / "spec"))


def test_export_refuses_missing_shards(extracted, tmp_path):
    _rows, merged, hs, _ = extracted
    for p in hs.glob("shard-00001.*"):
        p.unlink()
    with pytest.raises(ValueError, match="6 merged rows have no hidden states"):
        LAYOUTS[SPECFORGE].export(StatesExport(hs, merged, tmp_path / "sf"))


@pytest.mark.parametrize("layout", ["speculators", "specforge"])
def test_extraction_writes_a_trainer_layout_directly(layout, normed_model, merged_factory, tmp_path):
    """hidden_states.layout = a trainer's: the states exist once, in the trainer's files; the shard keeps ids and
    masks; every project check reads them; the export writes no state byte again."""
    from eagle_pipeline.hidden_states.checks.audit import TeacherJudgement, audit_shard
    from eagle_pipeline.hidden_states.checks.verify import verify_shard
    from eagle_pipeline.hidden_states.layouts.trainer_layouts import plan_layout_target
    from eagle_pipeline.hidden_states.store.format import shard_status

    from .conftest import greedy_rows

    rows = greedy_rows(normed_model, 8, seed=21)
    merged = merged_factory(rows)
    final_state = "pre_norm" if layout == "speculators" else "post_norm"
    ref = tmp_path / "ref"
    for shard in range(2):
        extract_shard(normed_model, merged, shard_index=shard, shard_size=4, out_dir=ref, final_state=final_state)
    hs, out = tmp_path / "hs", tmp_path / "exports" / layout
    target = plan_layout_target(layout, out, merged)
    for shard in range(2):
        extract_shard(
            normed_model,
            merged,
            shard_index=shard,
            shard_size=4,
            out_dir=hs,
            final_state=final_state,
            layout_target=target,
        )
    shard_bytes = sum(p.stat().st_size for p in hs.glob("shard-*.safetensors"))
    states_bytes = sum(4 * r["n_tokens"] * H * 4 for r in rows)  # 3 aux + final, fp32
    assert shard_bytes < states_bytes / 20  # ids and masks only: the states are not in the shard
    for shard in range(2):
        assert shard_status(hs, shard) == "done"
        assert all(r.passed for r in verify_shard(hs, shard, merged).values())
        audit = audit_shard(hs, shard, merged, expected_aux_layers=None, judgement=TeacherJudgement(True))
        assert all(r.passed for r in audit.values()), {n: r.detail for n, r in audit.items()}
        assert audit["teacher_agreement"].metrics["top1_agreement"] == 1.0
    for r in rows:  # the same numbers as a shard-layout extraction
        got, want = load_sample(hs, r["sample_id"]), load_sample(ref, r["sample_id"])
        assert all(torch.equal(got[n], want[n]) for n in want)
    if layout == "speculators":
        s = LAYOUTS[SPECULATORS].export(StatesExport(hs, merged, out))
        assert s.bytes_written == 0 and s.extra["samples_written_by_extraction"] == len(rows)
        order = [r for r in rows if r["split"] == "train"] + [r for r in rows if r["split"] == "eval"]
        for i, r in enumerate(order):
            states = load_file(out / "hidden_states" / f"hs_{i}.safetensors")["hidden_states"]
            assert torch.equal(states[:, -1], load_sample(ref, r["sample_id"])["final_hidden_state"])
        # the other trainer: a copy
        derived = LAYOUTS[SPECFORGE].export(StatesExport(hs, merged, tmp_path / "exports" / "specforge"))
        assert derived.bytes_written > 0
    else:
        s = LAYOUTS[SPECFORGE].export(StatesExport(hs, merged, out))
        assert s.bytes_written == 0 and s.extra["samples_written_by_extraction"] == len(rows)
        rec = torch.load(out / rows[0]["split"] / f"{rows[0]['sample_id']}.ckpt", mmap=True)
        assert torch.equal(rec["hidden_state"][0], load_sample(ref, rows[0]["sample_id"])["final_hidden_state"])
        with pytest.raises(ValueError, match="post-norm"):
            LAYOUTS[SPECULATORS].export(StatesExport(hs, merged, tmp_path / "exports" / "speculators"))
    # A damaged trainer file makes its shard partial; extraction then redoes it.
    victim = next(out.rglob("*.ckpt" if layout == "specforge" else "hs_*.safetensors"))
    victim.write_bytes(b"damaged")
    assert "partial" in {shard_status(hs, 0), shard_status(hs, 1)}
    for shard in range(2):
        extract_shard(
            normed_model,
            merged,
            shard_index=shard,
            shard_size=4,
            out_dir=hs,
            final_state=final_state,
            layout_target=target,
        )
        assert shard_status(hs, shard) == "done"
    assert victim.stat().st_size > 100


def test_trainer_layout_refuses_the_wrong_convention(normed_model, merged_factory, tmp_path):
    from eagle_pipeline.hidden_states.layouts.trainer_layouts import plan_layout_target

    merged = merged_factory(make_rows(3, seed=2))
    target = plan_layout_target("speculators", tmp_path / "out", merged)
    with pytest.raises(ValueError, match="speculators layout holds the final state pre_norm"):
        extract_shard(
            normed_model,
            merged,
            shard_index=0,
            shard_size=3,
            out_dir=tmp_path / "hs",
            final_state="post_norm",
            layout_target=target,
        )


def test_a_trainer_file_entry_is_verified_by_its_recorded_digest(tmp_path):
    """Entries carry XXH3-128. A same-size change fails it; a size check alone (`check_hash=False`) passes it."""
    from eagle_pipeline.hidden_states.store.format import sample_file_digest, sample_file_entry, sample_file_intact

    data = bytes(range(256)) * 64
    (tmp_path / "hs_0.safetensors").write_bytes(data)
    new = sample_file_entry("s0", "hs_0.safetensors", len(data), sample_file_digest(data))
    assert set(new) == {"sample_id", "path", "size", "xxh3_128"}
    assert sample_file_intact(tmp_path, new)
    changed = bytearray(data)
    changed[4000] ^= 0x01
    (tmp_path / "hs_0.safetensors").write_bytes(bytes(changed))
    assert not sample_file_intact(tmp_path, new)
    assert sample_file_intact(tmp_path, new, check_hash=False)
    (tmp_path / "hs_0.safetensors").unlink()
    assert not sample_file_intact(tmp_path, new, check_hash=False)


def test_a_killed_run_s_temporaries_go_for_its_own_samples_only(tmp_path):
    """`remove_stale_tmp`: a half-written copy of this shard's sample is deleted; another shard's (maybe being
    written right now by its own run) and the finished files stay."""
    from eagle_pipeline.hidden_states.layouts.trainer_layouts import LayoutTarget, remove_stale_tmp

    files = {"a": "hidden_states/hs_1.safetensors", "b": "hidden_states/hs_10.safetensors"}
    target = LayoutTarget("speculators", tmp_path, files)
    folder = tmp_path / "hidden_states"
    folder.mkdir()
    mine = folder / ".hs_1.safetensors.0a1b2c3d4e5f.tmp"
    others = [folder / ".hs_10.safetensors.0a1b2c3d4e5f.tmp", folder / "hs_1.safetensors", folder / ".hs_1.x"]
    for p in [mine, *others]:
        p.write_bytes(b"x")
    assert remove_stale_tmp(target, ["a"]) == 1
    assert not mine.exists() and all(p.exists() for p in others)
    assert remove_stale_tmp(target, ["missing-sample"]) == 0


def test_the_train_data_ratio_is_short_and_splits_exactly_at_every_size():
    # Printed in the speculators command: as many decimals as the row count has digits, never a split off by one.
    assert train_data_ratio(185, 7) == 0.966 and train_data_ratio(3, 0) is None
    for n in range(2, 1200):
        for n_train in range(1, n):
            r = train_data_ratio(n_train, n - n_train)
            assert int(n * r) == n_train and len(repr(r)) <= len(str(n)) + 2, (n_train, n, r)


def test_a_layout_is_one_object_found_by_name():
    """Adding a layout is adding an object: the registry's names are exactly the values the configuration takes for
    `hidden_states.layout` (the trainer layouts exactly those of `trainer_layouts`), and the configuration's load-time
    FP8 rule agrees with the quantize modes each object declares."""
    import typing

    from eagle_pipeline.hidden_states.layouts.trainer_layouts import TrainerLayout, layout_of
    from eagle_pipeline.hidden_states.settings import HiddenStatesConfig
    from eagle_pipeline.hidden_states.store.fp8 import QUANTIZE_FP8

    hints = typing.get_type_hints(HiddenStatesConfig)
    assert tuple(LAYOUTS) == typing.get_args(hints["layout"])
    assert trainer_layout_names() == typing.get_args(typing.get_args(hints["trainer_layouts"])[0])
    for name, layout in LAYOUTS.items():
        assert layout.name == name and layout_of(name) is layout
        assert layout.states_in_shards == (not isinstance(layout, TrainerLayout))
        fp8_refused = any(
            where == ("quantize",) and "layout" in why
            for where, why in HiddenStatesConfig.rule_problems({"quantize": QUANTIZE_FP8, "layout": name})
        )
        assert fp8_refused == (QUANTIZE_FP8 not in layout.quantize_modes), name
    with pytest.raises(ValueError, match="unknown hidden-states layout"):
        layout_of("parquet")


@pytest.mark.parametrize("name", trainer_layout_names())
def test_every_trainer_layout_reads_back_what_it_writes(name, tmp_path):
    """Each trainer layout in the registry, its own writer and reader: a sample serialised into the file its naming
    gives, then deserialised, is the same aux and final state, bit for bit; the file names are distinct per sample."""
    assert {SPECFORGE, SPECULATORS} <= set(trainer_layout_names())  # the parametrisation is not empty
    layout = trainer_layout(name)
    n_aux, hidden, n_tok = 3, 8, 5
    g = torch.Generator().manual_seed(3)
    t = {
        "aux_hidden_states": torch.randn(n_tok, n_aux * hidden, generator=g),
        "final_hidden_state": torch.randn(n_tok, hidden, generator=g),
        "input_ids": torch.arange(n_tok, dtype=torch.int32),
        "loss_mask": torch.ones(n_tok, dtype=torch.int8),
    }
    files = layout.file_names({"a": "train", "b": "eval", "c": "train"})
    assert len(set(files.values())) == 3
    path = tmp_path / files["b"]
    path.parent.mkdir(parents=True)
    path.write_bytes(layout.serialise(t, n_aux, hidden))
    back = layout.deserialise(path, n_aux)
    assert torch.equal(back["aux_hidden_states"], t["aux_hidden_states"])
    assert torch.equal(back["final_hidden_state"], t["final_hidden_state"])
    assert list(tmp_path.glob(layout.file_glob)) == [path]  # the glob the export prunes stale files with
