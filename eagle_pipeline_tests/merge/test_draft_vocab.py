from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from eagle_pipeline.merge import (
    D2T_NPY,
    DRAFT_VOCAB_PT,
    MERGED_SCHEMA,
    SUMMARY_JSON,
    T2D_NPY,
    TOKEN_COUNTS_NPY,
    MergeInput,
    MergeSettings,
    build_draft_vocab,
    load_draft_vocab,
    merge_datasets,
    read_merged,
    select_draft_vocab,
)

VOCAB = 163840


def _naive(merged: Path, k: int, vocab: int, splits=("train",)):
    counter: Counter[int] = Counter()
    for row in read_merged(merged).to_pylist():
        if row["split"] in splits:
            counter.update(t for t, m in zip(row["input_ids"], row["loss_mask"]) if m == 1)
    ranked = sorted(range(vocab), key=lambda t: (-counter.get(t, 0), t))[:k]
    return counter, sorted(ranked)


@pytest.fixture
def merged(tmp_path, write_tokens) -> Path:
    pa_path, _ = write_tokens("A", 80, seed=21, vocab=3000)
    pb_path, _ = write_tokens("B", 60, seed=22, vocab=300)
    out = tmp_path / "m"
    merge_datasets(
        [MergeInput("A", pa_path), MergeInput("B", pb_path)], out, MergeSettings(rows_per_shard=50, eval_fraction=0.2)
    )
    return out


def test_draft_vocab_matches_naive_counter(merged, tmp_path):
    k = 200
    summary = build_draft_vocab(merged, VOCAB, tmp_path / "v", k=k)
    counter, expected_ids = _naive(merged, k, VOCAB)
    counts = np.load(tmp_path / "v" / TOKEN_COUNTS_NPY)
    assert counts.dtype == np.int64 and counts.shape == (VOCAB,)
    assert {int(i): int(c) for i, c in enumerate(counts) if c} == dict(counter)

    d2t, t2d = load_draft_vocab(tmp_path / "v")
    assert d2t.dtype == np.int64 and d2t.shape == (k,) and t2d.dtype == np.bool_ and t2d.shape == (VOCAB,)
    targets = np.arange(k) + d2t
    assert targets.tolist() == expected_ids  # draft ids sorted by target id
    assert t2d[targets].all() and int(t2d.sum()) == k

    total = sum(counter.values())
    assert summary.supervised_tokens == total
    assert summary.distinct_supervised_tokens == len(counter)
    assert summary.coverage == pytest.approx(sum(counter[t] for t in expected_ids) / total)
    assert summary.top_tokens[0] == [163586, counter[163586]]  # every output ends in eot
    on_disk = json.loads((tmp_path / "v" / SUMMARY_JSON).read_text())
    assert on_disk["k"] == k and on_disk["coverage"] == pytest.approx(summary.coverage)

    pt = torch.load(tmp_path / "v" / DRAFT_VOCAB_PT, weights_only=True)
    assert set(pt) == {"d2t", "t2d"}
    assert pt["d2t"].dtype == torch.int64 and pt["t2d"].dtype == torch.bool
    assert np.array_equal(pt["d2t"].numpy(), d2t) and np.array_equal(pt["t2d"].numpy(), t2d)
    assert np.array_equal(np.load(tmp_path / "v" / D2T_NPY), d2t)
    assert np.array_equal(np.load(tmp_path / "v" / T2D_NPY), t2d)


def test_eval_rows_are_not_counted_by_default(merged, tmp_path):
    only_train = build_draft_vocab(merged, VOCAB, tmp_path / "v1", k=50)
    both = build_draft_vocab(merged, VOCAB, tmp_path / "v2", k=50, splits=("train", "eval"))
    m = read_merged(merged)
    sup = lambda rows: sum(sum(r["loss_mask"]) for r in rows)  # noqa: E731
    rows = m.to_pylist()
    assert only_train.supervised_tokens == sup([r for r in rows if r["split"] == "train"])
    assert both.supervised_tokens == sup(rows) > only_train.supervised_tokens


def test_fewer_seen_ids_than_k_pads_with_lowest_unused(tmp_path):
    # Supervised tokens {5, 9, 9}; prompt token 2 must not count.
    t = pa.Table.from_pylist(
        [
            dict(
                sample_id="s1",
                dataset="A",
                input_ids=[2, 9, 9],
                loss_mask=[0, 1, 1],
                n_tokens=3,
                n_prompt_tokens=1,
                split="train",
            ),
            dict(
                sample_id="s2",
                dataset="A",
                input_ids=[2, 5],
                loss_mask=[0, 1],
                n_tokens=2,
                n_prompt_tokens=1,
                split="train",
            ),
        ],
        schema=MERGED_SCHEMA,
    )
    (tmp_path / "m").mkdir()
    pq.write_table(t, tmp_path / "m" / "part-00000.parquet")
    s = build_draft_vocab(tmp_path / "m", 20, tmp_path / "v", k=5)
    d2t, _ = load_draft_vocab(tmp_path / "v")
    # 9 and 5 by count, then the lowest unseen ids 0, 1, 2 (prompt-only token 2 has count 0 like any unseen id).
    assert (np.arange(5) + d2t).tolist() == [0, 1, 2, 5, 9]
    assert np.load(tmp_path / "v" / "token_counts.npy")[[2, 5, 9]].tolist() == [0, 1, 2]
    assert s.padded_unseen_ids == 3 and s.coverage == 1.0 and s.distinct_supervised_tokens == 2
    assert s.top_tokens == [[9, 2], [5, 1]]


def test_select_ties_break_to_lower_id_and_full_vocab_is_identity():
    counts = np.array([0, 3, 1, 3, 1, 0], dtype=np.int64)
    sel, d2t, t2d = select_draft_vocab(counts, 3)
    assert sel.tolist() == [1, 2, 3] and d2t.tolist() == [1, 1, 1]
    sel, d2t, t2d = select_draft_vocab(counts, 6)
    assert d2t.tolist() == [0] * 6 and t2d.all()


def test_invalid_sizes_and_ids_rejected(merged, tmp_path):
    with pytest.raises(ValueError, match="k=300"):
        build_draft_vocab(merged, 200, tmp_path / "v", k=300)
    with pytest.raises(ValueError, match="out of range"):
        build_draft_vocab(merged, 1000, tmp_path / "v", k=10)  # eot 163586 is not a valid id in a 1000 vocab
    assert not (tmp_path / "v" / DRAFT_VOCAB_PT).exists()
