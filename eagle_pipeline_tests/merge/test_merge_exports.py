from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle_pipeline.merge import (
    HF_SCHEMA,
    MergeInput,
    MergeSettings,
    export_hf_parquet,
    export_specforge_jsonl,
    hf_manifest_path,
    merge_datasets,
    read_merged,
)
from eagle_pipeline.shared.storage import file_sha256


@pytest.fixture
def merged(tmp_path, write_tokens) -> Path:
    pa_path, _ = write_tokens("A", 70, seed=31)
    pb_path, _ = write_tokens("B", 50, seed=32)
    out = tmp_path / "m"
    merge_datasets(
        [MergeInput("A", pa_path), MergeInput("B", pb_path)], out, MergeSettings(rows_per_shard=40, eval_fraction=0.25)
    )
    return out


def test_specforge_jsonl_round_trips(merged, tmp_path):
    out = tmp_path / "sf" / "train.jsonl"
    s = export_specforge_jsonl(merged, out, split="train")
    expected = read_merged(merged, ["input_ids", "loss_mask"], split="train").to_pylist()
    lines = out.read_text().splitlines()
    assert len(lines) == len(expected) == s.rows["train"] > 0
    for line, exp in zip(lines, expected):
        obj = json.loads(line)
        assert list(obj) == ["input_ids", "loss_mask"]
        assert obj == exp
        assert all(type(v) is int for v in obj["input_ids"] + obj["loss_mask"])  # ints, never bools
        assert set(obj["loss_mask"]) <= {0, 1} and len(obj["loss_mask"]) == len(obj["input_ids"])
    assert s.tokens["train"] == sum(len(e["input_ids"]) for e in expected)
    assert s.supervised_tokens["train"] == sum(sum(e["loss_mask"]) for e in expected)
    assert s.sha256[str(out)] == file_sha256(out)
    assert not list(out.parent.glob("*.tmp"))


def test_specforge_jsonl_all_rows(merged, tmp_path):
    s = export_specforge_jsonl(merged, tmp_path / "all.jsonl", split=None)
    assert s.rows == {"all": 120}
    assert len((tmp_path / "all.jsonl").read_text().splitlines()) == 120


def test_hf_parquet_round_trips_and_cleans_stale(merged, tmp_path):
    out = tmp_path / "hf"
    s = export_hf_parquet(merged, out, rows_per_shard=20)
    for split in ("train", "eval"):
        got = pq.ParquetDataset(sorted((out / split).glob("*.parquet"))).read()
        assert got.schema == HF_SCHEMA
        assert got.schema.field("input_ids").type == pa.list_(pa.int32())
        assert got.schema.field("loss_mask").type == pa.list_(pa.int8())
        exp = read_merged(merged, HF_SCHEMA.names, split=split)
        assert got.to_pylist() == exp.to_pylist()  # merged order kept
        assert s.rows[split] == exp.num_rows
    assert s.rows["train"] + s.rows["eval"] == 120
    n_train_files = len(s.files["train"])
    assert n_train_files > 1 and all(pq.ParquetFile(p).metadata.num_rows <= 20 for p in s.files["train"])
    assert json.loads(hf_manifest_path(out).read_text())["rows"] == s.rows
    assert sorted(p.name for p in out.iterdir()) == ["eval", "train"]  # nothing but data in the data folder

    s2 = export_hf_parquet(merged, out, rows_per_shard=1000)
    assert len(list((out / "train").glob("part-*.parquet"))) == 1 == len(s2.files["train"])


def test_hf_parquet_empty_split_gets_an_empty_shard(tmp_path, write_tokens):
    path, _ = write_tokens("A", 10)
    merge_datasets([MergeInput("A", path)], tmp_path / "m", MergeSettings())
    s = export_hf_parquet(tmp_path / "m", tmp_path / "hf")
    assert s.rows == {"train": 10, "eval": 0}
    (eval_file,) = s.files["eval"]
    t = pq.read_table(eval_file)
    assert t.num_rows == 0 and t.schema == HF_SCHEMA


def test_hf_parquet_loads_with_datasets(merged, tmp_path):
    datasets = pytest.importorskip("datasets", reason="`datasets` is not installed in this environment")
    out = tmp_path / "hf"
    s = export_hf_parquet(merged, out)
    ds = datasets.load_dataset(
        "parquet",
        data_files={"train": str(out / "train" / "*.parquet"), "eval": str(out / "eval" / "*.parquet")},
        cache_dir=str(tmp_path / "hf_cache"),
    )
    assert ds["train"].num_rows == s.rows["train"] and ds["eval"].num_rows == s.rows["eval"]
    first = read_merged(merged, ["input_ids", "loss_mask"], split="train").slice(0, 1).to_pylist()[0]
    assert ds["train"][0]["input_ids"] == first["input_ids"] and ds["train"][0]["loss_mask"] == first["loss_mask"]


def test_hf_parquet_folder_loads_without_data_files(merged, tmp_path):
    """`load_dataset(folder)` reads exactly the rows: no manifest inside the data folder is taken for data."""
    datasets = pytest.importorskip("datasets", reason="`datasets` is not installed in this environment")
    out = tmp_path / "hf"
    (out).mkdir()
    (out / "export_manifest.json").write_text("{}")  # where an older export put it: must be removed
    s = export_hf_parquet(merged, out)
    ds = datasets.load_dataset(str(out), cache_dir=str(tmp_path / "hf_cache"))
    assert sorted(ds) == ["test", "train"]  # datasets names the eval folder "test"
    assert ds["train"].num_rows == s.rows["train"] and ds["test"].num_rows == s.rows["eval"]
    assert set(ds["train"].column_names) == set(HF_SCHEMA.names)
