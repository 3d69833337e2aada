"""Synthetic merged tables (the merged contract's columns, random ids) for benchmarks and the GPU check."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def synthetic_lengths(
    n: int, *, mean_tokens: float, max_tokens: int, min_tokens: int = 16, seed: int = 0
) -> np.ndarray:
    """Log-normal lengths (sigma 0.8: chat data's long right tail), clipped to [min_tokens, max_tokens]."""
    rng = np.random.default_rng(seed)
    sigma = 0.8
    mu = np.log(mean_tokens) - sigma**2 / 2
    return np.clip(rng.lognormal(mu, sigma, n).round(), min_tokens, max_tokens).astype(np.int64)


def write_synthetic_merged(
    merged_dir: str | Path,
    n_samples: int,
    *,
    vocab_size: int,
    mean_tokens: float = 1500,
    max_tokens: int = 4096,
    rows_per_part: int = 256,
    seed: int = 0,
) -> tuple[Path, int]:
    """Write `part-NNNNN.parquet` files; returns (merged_dir, total tokens)."""
    d = Path(merged_dir)
    d.mkdir(parents=True, exist_ok=True)
    lengths = synthetic_lengths(n_samples, mean_tokens=mean_tokens, max_tokens=max_tokens, seed=seed)
    rng = np.random.default_rng(seed + 1)
    for part, start in enumerate(range(0, n_samples, rows_per_part)):
        lens = lengths[start : start + rows_per_part]
        prompts = [int(rng.integers(1, t)) for t in lens]
        ids = [rng.integers(0, vocab_size, int(t), dtype=np.int32) for t in lens]
        masks = [np.r_[np.zeros(p, np.int8), np.ones(int(t) - p, np.int8)] for p, t in zip(prompts, lens)]
        n = len(lens)
        table = pa.table(
            {
                "sample_id": [f"synthetic-{seed}-{start + i:07d}" for i in range(n)],
                "dataset": [f"B{(start + i) % 8 + 1}" for i in range(n)],
                "input_ids": pa.array(ids, pa.list_(pa.int32())),
                "loss_mask": pa.array(masks, pa.list_(pa.int8())),
                "n_tokens": pa.array(lens, pa.int32()),
                "n_prompt_tokens": pa.array(prompts, pa.int32()),
                "source": ["simulated"] * n,
                "backend": ["synthetic"] * n,
                "provider": pa.nulls(n, pa.string()),
                "split": ["train"] * n,
            }
        )
        pq.write_table(table, d / f"part-{part:05d}.parquet", row_group_size=64)
    return d, int(lengths.sum())
