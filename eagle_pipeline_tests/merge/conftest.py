"""Small synthetic token-sample tables for the merge tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

EOT = 163586
VOCAB = 163840


def token_table(
    dataset: str,
    n: int,
    *,
    seed: int = 0,
    prompt_keys: list[str] | None = None,
    id_prefix: str | None = None,
    vocab: int = 500,
    eot: int = EOT,
    id_type: pa.DataType | None = None,
) -> pa.Table:
    """A token-samples table (contract columns) with random lengths, some empty prompts, outputs ending in eot."""
    id_type = id_type or pa.int32()
    rng = np.random.default_rng(seed)
    prompts, outputs = [], []
    for i in range(n):
        plen = int(rng.integers(0, 12)) if i % 5 else 0
        olen = int(rng.integers(0, 10))
        prompts.append(rng.integers(0, vocab, plen).tolist())
        outputs.append(rng.integers(0, vocab, olen).tolist() + [eot])
    prefix = id_prefix or dataset
    return pa.table(
        {
            "sample_id": [f"{prefix}-{i:04d}" for i in range(n)],
            "dataset": [dataset] * n,
            "source": ["simulated"] * n,
            "backend": [f"be-{dataset}"] * n,
            "provider": [None if i % 3 else "prov" for i in range(n)],
            "prompt_ids": pa.array(prompts, pa.list_(id_type)),
            "output_ids": pa.array(outputs, pa.list_(id_type)),
            "ids_origin": ["returned" if i % 2 else "reconstructed" for i in range(n)],
            "finish_reason": ["stop"] * n,
            "thinking": [True] * n,
            "literal_special": [i % 7 == 0 for i in range(n)],
            "prompt_key": prompt_keys if prompt_keys is not None else [f"{prefix}-key-{i}" for i in range(n)],
        }
    )


@pytest.fixture
def write_tokens(tmp_path: Path) -> Callable[..., tuple[Path, pa.Table]]:
    """write_tokens(dataset, n, row_group_size=None, **token_table kwargs) -> (path, table)."""

    def _write(dataset: str, n: int, *, row_group_size: int | None = None, name: str | None = None, **kw):
        table = token_table(dataset, n, **kw)
        path = tmp_path / "tokens" / f"{name or dataset}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path, row_group_size=row_group_size)
        return path, table

    return _write
