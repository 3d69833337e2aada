"""Merge audited token samples from several datasets into one deduplicated, seeded, sharded table.

Selection runs on per-row metadata only (`merge/selection.py`); token lists are touched once, as Arrow buffers, when
each output shard is assembled here. Output: `part-NNNNN.parquet` shards + `manifest.json` (`merge/manifest.py`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from eagle_pipeline.merge.arrow_ops import concat_prompt_output, hash_u64, supervised_per_row
from eagle_pipeline.merge.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    MERGED_SCHEMA,
    ROW_GROUP_ROWS,
    SHARD_GLOB,
    MergeInput,
    MergeManifest,
    MergeSettings,
    shard_name,
)
from eagle_pipeline.merge.selection import read_input, select_rows
from eagle_pipeline.merge.turns import apply_spans, fold_turns
from eagle_pipeline.shared.storage import clean_stale_tmp, file_sha256, write_json_atomic, write_parquet_atomic


def _assemble_shard(rows: pa.Table, split: np.ndarray, spans: list[list[tuple[int, int]]] | None = None) -> pa.Table:
    input_ids, loss_mask, n_prompt, n_tokens = concat_prompt_output(rows["prompt_ids"], rows["output_ids"])
    if spans is not None and any(spans):
        loss_mask = apply_spans(loss_mask, spans)
    split_arr = pa.array(np.where(split, "eval", "train").astype(object), pa.string())
    cols = {
        "sample_id": rows["sample_id"],
        "dataset": rows["dataset"],
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "n_tokens": pa.array(n_tokens.astype(np.int32)),
        "n_prompt_tokens": pa.array(n_prompt.astype(np.int32)),
        "source": rows["source"],
        "backend": rows["backend"],
        "provider": rows["provider"],
        "split": split_arr,
        "ids_origin": rows["ids_origin"],
        "literal_special": rows["literal_special"],
        "prompt_key": rows["prompt_key"],
    }
    return pa.table({k: cols[k] for k in MERGED_SCHEMA.names}, schema=MERGED_SCHEMA).combine_chunks()


def _fold_conversations(
    combined: pa.Table, excluded: dict[str, dict[str, int]]
) -> tuple[pa.Table, np.ndarray, dict[int, list[tuple[int, int]]]]:
    """`loss_on: all_turns`: each conversation's turns folded into its last row (`fold_turns`). Returns the kept
    rows, the keep mask and each kept row's supervised spans; counts the folded rows in `excluded`."""
    kept, spans_of = fold_turns(combined)
    if kept.all():
        return combined, kept, {}
    folded_ds = np.asarray(combined["dataset"].to_numpy(zero_copy_only=False), dtype=object)[~kept]
    for ds, k in zip(*np.unique(folded_ds.astype(str), return_counts=True)):
        excluded[str(ds)]["folded"] = int(k)
    new_index = np.cumsum(kept) - 1
    return combined.filter(pa.array(kept)), kept, {int(new_index[i]): sp for i, sp in spans_of.items()}


class _Counts:
    """The manifest's per-dataset figures, added up shard by shard."""

    def __init__(self, datasets: list[str]) -> None:
        self.datasets = datasets
        self.rows = dict.fromkeys(datasets, 0)
        self.tokens = dict.fromkeys(datasets, 0)
        self.supervised = dict.fromkeys(datasets, 0)
        self.splits = {ds: {"train": 0, "eval": 0} for ds in datasets}
        self.no_supervised = 0

    def add(self, table: pa.Table) -> int:
        """Count one written shard; returns its tokens."""
        n_tok = np.asarray(table["n_tokens"], dtype=np.int64)
        n_sup = supervised_per_row(table["loss_mask"], n_tok)
        self.no_supervised += int(np.count_nonzero(n_sup == 0))
        ds_col = np.asarray(table["dataset"].to_numpy(zero_copy_only=False), dtype=object)
        is_eval = np.asarray(table["split"].to_numpy(zero_copy_only=False), dtype=object) == "eval"
        for ds in self.datasets:
            m = ds_col == ds
            self.rows[ds] += int(np.count_nonzero(m))
            self.tokens[ds] += int(n_tok[m].sum())
            self.supervised[ds] += int(n_sup[m].sum())
            self.splits[ds]["eval"] += int(np.count_nonzero(m & is_eval))
            self.splits[ds]["train"] += int(np.count_nonzero(m & ~is_eval))
        return int(n_tok.sum())


def _manifest(
    inputs: list[MergeInput],
    settings: MergeSettings,
    config_hash: str,
    input_rows: dict[str, int],
    counts: _Counts,
    excluded: dict[str, dict[str, int]],
    dedup_winners: dict[str, dict[str, int]],
    shards: list[dict[str, Any]],
) -> MergeManifest:
    """The merge's manifest: its inputs and settings, what each filter excluded, the per-dataset figures, the shards."""
    return MergeManifest(
        format_version=FORMAT_VERSION,
        datasets=[i.dataset for i in inputs],
        seed=settings.seed,
        settings=settings.to_dict(),
        config_hash=config_hash,
        upstream_versions={i.dataset: i.upstream_version for i in inputs},
        input_rows=input_rows,
        rows_total=sum(counts.rows.values()),
        rows_per_dataset=counts.rows,
        tokens_total=sum(counts.tokens.values()),
        tokens_per_dataset=counts.tokens,
        supervised_tokens_total=sum(counts.supervised.values()),
        supervised_tokens_per_dataset=counts.supervised,
        rows_without_supervised_tokens=counts.no_supervised,
        excluded=excluded,
        audit_gates={i.dataset: {k: int(v) for k, v in sorted(i.excluded_by_gate.items())} for i in inputs},
        dedup_winners=dedup_winners,
        splits={
            "train": sum(v["train"] for v in counts.splits.values()),
            "eval": sum(v["eval"] for v in counts.splits.values()),
        },
        splits_per_dataset=counts.splits,
        shards=shards,
        columns=list(MERGED_SCHEMA.names),
    )


def merge_datasets(
    inputs: list[MergeInput], out_dir: Path, settings: MergeSettings, *, config_hash: str = ""
) -> MergeManifest:
    """Merge `inputs` into `out_dir` (shards + manifest). Same inputs and settings give byte-identical shards.

    Order of filters: audit keep_mask -> duplicate sample ids -> prompt dedup -> weights -> caps; then the eval
    split, a seeded global shuffle and sharding. Shards of an earlier, larger merge are deleted after the new
    manifest is in place.
    """
    out_dir = Path(out_dir)
    datasets = [i.dataset for i in inputs]
    if not inputs:
        raise ValueError("merge_datasets needs at least one input")
    if len(set(datasets)) != len(datasets):
        raise ValueError(f"duplicate dataset names in merge inputs: {datasets}")
    settings.validate(datasets)
    out_dir.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(out_dir)

    selected, excluded, dedup_winners, input_rows = select_rows(inputs, settings)
    all_ids = np.concatenate([s.sample_ids for s in selected]) if selected else np.zeros(0, object)
    all_eval = np.concatenate([s.split for s in selected]) if selected else np.zeros(0, bool)

    # Each input is read once and the inputs gathered into one buffer per column, one copy; every shard then takes its
    # rows from there, row i of the selection being row source[i] of that buffer. (A take of the selected rows per
    # input first was one more copy of the whole merge; a take on a table of many chunks, one per input, concatenates
    # them all first, which would copy the whole merge again for every shard: test_merge_memory.py.)
    tables = [read_input(inp) for inp in inputs]
    first_row = np.cumsum([0] + [t.num_rows for t in tables[:-1]])
    source = np.concatenate([first + s.rows for first, s in zip(first_row, selected)]).astype(np.int64)
    combined = pa.concat_tables(tables)
    del tables

    row_spans: dict[int, list[tuple[int, int]]] = {}
    if settings.loss_on == "all_turns":
        # fold_turns reads the selected rows themselves, in selection order.
        combined = combined.take(pa.array(source))
        combined, kept, row_spans = _fold_conversations(combined, excluded)
        all_ids, all_eval = all_ids[kept], all_eval[kept]
        source = np.arange(combined.num_rows, dtype=np.int64)
    combined = combined.combine_chunks()

    # Global permutation: sort every surviving row by a seeded hash of its sample id (ties by id).
    perm = np.lexsort((all_ids.astype(str), hash_u64(list(all_ids), f"order:{settings.seed}")))

    n_rows = len(perm)
    n_shards = max(1, math.ceil(n_rows / settings.rows_per_shard))
    shards: list[dict[str, Any]] = []
    counts = _Counts(datasets)
    for s in range(n_shards):
        take = perm[s * settings.rows_per_shard : (s + 1) * settings.rows_per_shard]
        if n_rows:
            spans = [row_spans.get(int(i), []) for i in take] if row_spans else None
            table = _assemble_shard(combined.take(pa.array(source[take])), all_eval[take], spans)
        else:
            table = MERGED_SCHEMA.empty_table()
        path = write_parquet_atomic(table, out_dir / shard_name(s), row_group_size=ROW_GROUP_ROWS)
        tokens = counts.add(table)
        shards.append({"path": path.name, "rows": table.num_rows, "tokens": tokens, "sha256": file_sha256(path)})
        del table

    manifest = _manifest(inputs, settings, config_hash, input_rows, counts, excluded, dedup_winners, shards)
    write_json_atomic(manifest.to_dict(), out_dir / MANIFEST_NAME)
    # Stale shards go only after the manifest that no longer lists them is in place.
    keep = {sh["path"] for sh in shards}
    for p in out_dir.glob(SHARD_GLOB):
        if p.name not in keep:
            p.unlink()
    return manifest
