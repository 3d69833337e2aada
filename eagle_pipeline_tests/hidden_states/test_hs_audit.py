"""The semantic audit: clean shards of a tiny target on its own greedy text pass every check; each failure the
field has shipped (zeroed, dropped or repeated layers, wrong ids, short states, a norm applied wrongly, shifted or
foreign states) is injected through the engine (hooks on the model it extracts from) and blocks."""

from __future__ import annotations

import contextlib

import pyarrow.parquet as pq
import pytest
import torch

from eagle_pipeline.hidden_states.checks.audit import (
    DEFAULT_MIN_TOP1,
    NOT_JUDGED,
    TeacherJudgement,
    audit_shard,
    teacher_judgement,
)
from eagle_pipeline.hidden_states.models.layers import get_backbone
from eagle_pipeline.hidden_states.models.model import build_tiny_model
from eagle_pipeline.hidden_states.run import extract_shard

from .conftest import VOCAB, greedy_rows, make_rows, rows_table, with_norm_weights

JUDGE = TeacherJudgement(True)


@pytest.fixture(scope="module")
def texts(normed_model):
    return greedy_rows(normed_model, 10, seed=5)


@contextlib.contextmanager
def hooked(module, fn):
    handle = module.register_forward_hook(lambda _m, args, out: fn(args, out))
    try:
        yield
    finally:
        handle.remove()


def _audit(model, texts, merged_factory, tmp_path, *, aux_layers=None, expected=(1, 3, 4), **extract_kw):
    merged = merged_factory(texts)
    hs = tmp_path / "hs"
    extract_shard(model, merged, shard_index=0, shard_size=len(texts), out_dir=hs, aux_layers=aux_layers, **extract_kw)
    return audit_shard(hs, 0, merged, expected_aux_layers=expected, judgement=JUDGE)


def _failed(results) -> set[str]:
    return {name for name, r in results.items() if not r.passed}


@pytest.mark.parametrize("final_state", ["pre_norm", "post_norm"])
def test_clean_shards_pass_every_check(normed_model, texts, merged_factory, tmp_path, final_state):
    results = _audit(normed_model, texts, merged_factory, tmp_path, final_state=final_state)
    assert _failed(results) == set(), {n: r.detail for n, r in results.items()}
    teacher = results["teacher_agreement"]
    assert teacher.verdict == "pass" and teacher.metrics["top1_agreement"] == 1.0
    assert set(teacher.metrics["per_dataset"]) == {"G1", "G2"}
    assert results["norm_convention"].metrics["recorded_convention"] == final_state


def test_clean_llama_shard_passes(merged_factory, tmp_path):
    model = with_norm_weights(build_tiny_model(VOCAB, family="llama", seed=4))
    results = _audit(model, greedy_rows(model, 6, seed=9), merged_factory, tmp_path)
    assert _failed(results) == set(), {n: r.detail for n, r in results.items()}


def test_zeroed_final_state_blocks(normed_model, texts, merged_factory, tmp_path):
    with hooked(get_backbone(normed_model).layers[-1], lambda _a, out: torch.zeros_like(out)):
        results = _audit(normed_model, texts, merged_factory, tmp_path)
    assert {"degenerate_states", "teacher_agreement"} <= _failed(results)
    assert "final:" in results["degenerate_states"].detail and "all zero" in results["degenerate_states"].detail
    assert results["degenerate_states"].metrics["failing_samples_per_layer"] == {"final": len(texts)}
    assert results["teacher_agreement"].metrics["top1_agreement"] < 0.05


def test_zeroed_rows_of_an_aux_layer_block(normed_model, texts, merged_factory, tmp_path):
    def zero_first_positions(_a, out):
        out = out.clone()
        out[:, :2] = 0
        return out

    with hooked(get_backbone(normed_model).layers[1], zero_first_positions):
        results = _audit(normed_model, texts, merged_factory, tmp_path)
    deg = results["degenerate_states"]
    assert not deg.passed and deg.failing == len(texts) and "aux0: 2/" in deg.detail


def test_constant_layer_blocks(normed_model, texts, merged_factory, tmp_path):
    with hooked(get_backbone(normed_model).layers[3], lambda _a, out: torch.full_like(out, 0.25)):
        results = _audit(normed_model, texts, merged_factory, tmp_path)
    assert not results["degenerate_states"].passed and "aux1:" in results["degenerate_states"].detail


def test_dropped_layer_and_wrong_order_block(normed_model, texts, merged_factory, tmp_path):
    dropped = _audit(normed_model, texts, merged_factory, tmp_path / "a", aux_layers=(1, 3))  # N-1 layers came back
    assert "layer_layout" in _failed(dropped) and "count or order" in dropped["layer_layout"].detail
    assert "aux width 128 != 3 layers x 64" in dropped["layer_layout"].detail
    reordered = _audit(normed_model, texts, merged_factory, tmp_path / "b", aux_layers=(3, 1, 4))
    assert _failed(reordered) == {"layer_layout"}


def test_identical_aux_layers_block(normed_model, texts, merged_factory, tmp_path):
    # Layers 2 and 3 pass their input through: the output of layer 3 is the output of layer 1 (a repeated id).
    backbone = get_backbone(normed_model)
    with hooked(backbone.layers[2], lambda a, _o: a[0]), hooked(backbone.layers[3], lambda a, _o: a[0]):
        results = _audit(normed_model, texts, merged_factory, tmp_path)
    assert "layer_layout" in _failed(results)
    assert "aux0 and aux1 are identical (a wrong layer id)" in results["layer_layout"].detail


def test_states_short_of_the_merged_row_block(normed_model, texts, merged_factory, tmp_path):
    """Prefix caching left the states k tokens short: the merged row is longer than the stored T."""
    merged = merged_factory(texts)
    hs = tmp_path / "hs"
    extract_shard(normed_model, merged, shard_index=0, shard_size=len(texts), out_dir=hs)
    longer = [dict(r) for r in texts]
    longer[3] = {
        **longer[3],
        "input_ids": longer[3]["input_ids"] + [7, 7],
        "loss_mask": longer[3]["loss_mask"] + [1, 1],
    }
    longer[3]["n_tokens"] += 2
    pq.write_table(rows_table(longer), merged / "part-00000.parquet")
    results = audit_shard(hs, 0, merged, expected_aux_layers=(1, 3, 4), judgement=JUDGE)
    lay = results["layer_layout"]
    assert not lay.passed and lay.failing_sample_ids == [texts[3]["sample_id"]]
    assert f"T={texts[3]['n_tokens']} but the merged row has {texts[3]['n_tokens'] + 2} tokens" in lay.detail


def test_normalised_state_recorded_as_pre_norm_blocks(normed_model, texts, merged_factory, tmp_path):
    """An engine that hands out the post-norm state as 'pre-norm': a trainer would normalise it twice."""
    backbone = get_backbone(normed_model)
    with hooked(backbone.layers[-1], lambda _a, out: backbone.norm(out)):
        results = _audit(normed_model, texts, merged_factory, tmp_path, final_state="pre_norm")
    norm = results["norm_convention"]
    assert not norm.passed and "applied twice" in norm.detail
    assert norm.metrics["share_of_positions_with_unit_rms_after_dividing_by_norm_weight"] > 0.99


def test_unnormalised_state_recorded_as_post_norm_blocks(normed_model, texts, merged_factory, tmp_path):
    """The pre-norm state fed on as post-norm (Model-Optimizer #1846): the lm_head would see an unnormalised state."""
    with hooked(get_backbone(normed_model).norm, lambda a, _o: a[0]):
        results = _audit(normed_model, texts, merged_factory, tmp_path, final_state="post_norm")
    assert "norm_convention" in _failed(results) and "not normalised" in results["norm_convention"].detail


def test_shifted_states_fall_to_chance(normed_model, texts, merged_factory, tmp_path):
    with hooked(get_backbone(normed_model).layers[-1], lambda _a, out: out.roll(1, dims=1)):
        results = _audit(normed_model, texts, merged_factory, tmp_path)
    teacher = results["teacher_agreement"]
    assert not teacher.passed and teacher.metrics["top1_agreement"] < 0.1
    assert teacher.failing == len(texts) and "not this target's states" in teacher.detail


def test_wrong_layer_as_final_falls_to_chance(normed_model, texts, merged_factory, tmp_path):
    backbone = get_backbone(normed_model)
    early: dict[str, torch.Tensor] = {}
    with (
        hooked(backbone.layers[1], lambda _a, out: early.__setitem__("x", out)),
        hooked(backbone.layers[-1], lambda _a, _out: early["x"]),
    ):
        results = _audit(normed_model, texts, merged_factory, tmp_path)
    assert not results["teacher_agreement"].passed and results["teacher_agreement"].metrics["top1_agreement"] < 0.1


def test_states_of_another_model_fall_to_chance(normed_model, texts, merged_factory, tmp_path):
    other = with_norm_weights(build_tiny_model(VOCAB, family="deepseek_v3", seed=8))
    results = _audit(other, texts, merged_factory, tmp_path)
    assert _failed(results) == {"teacher_agreement"}
    assert results["teacher_agreement"].metrics["top1_agreement"] < 0.1


def test_not_judged_is_said_plainly_and_neither_passes_nor_blocks_silently(normed_model, merged_factory, tmp_path):
    rows = make_rows(6, seed=4)  # random texts, as from the simulated server
    merged = merged_factory(rows)
    hs = tmp_path / "hs"
    extract_shard(normed_model, merged, shard_index=0, shard_size=6, out_dir=hs)
    judgement = teacher_judgement(extraction_model="tiny-random", sources=["simulated"], texts_by_extraction_model=None)
    teacher = audit_shard(hs, 0, merged, expected_aux_layers=None, judgement=judgement)["teacher_agreement"]
    assert teacher.verdict == NOT_JUDGED and teacher.detail.startswith("NOT JUDGED: the extraction model is a tiny")
    assert teacher.metrics["top1_agreement"] < DEFAULT_MIN_TOP1  # measured and shown, but not held against it
    judged = audit_shard(hs, 0, merged, expected_aux_layers=None, judgement=JUDGE)["teacher_agreement"]
    assert not judged.passed  # the same shard, judged, blocks: the verdict is what spared it


def test_teacher_judgement_from_provenance():
    assert not teacher_judgement(extraction_model="/m", sources=["simulated"], texts_by_extraction_model=None).judge
    assert teacher_judgement(extraction_model="/m", sources=["vllm", None], texts_by_extraction_model=None).judge
    off = teacher_judgement(extraction_model="/m", sources=["vllm"], texts_by_extraction_model=False)
    assert not off.judge and "texts_by_extraction_model" in off.reason
    assert teacher_judgement(extraction_model="tiny-random", sources=[], texts_by_extraction_model=True).judge


def test_cached_audit_and_per_dataset_summary(normed_model, texts, merged_factory, tmp_path):
    from eagle_pipeline.hidden_states.checks.stored_audits import audit_path, audit_shard_cached, summarize_audits

    merged = merged_factory(texts)
    hs = tmp_path / "hs"
    for shard in range(2):
        extract_shard(normed_model, merged, shard_index=shard, shard_size=5, out_dir=hs)
    first = audit_shard_cached(hs, 0, merged, expected_aux_layers=None, judgement=JUDGE)
    path = audit_path(hs, 0)
    stamp = path.stat().st_mtime_ns
    again = audit_shard_cached(hs, 0, merged, expected_aux_layers=None, judgement=JUDGE)
    assert again == first and path.stat().st_mtime_ns == stamp  # reused, not recomputed
    strict = audit_shard_cached(hs, 0, merged, expected_aux_layers=None, judgement=JUDGE, min_top1=1.01)
    assert not strict["teacher_agreement"].passed and path.stat().st_mtime_ns != stamp  # new settings, new audit
    audit_shard_cached(hs, 0, merged, expected_aux_layers=None, judgement=JUDGE)
    audit_shard_cached(hs, 1, merged, expected_aux_layers=None, judgement=JUDGE)
    summary = summarize_audits(hs, [0, 1])
    assert summary["per_dataset_top1_agreement"] == {"G1": 1.0, "G2": 1.0}
    assert sum(summary["per_dataset_positions"].values()) == sum(sum(r["loss_mask"][1:]) for r in texts)
    assert set(summary["shards"]) == {"shard-00000", "shard-00001"} and summary["failing_shards_per_check"] == {}
    assert summary["unaudited_shards"] == []


def test_the_audit_summary_reads_only_the_audits_of_the_current_shards(normed_model, texts, merged_factory, tmp_path):
    """Issue 32, defect 7: audits stay in `audit/` after their shard is superseded or falls beyond a smaller merged
    table; the export manifest's summary must not carry them."""
    from eagle_pipeline.hidden_states.checks.stored_audits import audit_path, audit_shard_cached, summarize_audits

    merged = merged_factory(texts)
    hs = tmp_path / "hs"
    for shard in range(2):
        extract_shard(normed_model, merged, shard_index=shard, shard_size=5, out_dir=hs)
        audit_shard_cached(hs, shard, merged, expected_aux_layers=None, judgement=JUDGE, min_top1=1.01)  # fails
    # The table shrinks to one shard, extracted again (other rows): shard 1's audit and shard 0's old audit remain.
    smaller = merged_factory(texts[:3])
    extract_shard(normed_model, smaller, shard_index=0, shard_size=5, out_dir=hs, on_mismatch="redo")
    assert audit_path(hs, 1).exists() and audit_path(hs, 0).exists()
    summary = summarize_audits(hs, [0])
    assert summary["shards"] == {} and summary["failing_shards_per_check"] == {}
    assert summary["unaudited_shards"] == ["shard-00000"] and summary["per_dataset_positions"] == {}
    audit_shard_cached(hs, 0, smaller, expected_aux_layers=None, judgement=JUDGE)
    summary = summarize_audits(hs, [0])
    assert set(summary["shards"]) == {"shard-00000"} and summary["failing_shards_per_check"] == {}
    assert summary["unaudited_shards"] == []


@pytest.mark.parametrize("final_state", ["pre_norm", "post_norm"])
def test_bf16_shards_pass_and_the_recorded_norm_is_bit_exact(merged_factory, tmp_path, final_state):
    """GPU runs store bf16: rounding must not trip the norm-convention tolerance, and the recorded head's final norm
    must reproduce the model's own bf16 norm exactly (what the SpecForge export relies on)."""
    from eagle_pipeline.hidden_states.layouts.trainer_layouts import load_sample
    from eagle_pipeline.hidden_states.store.head import load_target_head

    model = with_norm_weights(build_tiny_model(VOCAB, family="deepseek_v3", seed=7, dtype=torch.bfloat16))
    rows = greedy_rows(model, 4, seed=6, new_tokens=12)
    results = _audit(model, rows, merged_factory, tmp_path, final_state=final_state, dtype=torch.bfloat16)
    assert _failed(results) == set(), {n: r.detail for n, r in results.items()}
    if final_state == "pre_norm":
        pre = load_sample(tmp_path / "hs", rows[0]["sample_id"])["final_hidden_state"]
        assert pre.dtype == torch.bfloat16
        with torch.no_grad():
            assert torch.equal(load_target_head(tmp_path / "hs").final_norm(pre), get_backbone(model).norm(pre))


def test_audit_markdown_keeps_the_row_of_a_shard_without_an_rms_median():
    from eagle_pipeline.hidden_states.checks.audit import AUDIT_CHECKS
    from eagle_pipeline.hidden_states.checks.stored_audits import audit_markdown

    verdicts = dict.fromkeys(AUDIT_CHECKS, "pass")
    summary = {
        "per_dataset_top1_agreement": {"G1": 1.0},
        "per_dataset_positions": {"G1": 7},
        "shards": {
            "shard-00000": {"verdicts": verdicts, "top1_agreement": 1.0, "rms_over_norm_weight_median": None},
            "shard-00001": {"verdicts": verdicts, "top1_agreement": 0.9, "rms_over_norm_weight_median": 1.25},
        },
    }
    table = audit_markdown(summary).split("\n\n")[1].splitlines()
    # header, separator, then one row per shard: a shard without the median keeps its row, and the table goes on
    assert len(table) == 4
    assert table[2].startswith("| shard-00000 |") and table[2].endswith("| 1.0 | - |")
    assert table[3].startswith("| shard-00001 |") and table[3].endswith("| 0.9 | 1.25 |")
