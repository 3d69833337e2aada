"""Selection of a merge, on per-row metadata only (sample ids, prompt keys, conversations): the audit's keep-mask,
duplicate sample ids, prompt dedup, weights and caps (whole conversations), the eval split; and the reading of an
input's tokens, once, as Arrow buffers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle_pipeline.merge.arrow_ops import hash_u64, unit_interval
from eagle_pipeline.merge.manifest import (
    CONVERSATION_COLUMNS,
    EXCLUSION_REASONS,
    PASSTHROUGH_COLUMNS,
    REQUIRED_INPUT_COLUMNS,
    MergeInput,
    MergeSettings,
)
from eagle_pipeline.merge.turns import select_groups


@dataclass
class Selected:
    """The rows of one dataset that survive, as row indices into its tokens file."""

    rows: np.ndarray
    sample_ids: np.ndarray  # object array, aligned with rows
    split: np.ndarray  # bool: True = eval
    groups: np.ndarray  # object array: the conversation of each row (its sample id when it is none)


def _read_meta(inp: MergeInput, dedup: bool) -> tuple[pa.Table, int]:
    pf = pq.ParquetFile(inp.tokens_path)
    names = set(pf.schema_arrow.names)
    missing = [c for c in REQUIRED_INPUT_COLUMNS if c not in names]
    if dedup and "prompt_key" not in names:
        missing.append("prompt_key (needed for dedup)")
    if missing:
        raise ValueError(f"{inp.tokens_path}: missing columns {missing}")
    cols = ["sample_id"] + [c for c in ("dataset", "prompt_key", "conversation_id") if c in names]
    return pf.read(columns=cols), pf.metadata.num_rows


def select_rows(
    inputs: list[MergeInput], settings: MergeSettings
) -> tuple[list[Selected], dict[str, dict[str, int]], dict[str, dict[str, int]], dict[str, int]]:
    """The surviving rows of each input, in filter order (audit, duplicate sample ids, dedup, weights, caps) with
    their eval split; the rows each filter excluded per dataset, the dedup winners, and each input's row count."""
    datasets = [i.dataset for i in inputs]
    excluded = {ds: dict.fromkeys(EXCLUSION_REASONS, 0) for ds in datasets}
    input_rows: dict[str, int] = {}

    # 1. Audit keep-mask, then the deterministic base order: dataset order given, then sample_id.
    ds_idx, row_idx, sid, pkey, grp = _base_order(inputs, settings, excluded, input_rows)
    alive = np.ones(len(sid), dtype=bool)

    # 2. A sample id may appear once: later copies are dropped whatever `dedup` says, so merged ids are unique.
    #    Across datasets the dataset order given decides; within one dataset only exact copies may be dropped.
    if len(sid):
        _, first, inverse = np.unique(sid.astype(str), return_index=True, return_inverse=True)
        dup = np.ones(len(sid), dtype=bool)
        dup[first] = False
        _reject_conflicting_copies(inputs, ds_idx, row_idx, sid, dup, first[inverse])
        for k in np.flatnonzero(np.bincount(ds_idx[dup], minlength=len(inputs))):
            excluded[datasets[k]]["duplicate_sample_id"] = int(np.count_nonzero(dup & (ds_idx == k)))
        alive &= ~dup

    # 3. Prompt dedup across (and within) datasets: the first row in base order keeps the prompt.
    dedup_winners = _dedup_prompts(datasets, ds_idx, pkey, alive, excluded) if settings.dedup else {}

    # 4. Weights and caps per dataset: keep the rows (whole conversations) with the smallest seeded hash.
    selected: list[Selected] = []
    for d, inp in enumerate(inputs):
        ds = inp.dataset
        members = np.flatnonzero(alive & (ds_idx == d))
        cap = settings.caps.get(ds)
        keep, excluded[ds]["weight"], excluded[ds]["cap"] = select_groups(
            grp[members],
            float(settings.weights.get(ds, 1.0)),
            None if cap is None else int(cap),
            f"select:{settings.seed}:{ds}",
        )
        members = members[keep]
        ids = sid[members]
        # Keyed by conversation (a row's own sample id when it is none): a conversation's turns share one split.
        is_eval = unit_interval(hash_u64(list(grp[members]), f"eval:{settings.seed}")) < settings.eval_fraction
        selected.append(Selected(rows=row_idx[members], sample_ids=ids, split=is_eval, groups=grp[members]))
    return selected, excluded, dedup_winners, input_rows


def _base_order(
    inputs: list[MergeInput],
    settings: MergeSettings,
    excluded: dict[str, dict[str, int]],
    input_rows: dict[str, int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every input's rows the audit admits, in base order (dataset order given, then sample_id): their dataset
    index, row index, sample id, prompt key and conversation (the sample id when none). Counts the audit's
    exclusions in `excluded` and each input's rows in `input_rows`."""
    g_ds, g_row, g_sid, g_key, g_grp = [], [], [], [], []
    for d, inp in enumerate(inputs):
        meta, n = _read_meta(inp, settings.dedup)
        input_rows[inp.dataset] = n
        if "dataset" in meta.column_names:
            labels = pc.unique(meta["dataset"].drop_null()).to_pylist()
            if labels and labels != [inp.dataset]:
                raise ValueError(f"{inp.tokens_path}: dataset column holds {labels}, expected {inp.dataset!r}")
        rows = np.arange(n, dtype=np.int64)
        if inp.keep_mask is not None:
            keep = np.asarray(inp.keep_mask)
            if keep.dtype != np.bool_ or keep.shape != (n,):
                raise ValueError(
                    f"{inp.dataset}: keep_mask must be bool of shape ({n},), got {keep.dtype} {keep.shape}"
                )
            rows = rows[keep]
            excluded[inp.dataset]["audit"] = n - len(rows)
        sids = meta["sample_id"].take(pa.array(rows))
        if sids.null_count:
            raise ValueError(f"{inp.tokens_path}: {sids.null_count} admitted rows have a null sample_id")
        order = np.asarray(pc.sort_indices(sids))
        rows = rows[order]
        g_ds.append(np.full(len(rows), d, dtype=np.int32))
        g_row.append(rows)
        g_sid.append(np.asarray(sids.take(pa.array(order)).to_numpy(zero_copy_only=False), dtype=object))
        group = (
            pc.coalesce(meta["conversation_id"], meta["sample_id"]) if "conversation_id" in meta.column_names else None
        )
        g_grp.append(
            g_sid[-1]
            if group is None
            else np.asarray(group.take(pa.array(rows)).to_numpy(zero_copy_only=False), dtype=object)
        )
        if "prompt_key" in meta.column_names:
            g_key.append(
                np.asarray(meta["prompt_key"].take(pa.array(rows)).to_numpy(zero_copy_only=False), dtype=object)
            )
        else:
            g_key.append(np.full(len(rows), None, dtype=object))
    ds_idx = np.concatenate(g_ds) if g_ds else np.zeros(0, np.int32)
    row_idx = np.concatenate(g_row) if g_row else np.zeros(0, np.int64)
    sid = np.concatenate(g_sid) if g_sid else np.zeros(0, object)
    pkey = np.concatenate(g_key) if g_key else np.zeros(0, object)
    grp = np.concatenate(g_grp) if g_grp else np.zeros(0, object)
    return ds_idx, row_idx, sid, pkey, grp


def _dedup_prompts(
    datasets: list[str], ds_idx: np.ndarray, pkey: np.ndarray, alive: np.ndarray, excluded: dict[str, dict[str, int]]
) -> dict[str, dict[str, int]]:
    """Prompt dedup: of the alive rows with a prompt key, the first in base order keeps it; the others are marked
    dead in `alive` and counted in `excluded`. Returns, per losing dataset, the rows each winning dataset took."""
    dedup_winners: dict[str, dict[str, int]] = {}
    cand = np.flatnonzero(alive & np.array([k is not None for k in pkey], dtype=bool))
    if len(cand):
        keys = pkey[cand].astype(str)
        _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        loser = np.ones(len(cand), dtype=bool)
        loser[first] = False
        n_ds = len(datasets)
        pair = ds_idx[cand[loser]].astype(np.int64) * n_ds + ds_idx[cand[first[inverse]]][loser]
        pair_counts = np.bincount(pair, minlength=n_ds * n_ds).reshape(n_ds, n_ds)
        for lose, win in zip(*np.nonzero(pair_counts)):
            excluded[datasets[lose]]["dedup"] += int(pair_counts[lose, win])
            dedup_winners.setdefault(datasets[lose], {})[datasets[win]] = int(pair_counts[lose, win])
        alive[cand[loser]] = False
    return dedup_winners


def _reject_conflicting_copies(
    inputs: list[MergeInput],
    ds_idx: np.ndarray,
    row_idx: np.ndarray,
    sid: np.ndarray,
    dup: np.ndarray,
    first_of: np.ndarray,
) -> None:
    """Raise when one dataset holds two rows with one sample id and different content.

    Which copy would win depends on input row order, and two answers to one prompt id in one dataset is a bug
    upstream (the pipeline's token samples hold each id once). Exact copies are harmless and dropped as duplicates.
    """
    same_ds = np.flatnonzero(dup & (ds_idx == ds_idx[first_of]))
    for d in np.unique(ds_idx[same_ds]):
        inp = inputs[int(d)]
        pairs = [(int(row_idx[first_of[i]]), int(row_idx[i])) for i in same_ds if ds_idx[i] == d]
        rows = np.array(sorted({r for pair in pairs for r in pair}), dtype=np.int64)
        content = dict(zip(rows.tolist(), read_selected(inp, rows).to_pylist()))
        for a, b in sorted(pairs):
            if content[a] != content[b]:
                differ = [k for k in content[a] if content[a][k] != content[b][k]]
                raise ValueError(
                    f"{inp.tokens_path}: dataset {inp.dataset!r} holds two different rows for sample_id "
                    f"{content[a]['sample_id']!r}: {_row_provenance(a, content[a])} and "
                    f"{_row_provenance(b, content[b])} differ in {differ}. Two answers to one prompt id in one "
                    "dataset is an upstream data bug; keep one of them and rebuild the file"
                )


def _row_provenance(row: int, c: Mapping[str, Any]) -> str:
    return f"row {row} (source={c['source']}, backend={c['backend']}, provider={c['provider']})"


def read_input(inp: MergeInput) -> pa.Table:
    """Every row of an input's tokens file, in file order, as the merge uses it: ids as list<int32>, the passthrough and
    conversation columns (nulls where the file lacks them), the dataset's name. Columns keep the file's row groups as
    chunks: the merge gathers every input into one buffer per column anyway."""
    pf = pq.ParquetFile(inp.tokens_path)
    names = set(pf.schema_arrow.names)
    extra = {**PASSTHROUGH_COLUMNS, **CONVERSATION_COLUMNS}
    cols = ["sample_id", "prompt_ids", "output_ids"] + [c for c in extra if c in names]
    t = pf.read(columns=cols)
    n = t.num_rows
    out = {
        "sample_id": t["sample_id"],
        "dataset": pa.array(np.full(n, inp.dataset, dtype=object), pa.string()),
        "prompt_ids": t["prompt_ids"],
        "output_ids": t["output_ids"],
    }
    for c, typ in extra.items():
        out[c] = pc.cast(t[c], typ) if c in names else pa.nulls(n, typ)
    # Cast list types once so every dataset's chunk has the same schema (upstream may use int64 ids).
    for c in ("prompt_ids", "output_ids"):
        if out[c].type != pa.list_(pa.int32()):
            out[c] = pc.cast(out[c], pa.list_(pa.int32()))
    return pa.table(out)


def read_selected(inp: MergeInput, rows: np.ndarray) -> pa.Table:
    """The rows `rows` of an input's tokens file, as `read_input` gives them."""
    return read_input(inp).take(pa.array(rows))
