"""Batching of one shard's rows for the forward pass: padded size within a token budget, longest rows first."""

from __future__ import annotations

from collections.abc import Sequence


def plan_batches(lengths: Sequence[int], max_tokens_per_batch: int, *, sort: bool = True) -> list[list[int]]:
    """Group row positions into batches whose padded size (rows x longest row) stays within the budget.

    Sorted longest-first so similar lengths share a batch (little padding) and an out-of-memory batch, if any,
    comes first rather than hours in. A row longer than the budget runs alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)) if sort else list(range(len(lengths)))
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        new_max = max(cur_max, lengths[i])
        if cur and new_max * (len(cur) + 1) > max_tokens_per_batch:
            batches.append(cur)
            cur, new_max = [], lengths[i]
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    return batches


def padding_of(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(real tokens, padding tokens) of running `batches` right-padded to each batch's longest row."""
    real = sum(lengths)
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches) - real
    return real, padded
