"""Trainer exports derived from finished shards: SpecForge's offline `.ckpt` files and speculators' Arrow dataset with
its `hs_{i}.safetensors` files (a full copy of the states: docs/hidden_states.md on when a layout written directly by
extraction saves it), with speculators' `--train-data-ratio` (the disk-room check before each is `disk_plan.check_export_room`)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from eagle_pipeline.drafter_types import DEFAULT_DRAFTERS, SF_EAGLE3_KEYS, specforge_aliases
from eagle_pipeline.hidden_states.layouts.drafters import capture_of_shards, capture_record, handoff, handoff_markdown
from eagle_pipeline.hidden_states.layouts.trainer_layouts import (
    EXPORT_JSON,
    LAYOUT_FINAL_STATE,
    SHARDS,
    SPECFORGE,
    SPECULATORS,
    SPECULATORS_HS_DIR,
    SPLITS,
    StatesExportSummary,
    direct_samples,
    iter_shard_samples,
    merged_tables,
    plan_layout_target,
    recorded_drops,
    serialise,
    shard_final_state,
)
from eagle_pipeline.hidden_states.models.layers import aux_layer_to_vllm_id
from eagle_pipeline.hidden_states.store.fp8 import FP8_BACKEND, FP8_BACKEND_FLAG, QUANTIZE_FP8
from eagle_pipeline.hidden_states.store.head import POST_NORM, PRE_NORM, load_target_head
from eagle_pipeline.merge.vocab import D2T_NPY, DRAFT_VOCAB_PT, T2D_NPY
from eagle_pipeline.shared.storage import atomic_path, clean_stale_tmp, write_bytes_atomic, write_json_atomic

# The export folder's record of what it was built from (the layer guard and check-drafter read it).
EXPORT_MANIFEST = "manifest.json"


def write_layout(
    layout: str,
    hs_dir: str | Path,
    merged_dir: str | Path,
    out_dir: str | Path,
    *,
    aliases: Mapping[str, str] | None = None,
) -> tuple[int, int]:
    """Put every merged row's states in `layout` under `out_dir`: samples extraction wrote there directly are
    checked and left alone, every other shard's samples are converted (the final state brought to the trainer's
    convention; SpecForge's `aliases` added, see `serialise`); files of rows no longer merged are removed.
    Rows the shards dropped (`trainer_layouts.recorded_drops`) have no file and no number.
    Returns (bytes written, samples written directly)."""
    out_dir = Path(out_dir)
    target = plan_layout_target(layout, out_dir, merged_dir, left_out=_dropped_ids(hs_dir))
    assert target is not None
    direct = direct_samples(hs_dir, target)
    for d in {(out_dir / rel).parent for rel in target.file_of.values()}:
        d.mkdir(parents=True, exist_ok=True)
        clean_stale_tmp(d)
    head = None
    found, nbytes = set(direct), 0
    want = LAYOUT_FINAL_STATE[layout]
    for sid, t, meta in iter_shard_samples(hs_dir, skip_layout=layout):
        rel = target.file_of.get(sid)
        if rel is None:
            raise ValueError(f"{hs_dir}: shard {meta['shard_index']} holds {sid!r}, which is not in the merged table")
        have = shard_final_state(meta)
        if have != want and want == PRE_NORM:
            raise ValueError(
                f"{hs_dir}: shard {meta['shard_index']} stores the final state post-norm; {layout} applies the final "
                "norm itself and would normalise it twice. Re-extract with final_state='pre_norm'."
            )
        if have != want:
            head = head or load_target_head(hs_dir)
            t = {**t, "final_hidden_state": head.final_norm(t["final_hidden_state"])}
        data = serialise(layout, t, len(meta["aux_layers"]), int(meta["hidden_size"]), aliases)
        write_bytes_atomic(data, out_dir / rel)
        nbytes += len(data)
        found.add(sid)
    _check_complete(found, target.file_of, hs_dir)
    keep = {(out_dir / rel).resolve() for rel in target.file_of.values()}
    pattern = f"{SPECULATORS_HS_DIR}/hs_*.safetensors" if layout == SPECULATORS else "*/*.ckpt"
    for p in out_dir.glob(pattern):
        if p.resolve() not in keep:
            p.unlink()
    return nbytes, len(direct)


def _place_draft_vocab(out_dir: Path, sources: Mapping[str, str | Path | None]) -> None:
    """Copy each draft-vocabulary file to `out_dir/{name}` from its source, or, where there is none, remove the copy an
    earlier export left: a mapping from another merged table must not sit beside these states as if it were theirs
    (the README and the commands name the files only when they were copied)."""
    for name, src in sources.items():
        if src is None:
            (out_dir / name).unlink(missing_ok=True)
            continue
        with atomic_path(out_dir / name) as tmp:
            shutil.copyfile(src, tmp)


def _dropped_ids(hs_dir: str | Path) -> set[str]:
    return {d["sample_id"] for d in recorded_drops(hs_dir)}


def _split_counts(merged_dir: str | Path, left_out: set[str]) -> tuple[dict[str, int], dict[str, int]]:
    """(rows, tokens) per split of the merged table, less the rows `left_out`."""
    rows, tokens = dict.fromkeys(SPLITS, 0), dict.fromkeys(SPLITS, 0)
    for t in merged_tables(merged_dir, ["sample_id", "split", "n_tokens"]):
        for sid, split, n in zip(*(t.column(c).to_pylist() for c in ("sample_id", "split", "n_tokens"))):
            if sid in left_out:
                continue
            rows[split] += 1
            tokens[split] += int(n)
    return rows, tokens


def _check_complete(found: set[str], expected: dict[str, str], hs_dir: str | Path) -> None:
    missing = sorted(set(expected) - found)
    if missing:
        raise ValueError(
            f"{len(missing)} merged rows have no hidden states under {hs_dir} (e.g. {missing[:5]}): extract every "
            "shard before exporting"
        )


def export_specforge_states(
    hs_dir: str | Path,
    merged_dir: str | Path,
    out_dir: str | Path,
    *,
    draft_vocab_pt: str | Path | None = None,
    drafters: Sequence[Any] = DEFAULT_DRAFTERS,
    layout: str = SHARDS,
) -> StatesExportSummary:
    """SpecForge's offline features under `{out_dir}/train/` and `{out_dir}/eval/` (see the module docstring), with
    the keys and hand-off of each drafter type in `drafters` it serves (docs/drafters.md)."""
    out_dir = Path(out_dir)
    record = capture_record(capture_of_shards(hs_dir), SPECFORGE, POST_NORM)
    dirs = {s: out_dir / s for s in SPLITS}
    rows, tokens = _split_counts(merged_dir, _dropped_ids(hs_dir))
    paths = {
        "train": dirs["train"],
        "eval": dirs["eval"] if rows["eval"] else None,
        "vocab_mapping": out_dir / DRAFT_VOCAB_PT if draft_vocab_pt is not None else None,
    }
    entries = handoff(record, drafters, paths=paths, layout=layout)
    aliases = specforge_aliases([e["type"] for e in entries if e["served"]])
    nbytes, n_direct = write_layout(SPECFORGE, hs_dir, merged_dir, out_dir, aliases=aliases)
    _place_draft_vocab(out_dir, {DRAFT_VOCAB_PT: draft_vocab_pt})
    summary = StatesExportSummary(
        format="specforge_offline",
        path=str(out_dir),
        rows=rows,
        tokens=tokens,
        bytes_written=nbytes,
        final_state=POST_NORM,
        extra={
            "samples_written_by_extraction": n_direct,
            "dropped_rows": recorded_drops(hs_dir),
            "config": {
                "data.hidden_states_path": str(dirs["train"]),
                "data.eval_hidden_states_path": str(dirs["eval"]) if rows["eval"] else None,
                "model.vocab_mapping_path": str(out_dir / DRAFT_VOCAB_PT) if draft_vocab_pt is not None else None,
            },
            "note": "an offline config with an eval path also needs training.eval_interval",
            "keys": [*SF_EAGLE3_KEYS, *aliases],
            "key_aliases": aliases,
            "capture": record,
            "drafters": entries,
        },
    )
    write_json_atomic(summary.to_dict(), out_dir / EXPORT_JSON)
    _write_readme(
        out_dir,
        [
            "# SpecForge offline features (written by eagle-pipeline)",
            "",
            f"Rows: {rows['train']} train (`train/`), {rows['eval']} eval (`eval/`); one `{{sample_id}}.ckpt` each, "
            f"keys {summary.extra['keys']} (aliases share one storage: {aliases or 'none'}).",
            "",
            *handoff_markdown(record, entries),
        ],
    )
    return summary


def train_data_ratio(n_train: int, n_eval: int) -> float | None:
    """speculators' `--train-data-ratio` that puts exactly the first n_train rows in train: int(n * r) = n_train.
    None when there is no eval row (speculators needs a ratio strictly inside (0, 1)).

    The middle of the interval that works, [n_train / n, (n_train + 1) / n), to as many decimals as n has digits:
    off the middle by at most half a unit of the last decimal, less than half the interval, and printed in a
    command as 0.966 rather than 0.9661458333333334."""
    n = n_train + n_eval
    if n_eval == 0 or n_train == 0:
        return None
    return round((n_train + 0.5) / n, len(str(n)))


def _speculators_table(merged_dir: str | Path, left_out: set[str]) -> tuple[pa.Table, int]:
    """The merged rows as speculators' dataset columns, train rows (merged order) then eval rows, less the rows
    `left_out` (row i is read from hs_{i}: `plan_layout_target`); and n_train."""
    import pyarrow.compute as pc

    merged = pa.concat_tables(merged_tables(merged_dir, ["sample_id", "input_ids", "loss_mask", "n_tokens", "split"]))
    if left_out:
        merged = merged.filter(pc.invert(pc.is_in(merged["sample_id"], pa.array(sorted(left_out), pa.string()))))
    parts = []
    for split in SPLITS:
        t = merged.filter(pc.equal(merged["split"], split))
        parts.append(
            pa.table(
                {
                    "input_ids": t["input_ids"].cast(pa.list_(pa.int64())),
                    "loss_mask": t["loss_mask"].cast(pa.list_(pa.int64())),
                    "seq_len": t["n_tokens"].cast(pa.int64()),
                    "sample_id": t["sample_id"],
                }
            )
        )
    return pa.concat_tables(parts), parts[0].num_rows


def export_speculators_states(
    hs_dir: str | Path,
    merged_dir: str | Path,
    out_dir: str | Path,
    *,
    draft_vocab_dir: str | Path | None = None,
    drafters: Sequence[Any] = DEFAULT_DRAFTERS,
    verifier: str | None = None,
) -> StatesExportSummary:
    """speculators' offline data directory at `out_dir` (see the module docstring), with the flags and command of
    each drafter type in `drafters` it serves (docs/drafters.md); `verifier` names the target for the commands."""
    import datasets

    out_dir = Path(out_dir)
    record = capture_record(capture_of_shards(hs_dir), SPECULATORS, PRE_NORM)
    nbytes, n_direct = write_layout(SPECULATORS, hs_dir, merged_dir, out_dir)
    drops = recorded_drops(hs_dir)
    table, n_train = _speculators_table(merged_dir, {d["sample_id"] for d in drops})
    n_eval = table.num_rows - n_train
    aux_layers = list(record["aux_layers"])
    _save_arrow(datasets.Dataset(table).with_format("torch"), out_dir)
    _place_draft_vocab(
        out_dir,
        {name: None if draft_vocab_dir is None else Path(draft_vocab_dir) / name for name in (D2T_NPY, T2D_NPY)},
    )
    ratio = train_data_ratio(n_train, n_eval)
    fp8_states = record["quantize"] == QUANTIZE_FP8
    vllm_ids = [aux_layer_to_vllm_id(x) for x in aux_layers or []]
    paths = {
        "data": out_dir,
        "hidden_states": out_dir / SPECULATORS_HS_DIR,
        "train_data_ratio": ratio,
        "d2t": out_dir / D2T_NPY if draft_vocab_dir is not None else None,
        "t2d": out_dir / T2D_NPY if draft_vocab_dir is not None else None,
        "verifier": verifier,
    }
    summary = StatesExportSummary(
        format="speculators_offline",
        path=str(out_dir),
        rows={"train": n_train, "eval": n_eval},
        tokens={"all": int(np.asarray(table.column("seq_len")).sum())},
        bytes_written=nbytes,
        final_state=PRE_NORM,
        extra={
            "samples_written_by_extraction": n_direct,
            "dropped_rows": drops,  # merged rows without states, left out of the dataset and of the numbering
            "train_data_ratio": ratio,
            "aux_layers_0_based_outputs": aux_layers,
            "aux_layer_ids_vllm": vllm_ids,
            # speculators' reader of these files: its fp8 backend for FP8 states, its default file backend otherwise
            "hidden_states_backend": FP8_BACKEND if fp8_states else "file",
            "args": f"--data-path {out_dir}"
            + (f" {FP8_BACKEND_FLAG} {FP8_BACKEND}" if fp8_states else "")
            + (f" --train-data-ratio {ratio!r}" if ratio is not None else ""),
            "capture": record,
            "drafters": handoff(record, drafters, paths=paths),
        },
    )
    write_json_atomic(summary.to_dict(), out_dir / EXPORT_JSON)
    vocab_args = f"--d2t-path {paths['d2t']} --t2d-path {paths['t2d']}" if draft_vocab_dir is not None else None
    _write_speculators_readme(out_dir, summary, vocab_args)
    return summary


def _save_arrow(ds: Any, out_dir: Path) -> None:
    """`save_to_disk` into a temporary folder, then move its files into `out_dir`, state.json last (the files a
    reader opens first are never half written)."""
    tmp = out_dir / ".arrow.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    ds.save_to_disk(str(tmp))
    for old in out_dir.glob("data-*.arrow"):  # shards of a larger earlier dataset
        if not (tmp / old.name).exists():
            old.unlink()
    for name in sorted(os.listdir(tmp), key=lambda n: n == "state.json"):
        os.replace(tmp / name, out_dir / name)
    tmp.rmdir()


def _write_speculators_readme(out_dir: Path, s: StatesExportSummary, vocab_args: str | None) -> None:
    """`vocab_args`: the `--d2t-path`/`--t2d-path` flags of the files copied beside the states, None when none was
    (the command must not name a file that is not there)."""
    ratio = s.extra["train_data_ratio"]
    # Each hs_{i} stacks the aux layers and then the final state (`trainer_layouts.serialise`): n_aux + 1 slots.
    slots = int(s.extra["capture"]["layer_count"]) + 1
    train = f"python scripts/train.py {s.extra['args']}"
    lines = [
        "# speculators offline data (written by eagle-pipeline)",
        "",
        f"Rows: {s.rows['train']} train, then {s.rows['eval']} eval (eval rows last); row i's states are "
        "`hidden_states/hs_{i}.safetensors`, its sample in the `sample_id` column"
        + (
            f"; {len(s.extra['dropped_rows'])} merged rows without states (too long for the servers) are left out "
            "(export.json's dropped_rows)."
            if s.extra["dropped_rows"]
            else "."
        ),
        "",
        "Train with:",
        "",
        "```",
        *([f"{train} \\", f"    {vocab_args} ..."] if vocab_args else [f"{train} ..."]),
        "```",
        "",
        f"`--train-data-ratio` = (n_train + 0.5) / n = {ratio!r}: int(n * ratio) = n_train exactly."
        if ratio is not None
        else "No eval rows: speculators needs --train-data-ratio strictly inside (0, 1); set merge.eval_fraction > 0.",
        "",
        f"`hidden_states/hs_{{i}}.safetensors`: `hidden_states` [T, {slots}, H] = aux layers "
        f"{s.extra['aux_layers_0_based_outputs']} (0-based decoder-layer outputs; vLLM ids "
        f"{s.extra['aux_layer_ids_vllm']}) then the final state BEFORE the final norm; `token_ids` [T] int64.",
        *(
            [
                "",
                f"FP8 states: `hidden_states` float8_e4m3fn with `hidden_states_scales` fp32 [T, {slots}, 1] (one scale "
                f"per token per layer); speculators dequantizes them with `{FP8_BACKEND_FLAG} {FP8_BACKEND}`.",
            ]
            if s.extra["hidden_states_backend"] == FP8_BACKEND
            else []
        ),
        "",
        *handoff_markdown(s.extra["capture"], s.extra["drafters"]),
    ]
    _write_readme(out_dir, lines)


def _write_readme(out_dir: Path, lines: list[str]) -> None:
    with atomic_path(out_dir / "README.md") as tmp:
        tmp.write_text("\n".join(lines))
