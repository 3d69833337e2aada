"""Fixtures: small merged tables written with pyarrow, and tiny seeded target models."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from eagle_pipeline.hidden_states.models.model import build_tiny_model

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


def with_norm_weights(model, seed: int = 3):
    """Give the final norm weights far from 1, so a missing or doubled norm changes the numbers."""
    from eagle_pipeline.hidden_states.models.layers import get_backbone

    g = torch.Generator().manual_seed(seed)
    norm = get_backbone(model).norm
    with torch.no_grad():
        norm.weight.copy_(0.5 + 1.5 * torch.rand(norm.weight.shape, generator=g))
    return model


@pytest.fixture(scope="session")
def normed_model():
    """A tiny DeepSeek-V3-family target with non-trivial final-norm weights."""
    return with_norm_weights(build_tiny_model(VOCAB, family="deepseek_v3", seed=7))


def greedy_rows(
    model, n: int, *, seed: int = 0, prompt_len: tuple[int, int] = (3, 12), new_tokens: int = 24
) -> list[dict]:
    """Rows whose outputs are `model`'s own greedy continuations of random prompts (the texts a real target would
    have written at temperature 0), split train/eval like make_rows."""
    from eagle_pipeline.hidden_states.models.layers import get_backbone

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        ids = rng.integers(1, VOCAB, int(rng.integers(*prompt_len))).tolist()
        prompt = len(ids)
        with torch.no_grad():
            for _ in range(new_tokens):
                hidden = get_backbone(model)(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state
                ids.append(int(model.lm_head(hidden[0, -1]).argmax()))
        t = len(ids)
        rows.append(
            {
                "sample_id": f"G{i % 2 + 1}-{seed}-{i:04d}",
                "dataset": f"G{i % 2 + 1}",
                "input_ids": ids,
                "loss_mask": [0] * prompt + [1] * (t - prompt),
                "n_tokens": t,
                "n_prompt_tokens": prompt,
                "source": "vllm",
                "backend": "local",
                "provider": None,
                "split": "eval" if i % 5 == 4 else "train",
            }
        )
    return rows


def kill_after_requests(srv, child, n: int, timeout_s: float = 120.0) -> None:
    """SIGKILL `child` (a shard run in a subprocess) once the double `srv` has received `n` requests."""
    import os
    import signal
    import time

    deadline = time.monotonic() + timeout_s
    while srv.total_requests < n and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.05)
    assert child.poll() is None, "the child finished before it could be killed"
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL
