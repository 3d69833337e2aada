"""Merge audited token samples from several datasets into one deduplicated, seeded, sharded table.

Selection runs on per-row metadata only (sample ids, prompt keys); token lists are touched once, as Arrow
buffers, when each output shard is assembled. Output: `part-NNNNN.parquet` shards + `manifest.json`.

Why this module is long: selection (audit, duplicate ids, dedup, weights, caps, splits) and assembly share the row
bookkeeping of one merge (indices, splits, spans of folded turns) that the manifest reports; splitting them would pass
that state across modules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle_pipeline.merge.arrow_ops import concat_prompt_output, hash_u64, supervised_per_row, unit_interval
from eagle_pipeline.merge.turns import LOSS_ON_MODES, apply_spans, fold_turns, select_groups
from eagle_pipeline.storage import clean_stale_tmp, file_sha256, read_json, write_json_atomic, write_parquet_atomic

MANIFEST_NAME = "manifest.json"
SHARD_GLOB = "part-*.parquet"
FORMAT_VERSION = 1
# Row groups well below the shard size so readers can stream a shard batch by batch.
ROW_GROUP_ROWS = 1024

MERGED_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("n_tokens", pa.int32()),
        ("n_prompt_tokens", pa.int32()),
        ("source", pa.string()),
        ("backend", pa.string()),
        ("provider", pa.string()),
        ("split", pa.string()),
        # Provenance beyond the contract: where the ids came from, literal special-token text, the dedup key.
        ("ids_origin", pa.string()),
        ("literal_special", pa.bool_()),
        ("prompt_key", pa.string()),
    ]
)

REQUIRED_INPUT_COLUMNS = ("sample_id", "prompt_ids", "output_ids")
# Copied through when present; null-filled otherwise so partial upstream tables still merge.
PASSTHROUGH_COLUMNS = {
    "source": pa.string(),
    "backend": pa.string(),
    "provider": pa.string(),
    "ids_origin": pa.string(),
    "literal_special": pa.bool_(),
    "prompt_key": pa.string(),
}
# "folded": a conversation's turn supervised inside its next turn's row (`loss_on: all_turns`, merge/turns.py).
EXCLUSION_REASONS = ("audit", "duplicate_sample_id", "dedup", "weight", "cap", "folded")
# The turns of a regenerated conversation: read to keep a conversation in one split and to fold its turns.
CONVERSATION_COLUMNS = {"conversation_id": pa.string(), "turn_index": pa.int32()}


def shard_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


@dataclass(frozen=True)
class MergeSettings:
    """How datasets are combined. Every random choice is a keyed hash of (seed, sample_id), so a row's fate
    does not depend on which other rows are present or on input row order."""

    seed: int = 0
    weights: Mapping[str, float] = field(default_factory=dict)  # dataset -> keep fraction in [0, 1]
    caps: Mapping[str, int] = field(default_factory=dict)  # dataset -> max rows
    dedup: bool = True
    eval_fraction: float = 0.0
    rows_per_shard: int = 10_000
    loss_on: str = "last_turn"  # or "all_turns": fold a conversation's verbatim turns into its later rows

    def validate(self, datasets: list[str]) -> None:
        problems = []
        known = set(datasets)
        for name, table in (("weights", self.weights), ("caps", self.caps)):
            unknown = sorted(set(table) - known)
            if unknown:
                problems.append(f"{name} name datasets not being merged: {unknown}")
        for ds, w in self.weights.items():
            # Upsampling would duplicate sample ids (and their hidden states); repeat in the trainer instead.
            if not (0.0 <= float(w) <= 1.0):
                problems.append(f"weights[{ds!r}] = {w}: must be in [0, 1]")
        for ds, c in self.caps.items():
            if int(c) != c or c < 0:
                problems.append(f"caps[{ds!r}] = {c}: must be a non-negative integer")
        if not (0.0 <= self.eval_fraction < 1.0):
            problems.append(f"eval_fraction = {self.eval_fraction}: must be in [0, 1)")
        if self.rows_per_shard < 1:
            problems.append(f"rows_per_shard = {self.rows_per_shard}: must be >= 1")
        if self.loss_on not in LOSS_ON_MODES:
            problems.append(f"loss_on = {self.loss_on!r}: must be one of {list(LOSS_ON_MODES)}")
        if problems:
            raise ValueError("invalid merge settings: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["weights"] = {k: float(v) for k, v in sorted(self.weights.items())}
        d["caps"] = {k: int(v) for k, v in sorted(self.caps.items())}
        return d


@dataclass
class MergeInput:
    """One dataset's token samples plus the audit's verdict on them."""

    dataset: str
    tokens_path: Path
    keep_mask: np.ndarray | None = None  # bool per row of tokens_path; None admits every row
    excluded_by_gate: dict[str, int] = field(default_factory=dict)  # reported, not applied
    upstream_version: str = ""


@dataclass
class MergeManifest:
    """What a merge wrote and why; `manifest.json` is written after every shard, so it is the commit point."""

    format_version: int
    datasets: list[str]
    seed: int
    settings: dict[str, Any]
    config_hash: str
    upstream_versions: dict[str, str]
    input_rows: dict[str, int]
    rows_total: int
    rows_per_dataset: dict[str, int]
    tokens_total: int
    tokens_per_dataset: dict[str, int]
    supervised_tokens_total: int
    supervised_tokens_per_dataset: dict[str, int]
    rows_without_supervised_tokens: int
    excluded: dict[str, dict[str, int]]  # dataset -> reason -> rows
    audit_gates: dict[str, dict[str, int]]  # dataset -> gate -> rows (as the audit reported them)
    dedup_winners: dict[str, dict[str, int]]  # losing dataset -> dataset that kept the prompt -> rows
    splits: dict[str, int]
    splits_per_dataset: dict[str, dict[str, int]]
    shards: list[dict[str, Any]]  # {"path", "rows", "tokens", "sha256"}
    columns: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MergeManifest:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})

    @classmethod
    def read(cls, out_dir: str | Path) -> MergeManifest:
        return cls.from_dict(read_json(Path(out_dir) / MANIFEST_NAME))


# ---------------------------------------------------------------------------------------------------------
# Selection (metadata only)


@dataclass
class _Selected:
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


def _select(inputs: list[MergeInput], settings: MergeSettings):
    datasets = [i.dataset for i in inputs]
    excluded = {ds: dict.fromkeys(EXCLUSION_REASONS, 0) for ds in datasets}
    input_rows: dict[str, int] = {}

    # 1. Audit keep-mask, then the deterministic base order: dataset order given, then sample_id.
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
    dedup_winners: dict[str, dict[str, int]] = {}
    if settings.dedup:
        cand = np.flatnonzero(alive & np.array([k is not None for k in pkey], dtype=bool))
        if len(cand):
            keys = pkey[cand].astype(str)
            _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
            loser = np.ones(len(cand), dtype=bool)
            loser[first] = False
            n_ds = len(inputs)
            pair = ds_idx[cand[loser]].astype(np.int64) * n_ds + ds_idx[cand[first[inverse]]][loser]
            pair_counts = np.bincount(pair, minlength=n_ds * n_ds).reshape(n_ds, n_ds)
            for lose, win in zip(*np.nonzero(pair_counts)):
                excluded[datasets[lose]]["dedup"] += int(pair_counts[lose, win])
                dedup_winners.setdefault(datasets[lose], {})[datasets[win]] = int(pair_counts[lose, win])
            alive[cand[loser]] = False

    # 4. Weights and caps per dataset: keep the rows (whole conversations) with the smallest seeded hash.
    selected: list[_Selected] = []
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
        selected.append(_Selected(rows=row_idx[members], sample_ids=ids, split=is_eval, groups=grp[members]))
    return selected, excluded, dedup_winners, input_rows


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
        content = dict(zip(rows.tolist(), _read_selected(inp, rows).to_pylist()))
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


# ---------------------------------------------------------------------------------------------------------
# Assembly (tokens)


def _read_selected(inp: MergeInput, rows: np.ndarray) -> pa.Table:
    pf = pq.ParquetFile(inp.tokens_path)
    names = set(pf.schema_arrow.names)
    extra = {**PASSTHROUGH_COLUMNS, **CONVERSATION_COLUMNS}
    cols = ["sample_id", "prompt_ids", "output_ids"] + [c for c in extra if c in names]
    t = pf.read(columns=cols).take(pa.array(rows))
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
    tbl = pa.table(out)
    return tbl.combine_chunks()


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

    selected, excluded, dedup_winners, input_rows = _select(inputs, settings)
    all_ids = np.concatenate([s.sample_ids for s in selected]) if selected else np.zeros(0, object)
    all_eval = np.concatenate([s.split for s in selected]) if selected else np.zeros(0, bool)

    # Only the selected rows of each dataset are kept in memory, as Arrow buffers.
    parts = [_read_selected(inp, s.rows) for inp, s in zip(inputs, selected)]
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
