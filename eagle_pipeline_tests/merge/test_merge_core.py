from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle_pipeline.merge import (
    MANIFEST_NAME,
    MERGED_SCHEMA,
    MergeInput,
    MergeManifest,
    MergeSettings,
    iter_merged_shards,
    merge_datasets,
    read_merged,
)
from eagle_pipeline.shared.storage import file_sha256
from eagle_pipeline_tests.merge.conftest import token_table


def _shard_hashes(d: Path) -> dict[str, str]:
    return {p.name: file_sha256(p) for p in sorted(d.glob("part-*.parquet"))}


def test_input_ids_and_loss_mask_match_naive_reference(tmp_path, write_tokens):
    # Multiple row groups (chunked reads), int64 ids in one input, empty prompts: all must come out right.
    pa_path, a = write_tokens("A", 60, seed=1, row_group_size=7)
    pb_path, b = write_tokens("B", 45, seed=2, id_type=pa.int64())
    merge_datasets(
        [MergeInput("A", pa_path), MergeInput("B", pb_path)], tmp_path / "m", MergeSettings(rows_per_shard=16)
    )
    merged = read_merged(tmp_path / "m")
    assert merged.schema == MERGED_SCHEMA
    assert merged.num_rows == 105
    expected = {r["sample_id"]: r for r in a.to_pylist() + b.to_pylist()}
    for row in merged.to_pylist():
        src = expected[row["sample_id"]]
        assert row["input_ids"] == src["prompt_ids"] + src["output_ids"]
        assert row["loss_mask"] == [0] * len(src["prompt_ids"]) + [1] * len(src["output_ids"])
        assert row["n_tokens"] == len(row["input_ids"])
        assert row["n_prompt_tokens"] == len(src["prompt_ids"])
        for col in ("dataset", "source", "backend", "provider", "ids_origin", "literal_special", "prompt_key"):
            assert row[col] == src[col], col
        assert row["split"] == "train"


def test_same_inputs_and_seed_give_identical_bytes_and_seed_changes_order(tmp_path, write_tokens):
    inputs = [MergeInput("A", write_tokens("A", 50, seed=3)[0]), MergeInput("B", write_tokens("B", 50, seed=4)[0])]
    s = MergeSettings(seed=7, rows_per_shard=30, eval_fraction=0.2)
    merge_datasets(inputs, tmp_path / "m1", s)
    merge_datasets(inputs, tmp_path / "m2", s)
    h1, h2 = _shard_hashes(tmp_path / "m1"), _shard_hashes(tmp_path / "m2")
    assert len(h1) == 4 and h1 == h2
    assert (tmp_path / "m1" / MANIFEST_NAME).read_bytes() == (tmp_path / "m2" / MANIFEST_NAME).read_bytes()

    merge_datasets(inputs, tmp_path / "m3", MergeSettings(seed=8, rows_per_shard=30, eval_fraction=0.2))
    ids7 = read_merged(tmp_path / "m1", ["sample_id"])["sample_id"].to_pylist()
    ids8 = read_merged(tmp_path / "m3", ["sample_id"])["sample_id"].to_pylist()
    assert sorted(ids7) == sorted(ids8) and ids7 != ids8
    # Datasets are interleaved by the shuffle, not laid end to end.
    first_half = read_merged(tmp_path / "m1", ["dataset"])["dataset"].to_pylist()[:50]
    assert set(first_half) == {"A", "B"}


def test_input_row_order_does_not_change_output(tmp_path, write_tokens):
    path, table = write_tokens("A", 40, seed=5)
    shuffled = table.take(pa.array(np.random.default_rng(0).permutation(40)))
    path2 = tmp_path / "shuffled.parquet"
    pq.write_table(shuffled, path2)
    merge_datasets([MergeInput("A", path)], tmp_path / "m1", MergeSettings(eval_fraction=0.3))
    merge_datasets([MergeInput("A", path2)], tmp_path / "m2", MergeSettings(eval_fraction=0.3))
    assert _shard_hashes(tmp_path / "m1") == _shard_hashes(tmp_path / "m2")


def _permuted_copies(tmp_path, table: pa.Table, n: int) -> list[Path]:
    paths = []
    for k in range(n):
        path = tmp_path / f"perm{k}.parquet"
        pq.write_table(table.take(pa.array(np.random.default_rng(k).permutation(table.num_rows))), path)
        paths.append(path)
    return paths


def test_exact_copies_of_one_row_merge_byte_identically_in_any_row_order(tmp_path):
    base = token_table("A", 12, seed=11)
    table = base.take(pa.array([*range(12), 2]))  # row 2 twice, identical
    hashes = []
    for k, path in enumerate(_permuted_copies(tmp_path, table, 4)):
        m = merge_datasets([MergeInput("A", path)], tmp_path / f"m{k}", MergeSettings(eval_fraction=0.3))
        assert m.rows_total == 12 and m.excluded["A"]["duplicate_sample_id"] == 1
        hashes.append(_shard_hashes(tmp_path / f"m{k}"))
    assert all(h == hashes[0] for h in hashes)


def test_two_different_rows_for_one_sample_id_in_a_dataset_are_rejected_naming_both(tmp_path):
    table = token_table("A", 12, seed=12)
    ids = table.column("sample_id").to_pylist()
    ids[7] = ids[2]  # another answer to row 2's prompt id, from another provider
    table = table.set_column(0, "sample_id", pa.array(ids, pa.string()))
    for k, path in enumerate(_permuted_copies(tmp_path, table, 4)):
        order = pq.read_table(path, columns=["sample_id"]).column("sample_id").to_pylist()
        rows = [i for i, x in enumerate(order) if x == ids[2]]
        with pytest.raises(ValueError) as err:
            merge_datasets([MergeInput("A", path)], tmp_path / f"m{k}", MergeSettings())
        msg = str(err.value)
        assert str(path) in msg and "dataset 'A'" in msg and repr(ids[2]) in msg
        assert f"row {rows[0]} (source=simulated, backend=be-A" in msg and f"row {rows[1]} (source=" in msg
        assert "output_ids" in msg
        assert not (tmp_path / f"m{k}" / MANIFEST_NAME).exists()


def test_keep_mask_and_manifest_counts(tmp_path, write_tokens):
    pa_path, a = write_tokens("A", 30, seed=6)
    pb_path, b = write_tokens("B", 20, seed=7)
    keep_a = np.ones(30, dtype=bool)
    keep_a[[0, 5, 17]] = False
    inputs = [
        MergeInput(
            "A", pa_path, keep_mask=keep_a, excluded_by_gate={"truncated": 2, "empty": 1}, upstream_version="va"
        ),
        MergeInput("B", pb_path, upstream_version="vb"),
    ]
    m = merge_datasets(inputs, tmp_path / "m", MergeSettings(rows_per_shard=8), config_hash="cfg123")
    ids = set(read_merged(tmp_path / "m", ["sample_id"])["sample_id"].to_pylist())
    assert {"A-0000", "A-0005", "A-0017"}.isdisjoint(ids)
    assert len(ids) == 47

    on_disk = MergeManifest.read(tmp_path / "m")
    assert on_disk == m
    assert m.rows_total == 47 and m.rows_per_dataset == {"A": 27, "B": 20}
    assert m.input_rows == {"A": 30, "B": 20}
    assert m.excluded["A"]["audit"] == 3 and m.excluded["B"]["audit"] == 0
    assert m.audit_gates == {"A": {"empty": 1, "truncated": 2}, "B": {}}
    assert m.upstream_versions == {"A": "va", "B": "vb"} and m.config_hash == "cfg123"
    kept_a = [r for r, k in zip(a.to_pylist(), keep_a) if k]
    exp_tok_a = sum(len(r["prompt_ids"]) + len(r["output_ids"]) for r in kept_a)
    exp_sup_b = sum(len(r["output_ids"]) for r in b.to_pylist())
    assert m.tokens_per_dataset["A"] == exp_tok_a
    assert m.supervised_tokens_per_dataset["B"] == exp_sup_b
    assert m.tokens_total == sum(m.tokens_per_dataset.values())
    assert m.splits == {"train": 47, "eval": 0}
    assert [s["path"] for s in m.shards] == [f"part-{i:05d}.parquet" for i in range(6)]
    for s in m.shards:
        p = tmp_path / "m" / s["path"]
        assert s["sha256"] == file_sha256(p) and s["rows"] == pq.ParquetFile(p).metadata.num_rows
    assert sum(s["tokens"] for s in m.shards) == m.tokens_total
    assert json.loads((tmp_path / "m" / MANIFEST_NAME).read_text())["settings"]["rows_per_shard"] == 8


def test_keep_mask_must_match_rows(tmp_path, write_tokens):
    path, _ = write_tokens("A", 10)
    with pytest.raises(ValueError, match="keep_mask"):
        merge_datasets([MergeInput("A", path, keep_mask=np.ones(9, bool))], tmp_path / "m", MergeSettings())
    with pytest.raises(ValueError, match="keep_mask"):
        merge_datasets([MergeInput("A", path, keep_mask=np.ones(10, int))], tmp_path / "m", MergeSettings())


def test_dedup_across_datasets_keeps_first_in_dataset_order(tmp_path, write_tokens):
    # A and B share keys k0..k9; B also repeats k10 within itself.
    pa_path, _ = write_tokens("A", 10, prompt_keys=[f"k{i}" for i in range(10)])
    pb_path, _ = write_tokens("B", 14, prompt_keys=[f"k{i}" for i in range(10)] + ["k10", "k10", "k11", "k12"])
    a_first = merge_datasets([MergeInput("A", pa_path), MergeInput("B", pb_path)], tmp_path / "ab", MergeSettings())
    assert a_first.rows_per_dataset == {"A": 10, "B": 3}
    assert a_first.excluded["B"]["dedup"] == 11 and a_first.excluded["A"]["dedup"] == 0
    assert a_first.dedup_winners == {"B": {"A": 10, "B": 1}}
    ids = set(read_merged(tmp_path / "ab", ["sample_id"])["sample_id"].to_pylist())
    assert "B-0010" in ids and "B-0011" not in ids  # within B the lower sample_id keeps k10

    b_first = merge_datasets([MergeInput("B", pb_path), MergeInput("A", pa_path)], tmp_path / "ba", MergeSettings())
    assert b_first.rows_per_dataset == {"B": 13, "A": 0}

    no_dedup = merge_datasets(
        [MergeInput("A", pa_path), MergeInput("B", pb_path)], tmp_path / "nd", MergeSettings(dedup=False)
    )
    assert no_dedup.rows_total == 24


def test_dedup_ignores_audited_out_rows(tmp_path, write_tokens):
    # A's copy of k0 fails the audit, so B's copy must survive dedup.
    pa_path, _ = write_tokens("A", 3, prompt_keys=["k0", "k1", "k2"])
    pb_path, _ = write_tokens("B", 1, prompt_keys=["k0"])
    m = merge_datasets(
        [MergeInput("A", pa_path, keep_mask=np.array([False, True, True])), MergeInput("B", pb_path)],
        tmp_path / "m",
        MergeSettings(),
    )
    assert m.rows_per_dataset == {"A": 2, "B": 1}


def test_duplicate_sample_ids_dropped_even_without_dedup(tmp_path, write_tokens):
    pa_path, _ = write_tokens("A", 5, id_prefix="X")
    pb_path, _ = write_tokens("B", 5, id_prefix="X", seed=9)
    m = merge_datasets([MergeInput("A", pa_path), MergeInput("B", pb_path)], tmp_path / "m", MergeSettings(dedup=False))
    assert m.rows_total == 5 and m.excluded["B"]["duplicate_sample_id"] == 5


def test_weights_and_caps_are_seeded_and_counted(tmp_path, write_tokens):
    pa_path, _ = write_tokens("A", 40)
    pb_path, _ = write_tokens("B", 40)
    inputs = [MergeInput("A", pa_path), MergeInput("B", pb_path)]
    s = MergeSettings(seed=1, weights={"A": 0.5, "B": 0.25}, caps={"A": 7})
    m = merge_datasets(inputs, tmp_path / "m1", s)
    assert m.rows_per_dataset == {"A": 7, "B": 10}
    assert m.excluded["A"]["weight"] == 20 and m.excluded["A"]["cap"] == 13
    assert m.excluded["B"]["weight"] == 30 and m.excluded["B"]["cap"] == 0

    def ids(d):
        return set(read_merged(d, ["sample_id"])["sample_id"].to_pylist())

    merge_datasets(inputs, tmp_path / "m2", s)
    assert ids(tmp_path / "m1") == ids(tmp_path / "m2")
    merge_datasets(inputs, tmp_path / "m3", MergeSettings(seed=2, weights={"A": 0.5, "B": 0.25}, caps={"A": 7}))
    assert ids(tmp_path / "m1") != ids(tmp_path / "m3")
    # The cap keeps a subset of what the weight alone keeps (same seeded ranking).
    merge_datasets(inputs, tmp_path / "m4", MergeSettings(seed=1, weights={"A": 0.5}))
    a_capped = {i for i in ids(tmp_path / "m1") if i.startswith("A")}
    a_weighted = {i for i in ids(tmp_path / "m4") if i.startswith("A")}
    assert len(a_weighted) == 20 and a_capped < a_weighted


@pytest.mark.parametrize(
    "settings, match",
    [
        (MergeSettings(weights={"A": 1.5}), "must be in \\[0, 1\\]"),
        (MergeSettings(weights={"Z": 0.5}), "not being merged"),
        (MergeSettings(caps={"A": -1}), "non-negative"),
        (MergeSettings(eval_fraction=1.0), "eval_fraction"),
        (MergeSettings(rows_per_shard=0), "rows_per_shard"),
    ],
)
def test_invalid_settings_rejected(tmp_path, write_tokens, settings, match):
    path, _ = write_tokens("A", 5)
    with pytest.raises(ValueError, match=match):
        merge_datasets([MergeInput("A", path)], tmp_path / "m", settings)


def test_eval_split_is_hash_based_and_stable(tmp_path, write_tokens):
    pa_path, _ = write_tokens("A", 400)
    pb_path, _ = write_tokens("B", 100)
    m = merge_datasets([MergeInput("A", pa_path)], tmp_path / "m1", MergeSettings(seed=3, eval_fraction=0.25))
    t = read_merged(tmp_path / "m1", ["sample_id", "split"])
    eval_ids = {r["sample_id"] for r in t.to_pylist() if r["split"] == "eval"}
    assert 60 <= len(eval_ids) <= 140
    assert m.splits == {"train": 400 - len(eval_ids), "eval": len(eval_ids)}
    assert read_merged(tmp_path / "m1", ["sample_id"], split="eval").num_rows == len(eval_ids)
    # Adding a dataset does not move A's rows between splits (no train/eval leakage across re-merges).
    merge_datasets(
        [MergeInput("A", pa_path), MergeInput("B", pb_path)], tmp_path / "m2", MergeSettings(seed=3, eval_fraction=0.25)
    )
    t2 = read_merged(tmp_path / "m2", ["sample_id", "split"], split="eval")
    assert {i for i in t2["sample_id"].to_pylist() if i.startswith("A")} == eval_ids
    merge_datasets([MergeInput("A", pa_path)], tmp_path / "m3", MergeSettings(seed=4, eval_fraction=0.25))
    assert set(read_merged(tmp_path / "m3", ["sample_id"], split="eval")["sample_id"].to_pylist()) != eval_ids


def test_remerge_with_fewer_shards_removes_stale_ones(tmp_path, write_tokens):
    path, _ = write_tokens("A", 50)
    out = tmp_path / "m"
    merge_datasets([MergeInput("A", path)], out, MergeSettings(rows_per_shard=10))
    assert len(list(out.glob("part-*.parquet"))) == 5
    (out / ".part-00009.parquet.abc.tmp").write_bytes(b"junk from a killed writer")
    m = merge_datasets([MergeInput("A", path)], out, MergeSettings(rows_per_shard=20))
    assert sorted(p.name for p in out.glob("part-*.parquet")) == [
        "part-00000.parquet",
        "part-00001.parquet",
        "part-00002.parquet",
    ]
    assert not list(out.glob("*.tmp"))
    assert read_merged(out).num_rows == 50 == m.rows_total


def test_dataset_label_mismatch_rejected(tmp_path, write_tokens):
    path, _ = write_tokens("A", 5)
    with pytest.raises(ValueError, match="dataset column"):
        merge_datasets([MergeInput("B", path)], tmp_path / "m", MergeSettings())


def test_iter_merged_shards_streams_in_order(tmp_path, write_tokens):
    path, _ = write_tokens("A", 25)
    merge_datasets([MergeInput("A", path)], tmp_path / "m", MergeSettings(rows_per_shard=10))
    whole = read_merged(tmp_path / "m", ["sample_id"])["sample_id"].to_pylist()
    shards = list(iter_merged_shards(tmp_path / "m", ["sample_id"]))
    assert [t.num_rows for t in shards] == [10, 10, 5]
    batches = list(iter_merged_shards(tmp_path / "m", ["sample_id"], batch_rows=4))
    assert max(t.num_rows for t in batches) <= 4
    assert [i for t in batches for i in t["sample_id"].to_pylist()] == whole


def test_all_rows_excluded_writes_one_empty_shard(tmp_path, write_tokens):
    path, _ = write_tokens("A", 5)
    m = merge_datasets([MergeInput("A", path, keep_mask=np.zeros(5, bool))], tmp_path / "m", MergeSettings())
    assert m.rows_total == 0 and len(m.shards) == 1
    assert read_merged(tmp_path / "m").schema == MERGED_SCHEMA
