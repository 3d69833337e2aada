"""Fixtures: small merged tables written with pyarrow, and tiny seeded target models."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle_pipeline.hidden_states import build_tiny_model

VOCAB = 256


def make_rows(n: int, *, seed: int = 0, min_len: int = 2, max_len: int = 48, vocab: int = VOCAB) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        t = int(rng.integers(min_len, max_len + 1))
        prompt = int(rng.integers(1, t)) if t > 1 else 0
        rows.append(
            {
                "sample_id": f"B{i % 3 + 1}-{seed}-{i:04d}",
                "dataset": f"B{i % 3 + 1}",
                "input_ids": rng.integers(1, vocab, t).tolist(),
                "loss_mask": [0] * prompt + [1] * (t - prompt),
                "n_tokens": t,
                "n_prompt_tokens": prompt,
                "source": "simulated",
                "backend": "sim",
                "provider": None,
                "split": "train",
            }
        )
    return rows


def rows_table(rows: list[dict]) -> pa.Table:
    return pa.table(
        {
            "sample_id": pa.array([r["sample_id"] for r in rows], pa.string()),
            "dataset": pa.array([r["dataset"] for r in rows], pa.string()),
            "input_ids": pa.array([r["input_ids"] for r in rows], pa.list_(pa.int32())),
            "loss_mask": pa.array([r["loss_mask"] for r in rows], pa.list_(pa.int8())),
            "n_tokens": pa.array([r["n_tokens"] for r in rows], pa.int32()),
            "n_prompt_tokens": pa.array([r["n_prompt_tokens"] for r in rows], pa.int32()),
            "source": pa.array([r["source"] for r in rows], pa.string()),
            "backend": pa.array([r["backend"] for r in rows], pa.string()),
            "provider": pa.array([r["provider"] for r in rows], pa.string()),
            "split": pa.array([r["split"] for r in rows], pa.string()),
        }
    )


def write_merged(merged_dir: Path, rows: list[dict], part_sizes: list[int], row_group_size: int = 4) -> Path:
    """Write `rows` as part-00000.parquet, part-00001.parquet, ... with the given row counts."""
    assert sum(part_sizes) == len(rows)
    merged_dir.mkdir(parents=True, exist_ok=True)
    start = 0
    for k, size in enumerate(part_sizes):
        pq.write_table(
            rows_table(rows[start : start + size]), merged_dir / f"part-{k:05d}.parquet", row_group_size=row_group_size
        )
        start += size
    return merged_dir


@pytest.fixture
def merged_factory(tmp_path: Path) -> Callable[..., Path]:
    def make(rows: list[dict], part_sizes: list[int] | None = None, row_group_size: int = 4) -> Path:
        return write_merged(tmp_path / "merged", rows, part_sizes or [len(rows)], row_group_size)

    return make


@pytest.fixture(scope="session")
def tiny_ds():
    return build_tiny_model(VOCAB, family="deepseek_v3", seed=0)


@pytest.fixture(scope="session")
def tiny_llama():
    return build_tiny_model(VOCAB, family="llama", seed=0)
