"""Draft vocabulary (d2t / t2d) from the supervised tokens of the merged dataset.

Convention shared by SpecForge, speculators and SGLang: the K selected target ids are sorted ascending; draft
id d maps to target id d + d2t[d] (d2t int64 offsets); t2d is a bool mask over the target vocabulary.
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from eagle_pipeline.merge.manifest import MANIFEST_NAME
from eagle_pipeline.merge.reader import iter_merged_shards
from eagle_pipeline.shared.arrow import list_parts
from eagle_pipeline.shared.storage import atomic_path, file_sha256, write_bytes_atomic, write_json_atomic

DRAFT_VOCAB_PT = "draft_vocab.pt"  # SpecForge: torch.save({"d2t": LongTensor, "t2d": BoolTensor})
D2T_NPY = "d2t.npy"  # speculators --d2t-path
T2D_NPY = "t2d.npy"  # speculators --t2d-path
TOKEN_COUNTS_NPY = "token_counts.npy"  # int64 [target_vocab_size]: supervised-token counts
SUMMARY_JSON = "draft_vocab.json"
TOP_TOKENS_LISTED = 50
VOCAB_BATCH_ROWS = 2048


@dataclass
class DraftVocabSummary:
    k: int
    target_vocab_size: int
    splits: list[str]
    supervised_tokens: int
    distinct_supervised_tokens: int
    covered_tokens: int  # supervised tokens whose id is in the draft vocab
    coverage: float  # covered_tokens / supervised_tokens
    padded_unseen_ids: int  # ids with count 0 that fill the vocab when fewer than k ids were seen
    top_tokens: list[list[int]]  # [[target_id, count], ...] by count, then id
    merged_manifest_sha256: str  # the merged data this map was counted from (a cache key)
    files: dict[str, str] = field(default_factory=dict)  # name -> sha256

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def count_supervised_tokens(
    merged_dir: str | Path, target_vocab_size: int, splits: tuple[str, ...] = ("train",)
) -> np.ndarray:
    """int64 counts per target id over positions with loss_mask == 1, streamed batch by batch."""
    counts = np.zeros(target_vocab_size, dtype=np.int64)
    for t in iter_merged_shards(merged_dir, ["input_ids", "loss_mask", "split"], batch_rows=VOCAB_BATCH_ROWS):
        if splits is not None:
            keep = np.isin(np.asarray(t["split"].to_numpy(zero_copy_only=False), dtype=object), list(splits))
            if not keep.all():
                t = t.filter(pa.array(keep))
        if t.num_rows == 0:
            continue
        ids_len, ids = list_parts(t["input_ids"], pa.int32())
        mask_len, mask = list_parts(t["loss_mask"], pa.int8())
        if not np.array_equal(ids_len, mask_len):
            raise ValueError(f"{merged_dir}: loss_mask and input_ids lengths differ; run check_loss_mask_aligned")
        sup = ids[mask == 1]
        if len(sup) and (sup.min() < 0 or sup.max() >= target_vocab_size):
            raise ValueError(
                f"supervised token id out of range [0, {target_vocab_size}): min {sup.min()}, max {sup.max()}"
            )
        counts += np.bincount(sup, minlength=target_vocab_size)
    return counts


def select_draft_vocab(counts: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(selected target ids ascending, d2t int64, t2d bool) for the top `k` ids by count.

    Ties (including the count-0 tail) go to the lower id, so when fewer than k ids were seen the vocab is
    filled with the lowest unseen ids, as SpecForge and speculators do.
    """
    v = len(counts)
    if not 0 < k <= v:
        raise ValueError(f"draft vocab size k={k} must be in [1, target_vocab_size={v}]")
    order = np.lexsort((np.arange(v), -counts))  # by count descending, then id ascending
    selected = np.sort(order[:k]).astype(np.int64)
    d2t = selected - np.arange(k, dtype=np.int64)
    t2d = np.zeros(v, dtype=np.bool_)
    t2d[selected] = True
    return selected, d2t, t2d


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def build_draft_vocab(
    merged_dir: str | Path,
    target_vocab_size: int,
    out_dir: str | Path,
    k: int = 32000,
    *,
    splits: tuple[str, ...] = ("train",),
) -> DraftVocabSummary:
    """Count supervised tokens of `splits`, keep the top k ids, write the d2t/t2d files (atomically).

    Writes draft_vocab.pt (SpecForge), d2t.npy + t2d.npy (speculators), token_counts.npy, draft_vocab.json.
    Eval rows are left out by default so held-out data does not shape the vocab.
    """
    import torch  # local: torch is heavy and only this function needs it

    merged_dir, out_dir = Path(merged_dir), Path(out_dir)
    if not 0 < k <= target_vocab_size:
        raise ValueError(f"draft vocab size k={k} must be in [1, target_vocab_size={target_vocab_size}]")
    counts = count_supervised_tokens(merged_dir, target_vocab_size, splits)
    selected, d2t, t2d = select_draft_vocab(counts, k)

    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_dir / DRAFT_VOCAB_PT) as tmp:
        torch.save({"d2t": torch.from_numpy(d2t.copy()), "t2d": torch.from_numpy(t2d.copy())}, tmp)
    write_bytes_atomic(_npy_bytes(d2t), out_dir / D2T_NPY)
    write_bytes_atomic(_npy_bytes(t2d), out_dir / T2D_NPY)
    write_bytes_atomic(_npy_bytes(counts), out_dir / TOKEN_COUNTS_NPY)

    total = int(counts.sum())
    covered = int(counts[selected].sum())
    top_n = min(TOP_TOKENS_LISTED, k)
    top = np.lexsort((np.arange(len(counts)), -counts))[:top_n]
    manifest = merged_dir / MANIFEST_NAME
    summary = DraftVocabSummary(
        k=k,
        target_vocab_size=target_vocab_size,
        splits=list(splits),
        supervised_tokens=total,
        distinct_supervised_tokens=int(np.count_nonzero(counts)),
        covered_tokens=covered,
        coverage=covered / total if total else 0.0,
        padded_unseen_ids=int(np.count_nonzero(counts[selected] == 0)),
        top_tokens=[[int(i), int(counts[i])] for i in top if counts[i] > 0],
        merged_manifest_sha256=file_sha256(manifest) if manifest.exists() else "",
        files={name: file_sha256(out_dir / name) for name in (DRAFT_VOCAB_PT, D2T_NPY, T2D_NPY, TOKEN_COUNTS_NPY)},
    )
    write_json_atomic(summary.to_dict(), out_dir / SUMMARY_JSON)
    return summary


def load_draft_vocab(out_dir: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(d2t, t2d) from the .npy files, with the invariants checked."""
    d2t = np.load(Path(out_dir) / D2T_NPY, allow_pickle=False)
    t2d = np.load(Path(out_dir) / T2D_NPY, allow_pickle=False)
    target = np.arange(len(d2t)) + d2t
    if t2d.dtype != np.bool_ or int(t2d.sum()) != len(d2t) or not t2d[target].all() or np.any(np.diff(target) <= 0):
        raise ValueError(f"{out_dir}: d2t/t2d are inconsistent")
    return d2t, t2d


__all__ = [
    "DraftVocabSummary",
    "build_draft_vocab",
    "count_supervised_tokens",
    "load_draft_vocab",
    "select_draft_vocab",
]
