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
from eagle_pipeline.merge.selection import read_selected, select_rows
from eagle_pipeline.merge.turns import apply_spans, fold_turns
from eagle_pipeline.storage import clean_stale_tmp, file_sha256, write_json_atomic, write_parquet_atomic


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

    # Only the selected rows of each dataset are kept in memory, as Arrow buffers.
    parts = [read_selected(inp, s.rows) for inp, s in zip(inputs, selected)]
    combined = pa.concat_tables(parts)
    del parts

    row_spans: dict[int, list[tuple[int, int]]] = {}
    if settings.loss_on == "all_turns":
        kept, spans_of = fold_turns(combined)
        if not kept.all():
            folded_ds = np.asarray(combined["dataset"].to_numpy(zero_copy_only=False), dtype=object)[~kept]
            for ds, k in zip(*np.unique(folded_ds.astype(str), return_counts=True)):
                excluded[str(ds)]["folded"] = int(k)
            new_index = np.cumsum(kept) - 1
            row_spans = {int(new_index[i]): sp for i, sp in spans_of.items()}
            combined = combined.filter(pa.array(kept))
            all_ids, all_eval = all_ids[kept], all_eval[kept]

    # Global permutation: sort every surviving row by a seeded hash of its sample id (ties by id).
    perm = np.lexsort((all_ids.astype(str), hash_u64(list(all_ids), f"order:{settings.seed}")))

    n_rows = len(perm)
    n_shards = max(1, math.ceil(n_rows / settings.rows_per_shard))
    shards: list[dict[str, Any]] = []
    rows_per_dataset = dict.fromkeys(datasets, 0)
    tokens_per_dataset = dict.fromkeys(datasets, 0)
    supervised_per_dataset = dict.fromkeys(datasets, 0)
    splits_per_dataset = {ds: {"train": 0, "eval": 0} for ds in datasets}
    no_supervised = 0
    for s in range(n_shards):
        take = perm[s * settings.rows_per_shard : (s + 1) * settings.rows_per_shard]
        if n_rows:
            spans = [row_spans.get(int(i), []) for i in take] if row_spans else None
            table = _assemble_shard(combined.take(pa.array(take)), all_eval[take], spans)
        else:
            table = MERGED_SCHEMA.empty_table()
        path = write_parquet_atomic(table, out_dir / shard_name(s), row_group_size=ROW_GROUP_ROWS)
        n_tok = np.asarray(table["n_tokens"], dtype=np.int64)
        n_sup = supervised_per_row(table["loss_mask"], n_tok)
        no_supervised += int(np.count_nonzero(n_sup == 0))
        ds_col = np.asarray(table["dataset"].to_numpy(zero_copy_only=False), dtype=object)
        is_eval = np.asarray(table["split"].to_numpy(zero_copy_only=False), dtype=object) == "eval"
        for ds in datasets:
            m = ds_col == ds
            rows_per_dataset[ds] += int(np.count_nonzero(m))
            tokens_per_dataset[ds] += int(n_tok[m].sum())
            supervised_per_dataset[ds] += int(n_sup[m].sum())
            splits_per_dataset[ds]["eval"] += int(np.count_nonzero(m & is_eval))
            splits_per_dataset[ds]["train"] += int(np.count_nonzero(m & ~is_eval))
        shards.append(
            {"path": path.name, "rows": table.num_rows, "tokens": int(n_tok.sum()), "sha256": file_sha256(path)}
        )
        del table

    manifest = MergeManifest(
        format_version=FORMAT_VERSION,
        datasets=datasets,
        seed=settings.seed,
        settings=settings.to_dict(),
        config_hash=config_hash,
        upstream_versions={i.dataset: i.upstream_version for i in inputs},
        input_rows=input_rows,
        rows_total=n_rows,
        rows_per_dataset=rows_per_dataset,
        tokens_total=sum(tokens_per_dataset.values()),
        tokens_per_dataset=tokens_per_dataset,
        supervised_tokens_total=sum(supervised_per_dataset.values()),
        supervised_tokens_per_dataset=supervised_per_dataset,
        rows_without_supervised_tokens=no_supervised,
        excluded=excluded,
        audit_gates={i.dataset: {k: int(v) for k, v in sorted(i.excluded_by_gate.items())} for i in inputs},
        dedup_winners=dedup_winners,
        splits={
            "train": sum(v["train"] for v in splits_per_dataset.values()),
            "eval": sum(v["eval"] for v in splits_per_dataset.values()),
        },
        splits_per_dataset=splits_per_dataset,
        shards=shards,
        columns=list(MERGED_SCHEMA.names),
    )
    write_json_atomic(manifest.to_dict(), out_dir / MANIFEST_NAME)
    # Stale shards go only after the manifest that no longer lists them is in place.
    keep = {sh["path"] for sh in shards}
    for p in out_dir.glob(SHARD_GLOB):
        if p.name not in keep:
            p.unlink()
    return manifest
