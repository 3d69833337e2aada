"""One object per layout the states can live in, found by name in `LAYOUTS` (the names: `settings.LAYOUT_NAMES`).

* `shards` (`ShardsLayout`): the project's own `shard-NNNNN.safetensors`, the states beside the ids and masks, the
  final state pre-norm plus the target's final norm recorded beside the shards (`head.py`).
* SpecForge (`SpecForgeLayout`; `data.hidden_states_path`, `data.eval_hidden_states_path`): `{out}/train/` and
  `{out}/eval/`, one `torch.save` file `{sample_id}.ckpt` per sample with `input_ids` int64 [T], `loss_mask` int64
  [T], `aux_hidden_state` [1, T, 3H] and `hidden_state` [1, T, H] **after** the final norm; `draft_vocab.pt` beside.
* speculators (`SpeculatorsLayout`; `--data-path`): an Arrow dataset (`save_to_disk`, torch format: `input_ids`,
  `loss_mask`, `seq_len`, `sample_id`; train rows in merged order, then eval rows), `hidden_states/hs_{i}.safetensors`
  for row i with `hidden_states` [T, n_aux + 1, H] (the n_aux aux layers, [T, 4, H] for the default 3, then the final
  state **before** the final norm) and `token_ids` [T] int64, `d2t.npy` / `t2d.npy` when a draft vocabulary was
  built, and `--train-data-ratio` = (n_train + 0.5) / n in `export.json` and README.md.

Each object owns its final-state convention, its file naming (`target`), serialise and deserialise, its disk rate
(`disk_rates`, which `plan.disk_plan` sums) and its export with its README. With `hidden_states.layout: specforge |
speculators` extraction writes each sample's states straight into that trainer's files (`plan_layout_target`,
`SampleFilesWriter`; the vLLM engine's `vllm_layouts.VllmLayoutRows`); the shard file keeps only ids and masks, and
every check reads the trainer's files through `open_shard`. Otherwise the export converts the shards
(`TrainerLayout.write_from_shards`): SpecForge's post-norm state is `final_norm(pre)`, bit-equal to the model's own
norm. Every file is written atomically; files of rows no longer merged are removed. Disk and time of each choice at
scale: docs/hidden_states.md §14.

Why this module is long: the three layout objects read one another's files (an export converts shards written in
any layout, `open_shard` reads a shard whichever layout it names), so they and the reader that looks them up by
name share one module; what they share without a layout (summaries, splits, disk room, README writing) is in
`trainer_exports`.
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import torch

from eagle_pipeline.drafter_types import (
    POST_NORM,
    PRE_NORM,
    SF_EAGLE3_KEYS,
    SPECFORGE,
    SPECULATORS,
    specforge_aliases,
)
from eagle_pipeline.hidden_states.layouts.drafters import capture_of_shards, capture_record, handoff, handoff_markdown
from eagle_pipeline.hidden_states.layouts.trainer_exports import (
    EXPORT_JSON,
    SPLITS,
    StatesExport,
    StatesExportSummary,
    check_complete,
    dropped_ids,
    merged_splits,
    merged_tables,
    place_draft_vocab,
    split_counts,
    train_data_ratio,
    write_readme,
)
from eagle_pipeline.hidden_states.models.layers import aux_layer_to_vllm_id
from eagle_pipeline.hidden_states.settings import LAYOUT_QUANTIZE, SHARDS
from eagle_pipeline.hidden_states.store import fp8
from eagle_pipeline.hidden_states.store.fingerprint import recorded_fingerprint
from eagle_pipeline.hidden_states.store.format import (
    SCALES_NAME,
    TENSOR_NAMES,
    SampleLocation,
    build_sample_index,
    read_index_meta,
    sample_file_digest,
    sample_file_entry,
    shard_paths,
    tensor_key,
)
from eagle_pipeline.hidden_states.store.fp8 import FP8_BACKEND, FP8_BACKEND_FLAG, QUANTIZE_FP8, QUANTIZE_NONE
from eagle_pipeline.hidden_states.store.head import load_target_head
from eagle_pipeline.hidden_states.store.shard_index import (
    IDS_BYTES,
    IDS_SHARD_SAMPLE_BYTES,
    MASK_BYTES,
    PROJECT_SHARD_SAMPLE_BYTES,
    recorded_drops,
    shard_indexes,
)
from eagle_pipeline.merge.vocab import D2T_NPY, DRAFT_VOCAB_PT, T2D_NPY
from eagle_pipeline.shared.storage import (
    TMP_SUFFIX,
    clean_stale_tmp,
    write_bytes_atomic,
    write_json_atomic,
)

SPECULATORS_HS_DIR = "hidden_states"
# Where a layout's files land (`disk_plan` places, resolved to folders by `run.disk_places`).
HIDDEN_STATES, EXPORTS = "hidden_states", "exports"
# Beyond the tensors' bytes, measured with the writers (test_hs_disk_plan holds the plan within 1 % of real files):
SPECULATORS_FILE_BYTES = 184  # hs_{i}.safetensors: 8 B length + its JSON header of two tensors (144-168 B measured)
SPECULATORS_FP8_FILE_BYTES = 272  # the same with the scales' third tensor entry (224-264 B measured)
SCALES_ENTRY_BYTES = 100  # an FP8 shard's header entry of a sample's `state_scales` (~95 B measured)
SPECFORGE_FILE_BYTES = 2_320  # a torch.save zip of four tensors: pickle, zip entries, 64 B alignment (2,205-2,317)
ARROW_TOKEN_BYTES = 16  # speculators' dataset: input_ids and loss_mask as int64
ARROW_SAMPLE_BYTES = 64  # seq_len, list offsets and the sample_id string

DiskRate = tuple[str, str, int, int]  # (what, place, bytes per token, bytes per sample)


class Layout:
    """Where the states of every sample live, and in which final-state convention. The project's shards are the
    base: the states in the shard file, nothing outside it (`target` None)."""

    name: ClassVar[str] = SHARDS
    final_state: ClassVar[str] = PRE_NORM  # the convention extraction stores
    states_in_shards: ClassVar[bool] = True  # the shard file holds the states (else only ids and masks)
    # The vLLM connector's file is already this layout's sample file (the vLLM engine renames it into place).
    takes_connector_file: ClassVar[bool] = False

    @property
    def quantize_modes(self) -> tuple[str, ...]:
        """The `fp8.QUANTIZE_MODES` its files hold (`settings.LAYOUT_QUANTIZE`, which the configuration checks as it
        loads): the shard file and speculators' files hold e4m3 states with their scales."""
        return LAYOUT_QUANTIZE[self.name]

    def target(
        self,
        export_root: str | Path,
        merged_dir: str | Path,
        *,
        left_out: Collection[str] = (),
        quantize: str = QUANTIZE_NONE,
    ) -> LayoutTarget | None:
        """Where extraction writes each sample's states outside the shard file: nowhere for the shards."""
        return None

    def disk_rates(self, state_token_bytes: int, *, quantized: bool = False, direct: bool = True) -> list[DiskRate]:
        """(what, place, bytes per token, bytes per sample) of each part this layout writes (`state_token_bytes`:
        the states of one token; the shard files add `disk_plan.SHARD_FILE_BYTES` each)."""
        per_token = state_token_bytes + IDS_BYTES + MASK_BYTES
        per_sample = PROJECT_SHARD_SAMPLE_BYTES + (SCALES_ENTRY_BYTES if quantized else 0)
        return [("states: project shards", HIDDEN_STATES, per_token, per_sample)]


@dataclass(frozen=True)
class LayoutTarget:
    """Where extraction writes each sample's states when `hidden_states.layout` is a trainer's layout: the trainer's
    export folder and, per sample id, its file there (relative to `root`), and how the states are stored
    (`fp8.QUANTIZE_MODES`: speculators' files hold e4m3 states and their scales with `fp8`)."""

    name: str
    root: Path
    file_of: dict[str, str]
    quantize: str = QUANTIZE_NONE

    @property
    def layout(self) -> TrainerLayout:
        layout = layout_of(self.name)
        assert isinstance(layout, TrainerLayout), self.name
        return layout


class TrainerLayout(Layout):
    """A trainer's own files, one per sample: named by `file_names`, written by `serialise`, read by `deserialise`;
    the shard file keeps the ids and masks. `export` completes the trainer's folder from the finished shards."""

    states_in_shards = False
    export_format: ClassVar[str]  # the summary's `format`, its key in the export manifest
    file_glob: ClassVar[str]  # every sample file under the layout's root (stale ones are removed)
    file_rates: ClassVar[tuple[tuple[str, int, int], ...]]  # (what, extra bytes per token, bytes per sample)

    def file_names(self, splits: Mapping[str, str]) -> dict[str, str]:
        """Each sample's file (relative to the layout's root) from its split, in merged order."""
        raise NotImplementedError

    def serialise(
        self,
        t: Mapping[str, torch.Tensor],
        n_aux: int,
        hidden: int,
        aliases: Mapping[str, str] | None = None,
        quantize: str = QUANTIZE_NONE,
    ) -> bytes:
        """One sample's file from the four canonical tensors (final state already in this layout's convention)."""
        raise NotImplementedError

    def deserialise(self, path: Path, n_aux: int) -> dict[str, torch.Tensor]:
        """aux [T, n_aux*H] and final [T, H] of one sample's file."""
        raise NotImplementedError

    def export(self, job: StatesExport) -> StatesExportSummary:
        """The trainer's folder at `job.out_dir` from the finished shards, with its `export.json` and README, the
        draft vocabulary copied beside it when the job names one, and the hand-off of each of its drafter types
        (docs/drafters.md)."""
        raise NotImplementedError

    def target(
        self,
        export_root: str | Path,
        merged_dir: str | Path,
        *,
        left_out: Collection[str] = (),
        quantize: str = QUANTIZE_NONE,
    ) -> LayoutTarget:
        """The file of every merged row. Rows in `left_out` (dropped by extraction: `too_long_rows: drop`) get no
        file (and, where files are numbered, no number)."""
        gone = set(left_out)
        splits = {sid: split for sid, split in merged_splits(merged_dir).items() if sid not in gone}
        if quantize not in self.quantize_modes:
            able = [n for n, layout in LAYOUTS.items() if quantize in layout.quantize_modes]
            raise ValueError(f"quantize {quantize!r} is built for layout {' | '.join(able)} only, not {self.name!r}")
        return LayoutTarget(self.name, Path(export_root), self.file_names(splits), quantize)

    def disk_rates(self, state_token_bytes: int, *, quantized: bool = False, direct: bool = True) -> list[DiskRate]:
        """`direct`: extraction writes the layout (the shards keep ids and masks); otherwise a copy converted from
        the shards (the files alone)."""
        parts = [(what, EXPORTS, t, s) for what, t, s in self._file_rates(state_token_bytes, quantized)]
        if not direct:
            return [(f"copy for trainer_layouts: {what}", place, t, s) for what, place, t, s in parts]
        return [("ids and masks in the shards", HIDDEN_STATES, IDS_BYTES + MASK_BYTES, IDS_SHARD_SAMPLE_BYTES), *parts]

    def _file_rates(self, state_token_bytes: int, quantized: bool) -> list[tuple[str, int, int]]:
        """(what, bytes per token, bytes per sample) of each part of the layout's files."""
        raise NotImplementedError

    def write_from_shards(
        self,
        hs_dir: str | Path,
        merged_dir: str | Path,
        out_dir: str | Path,
        *,
        aliases: Mapping[str, str] | None = None,
    ) -> tuple[int, int]:
        """Put every merged row's states in this layout under `out_dir`: samples extraction wrote there directly are
        checked and left alone, every other shard's samples are converted (the final state brought to this layout's
        convention; SpecForge's `aliases` added, see `serialise`); files of rows no longer merged are removed.
        Rows the shards dropped (`shard_index.recorded_drops`) have no file and no number.
        Returns (bytes written, samples written directly)."""
        out_dir = Path(out_dir)
        target = self.target(out_dir, merged_dir, left_out=dropped_ids(hs_dir))
        direct = direct_samples(hs_dir, target)
        for d in {(out_dir / rel).parent for rel in target.file_of.values()}:
            d.mkdir(parents=True, exist_ok=True)
            clean_stale_tmp(d)
        head = None
        found, nbytes = set(direct), 0
        for sid, t, reader in iter_shard_samples(hs_dir, skip_layout=self.name):
            meta, fp = reader.meta, reader.fingerprint
            rel = target.file_of.get(sid)
            if rel is None:
                raise ValueError(
                    f"{hs_dir}: shard {meta['shard_index']} holds {sid!r}, which is not in the merged table"
                )
            quantize = fp.quantize  # an FP8 extraction gives FP8 files, where the trainer reads them
            if quantize not in self.quantize_modes:
                raise ValueError(
                    f"{hs_dir}: shard {meta['shard_index']} holds {quantize} states and {self.name} has no reader for "
                    f"them: a dequantized copy would cost twice their bytes for states already rounded to e4m3. "
                    "Re-extract with quantize: none for this trainer"
                )
            have = fp.final_state
            if have != self.final_state and self.final_state == PRE_NORM:
                raise ValueError(
                    f"{hs_dir}: shard {meta['shard_index']} stores the final state post-norm; {self.name} applies the "
                    "final norm itself and would normalise it twice. Re-extract with final_state='pre_norm'."
                )
            if have != self.final_state:
                head = head or load_target_head(hs_dir)
                t = {**t, "final_hidden_state": head.final_norm(t["final_hidden_state"])}
            data = self.serialise(t, len(fp.aux_layers), int(meta["hidden_size"]), aliases, quantize)
            write_bytes_atomic(data, out_dir / rel)
            nbytes += len(data)
            found.add(sid)
        check_complete(found, target.file_of, hs_dir)
        keep = {(out_dir / rel).resolve() for rel in target.file_of.values()}
        for p in out_dir.glob(self.file_glob):
            if p.resolve() not in keep:
                p.unlink()
        return nbytes, len(direct)


class SpecForgeLayout(TrainerLayout):
    """SpecForge's offline features (see the module docstring)."""

    name = SPECFORGE
    final_state = POST_NORM
    export_format = "specforge_offline"
    file_glob = "*/*.ckpt"

    def file_names(self, splits: Mapping[str, str]) -> dict[str, str]:
        return {sid: f"{split}/{safe_file_stem(sid)}.ckpt" for sid, split in splits.items()}

    def _file_rates(self, state_token_bytes: int, quantized: bool) -> list[tuple[str, int, int]]:
        # input_ids and loss_mask as int64 beside the states
        return [("states: SpecForge {sample_id}.ckpt", state_token_bytes + 16, SPECFORGE_FILE_BYTES)]

    def serialise(
        self,
        t: Mapping[str, torch.Tensor],
        n_aux: int,
        hidden: int,
        aliases: Mapping[str, str] | None = None,
        quantize: str = QUANTIZE_NONE,
    ) -> bytes:
        """`aliases` (`drafter_types.specforge_aliases`) adds the DFlash family's key names for EAGLE-3's tensors;
        torch.save writes a storage once however many keys name it."""
        record = {
            "input_ids": _own_storage(t["input_ids"].to(torch.int64)),
            "loss_mask": _own_storage(t["loss_mask"].to(torch.int64)),
            "aux_hidden_state": _own_storage(t["aux_hidden_states"]).unsqueeze(0),
            "hidden_state": _own_storage(t["final_hidden_state"]).unsqueeze(0),
        }
        record.update({alias: record[src] for alias, src in (aliases or {}).items()})
        buf = io.BytesIO()
        torch.save(record, buf)
        return buf.getvalue()

    def deserialise(self, path: Path, n_aux: int) -> dict[str, torch.Tensor]:
        rec = torch.load(path, mmap=True, weights_only=True)
        return {"aux_hidden_states": rec["aux_hidden_state"][0], "final_hidden_state": rec["hidden_state"][0]}

    def export(self, job: StatesExport) -> StatesExportSummary:
        hs_dir, out_dir = job.hs_dir, job.out_dir
        draft_vocab_pt = job.draft_vocab_dir / DRAFT_VOCAB_PT if job.draft_vocab_dir is not None else None
        record = capture_record(capture_of_shards(hs_dir), SPECFORGE, POST_NORM)
        dirs = {s: out_dir / s for s in SPLITS}
        rows, tokens = split_counts(job.merged_dir, dropped_ids(hs_dir))
        paths = {
            "train": dirs["train"],
            "eval": dirs["eval"] if rows["eval"] else None,
            "vocab_mapping": out_dir / DRAFT_VOCAB_PT if draft_vocab_pt is not None else None,
        }
        entries = handoff(record, job.drafters, paths=paths, layout=job.extraction_layout)
        aliases = specforge_aliases([e["type"] for e in entries if e["served"]])
        nbytes, n_direct = self.write_from_shards(hs_dir, job.merged_dir, out_dir, aliases=aliases)
        place_draft_vocab(out_dir, {DRAFT_VOCAB_PT: draft_vocab_pt})
        summary = StatesExportSummary(
            format=self.export_format,
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
        write_readme(
            out_dir,
            [
                "# SpecForge offline features (written by eagle-pipeline)",
                "",
                f"Rows: {rows['train']} train (`train/`), {rows['eval']} eval (`eval/`); one `{{sample_id}}.ckpt` "
                f"each, keys {summary.extra['keys']} (aliases share one storage: {aliases or 'none'}).",
                "",
                *handoff_markdown(record, entries),
            ],
        )
        return summary


class SpeculatorsLayout(TrainerLayout):
    """speculators' offline data directory (see the module docstring)."""

    name = SPECULATORS
    final_state = PRE_NORM
    takes_connector_file = True
    export_format = "speculators_offline"
    file_glob = f"{SPECULATORS_HS_DIR}/hs_*.safetensors"

    def file_names(self, splits: Mapping[str, str]) -> dict[str, str]:
        """`hs_{i}` numbers rows train first, then eval, each in merged order: speculators' loader reads row i of its
        Arrow dataset from `hs_{i}` (`ArrowDataset._get_raw_data`), so the numbers are dense over the rows the
        dataset holds, which are exactly the rows with states."""
        ordered = [sid for split in SPLITS for sid, s in splits.items() if s == split]
        return {sid: f"{SPECULATORS_HS_DIR}/hs_{i}.safetensors" for i, sid in enumerate(ordered)}

    def _file_rates(self, state_token_bytes: int, quantized: bool) -> list[tuple[str, int, int]]:
        header = SPECULATORS_FP8_FILE_BYTES if quantized else SPECULATORS_FILE_BYTES
        return [
            ("states: speculators hs_{i}.safetensors", state_token_bytes + 8, header),  # token_ids int64
            ("speculators Arrow dataset (ids, masks)", ARROW_TOKEN_BYTES, ARROW_SAMPLE_BYTES),
        ]

    def serialise(
        self,
        t: Mapping[str, torch.Tensor],
        n_aux: int,
        hidden: int,
        aliases: Mapping[str, str] | None = None,
        quantize: str = QUANTIZE_NONE,
    ) -> bytes:
        """With `quantize: fp8`: e4m3 `hidden_states` and fp32 `hidden_states_scales` [T, n_aux + 1, 1], what its
        fp8 backend loads."""
        from safetensors.torch import save

        n_tok = int(t["input_ids"].numel())
        states = torch.cat(
            [t["aux_hidden_states"].view(n_tok, n_aux, hidden), t["final_hidden_state"].view(n_tok, 1, hidden)], dim=1
        )
        ids = t["input_ids"].to(torch.int64).contiguous()
        if quantize == QUANTIZE_FP8:
            return fp8.sample_file(states, ids)
        return save({"hidden_states": states.contiguous(), "token_ids": ids})

    def deserialise(self, path: Path, n_aux: int) -> dict[str, torch.Tensor]:
        """FP8 states are dequantized to fp32 (`fp8.dequantize_checked`)."""
        from safetensors.torch import load_file

        raw = load_file(str(path))
        states = raw[fp8.STATES_KEY]
        if fp8.SCALES_KEY in raw:
            states = fp8.dequantize_checked(path, states, raw[fp8.SCALES_KEY])
        return {"aux_hidden_states": states[:, :n_aux].flatten(1), "final_hidden_state": states[:, n_aux]}

    def export(self, job: StatesExport) -> StatesExportSummary:
        import datasets

        hs_dir, out_dir, vocab = job.hs_dir, job.out_dir, job.draft_vocab_dir
        record = capture_record(capture_of_shards(hs_dir), SPECULATORS, PRE_NORM)
        nbytes, n_direct = self.write_from_shards(hs_dir, job.merged_dir, out_dir)
        drops = recorded_drops(hs_dir)
        table, n_train = _speculators_table(job.merged_dir, {d["sample_id"] for d in drops})
        n_eval = table.num_rows - n_train
        aux_layers = list(record["aux_layers"])
        _save_arrow(datasets.Dataset(table).with_format("torch"), out_dir)
        place_draft_vocab(
            out_dir,
            {name: None if vocab is None else vocab / name for name in (D2T_NPY, T2D_NPY)},
        )
        ratio = train_data_ratio(n_train, n_eval)
        fp8_states = record["quantize"] == QUANTIZE_FP8
        vllm_ids = [aux_layer_to_vllm_id(x) for x in aux_layers or []]
        paths = {
            "data": out_dir,
            "hidden_states": out_dir / SPECULATORS_HS_DIR,
            "train_data_ratio": ratio,
            "d2t": out_dir / D2T_NPY if vocab is not None else None,
            "t2d": out_dir / T2D_NPY if vocab is not None else None,
            "verifier": job.verifier,
        }
        summary = StatesExportSummary(
            format=self.export_format,
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
                "drafters": handoff(record, job.drafters, paths=paths),
            },
        )
        write_json_atomic(summary.to_dict(), out_dir / EXPORT_JSON)
        vocab_args = f"--d2t-path {paths['d2t']} --t2d-path {paths['t2d']}" if vocab is not None else None
        _write_speculators_readme(out_dir, summary, vocab_args)
        return summary


# The one registry: every layout the states can live in, by the name `hidden_states.layout` gives it, in the order
# the exports are written (and listed in the manifest).
LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (Layout(), SpecForgeLayout(), SpeculatorsLayout())}


def layout_of(name: str) -> Layout:
    """The layout object named `name` (`settings.LAYOUT_NAMES`)."""
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown hidden-states layout {name!r}; expected one of {tuple(LAYOUTS)}") from None


def trainer_layout(name: str) -> TrainerLayout:
    """The trainer layout named `name`; a ValueError for the shards, which are no trainer's."""
    layout = layout_of(name)
    if not isinstance(layout, TrainerLayout):
        raise ValueError(f"{name!r} is not a trainer layout; expected one of {trainer_layout_names()}")
    return layout


def trainer_layout_names() -> tuple[str, ...]:
    return tuple(n for n, layout in LAYOUTS.items() if isinstance(layout, TrainerLayout))


def plan_layout_target(
    layout: str,
    export_root: str | Path,
    merged_dir: str | Path,
    *,
    left_out: Collection[str] = (),
    quantize: str = QUANTIZE_NONE,
) -> LayoutTarget | None:
    """The per-sample file of every merged row in `layout` (None for 'shards'): `Layout.target` of the object the
    name gives."""
    return layout_of(layout).target(export_root, merged_dir, left_out=left_out, quantize=quantize)


def remove_stale_tmp(target: LayoutTarget, sample_ids: list[str]) -> int:
    """Delete the temporaries a killed run left beside these samples' trainer files (`storage.atomic_path` names
    them `.{name}.{hex}.tmp`): a partial copy of a sample's states. Only these samples' names, since other shard
    runs write into the same folders at the same time. Returns how many were removed."""
    names: dict[Path, set[str]] = {}
    for sid in sample_ids:
        rel = target.file_of.get(sid)
        if rel is not None:
            path = target.root / rel
            names.setdefault(path.parent, set()).add(path.name)
    removed = 0
    for folder, wanted in names.items():
        if not folder.is_dir():
            continue
        for entry in os.scandir(folder):
            name = entry.name
            if name[:1] == "." and name.endswith(TMP_SUFFIX) and name[1 : -len(TMP_SUFFIX)].rsplit(".", 1)[0] in wanted:
                os.unlink(entry.path)
                removed += 1
    return removed


def _own_storage(x: torch.Tensor) -> torch.Tensor:
    """`x` alone in its storage: torch.save writes a view's whole storage, so a sample sliced out of its batch
    would carry every other sample of the batch into its `.ckpt` (seen: 7.6x the sample's bytes)."""
    x = x.contiguous()
    if x.untyped_storage().nbytes() != x.numel() * x.element_size():
        x = x.clone()
    return x


class SampleFilesWriter:
    """Writes each sample's aux and final states straight into a trainer's layout (`TrainerLayout.serialise`), one
    file per sample, atomically, with its size and digest recorded (`files`, the shard index's `sample_files`, which
    `shard_status` checks); the shard file (`shard_writer.ShardWriter`) keeps the ids and masks (5 B/token).
    """

    def __init__(self, target: LayoutTarget, out_dir: Path, masks: dict[str, np.ndarray], n_aux: int):
        self._target, self._out_dir, self._masks, self._n_aux = target, out_dir, masks, n_aux
        remove_stale_tmp(target, list(masks))  # what a killed run of this shard was writing
        self.files: list[dict[str, Any]] = []

    def write_sample(self, sid: str, t: dict[str, torch.Tensor]) -> None:
        """Write sample `sid`'s file from its aux, final (in the layout's convention) and ids tensors."""
        rel = self._target.file_of.get(sid)
        if rel is None:
            raise ValueError(f"sample {sid!r} has no file in the {self._target.name} layout: the merged table changed")
        hidden = int(t["final_hidden_state"].shape[-1])
        t = {**t, "loss_mask": torch.from_numpy(self._masks[sid])}
        data = self._target.layout.serialise(t, self._n_aux, hidden, quantize=self._target.quantize)
        path = self._target.root / rel
        write_bytes_atomic(data, path)
        self.files.append(
            sample_file_entry(sid, os.path.relpath(path, self._out_dir), len(data), sample_file_digest(data))
        )


class ShardReader:
    """The four canonical tensors of each sample of one shard, whatever its layout (`open_shard`)."""

    def __init__(self, f: Any, meta: dict[str, Any], out_dir: Path):
        self._f, self.meta, self._out_dir = f, meta, out_dir
        self.fingerprint = fp = recorded_fingerprint(meta)
        self.layout = fp.layout
        self._layout = layout_of(self.layout)
        self._keys = set(f.keys())
        self._files = {d["sample_id"]: out_dir / d["path"] for d in meta.get("sample_files", [])}
        self._n_aux = len(fp.aux_layers)
        # FP8 states in the shard file itself (a trainer layout's files record their own quantization)
        self._fp8 = self._layout.states_in_shards and fp.quantize == QUANTIZE_FP8
        self._path = shard_paths(out_dir, int(meta["shard_index"]))[0]
        # the tensors the shard file holds of each sample
        self._own: tuple[str, ...] = ("input_ids", "loss_mask")
        if self._layout.states_in_shards:
            self._own = (*TENSOR_NAMES, SCALES_NAME) if self._fp8 else TENSOR_NAMES

    def has(self, sid: str) -> bool:
        if not all(tensor_key(sid, n) in self._keys for n in self._own):
            return False
        return self._layout.states_in_shards or (sid in self._files and self._files[sid].exists())

    def get(self, sid: str) -> dict[str, torch.Tensor]:
        """The four tensors; FP8 states dequantized to fp32 (`fp8.dequantize_checked`, which refuses bad scales
        and NaN values naming the file and sample)."""
        layout = self._layout
        if not isinstance(layout, TrainerLayout):
            out = {n: self._f.get_tensor(tensor_key(sid, n)) for n in TENSOR_NAMES}
            if self._fp8:
                out.update(self._dequantized(sid, out["aux_hidden_states"], out["final_hidden_state"]))
            return out
        out = {n: self._f.get_tensor(tensor_key(sid, n)) for n in ("input_ids", "loss_mask")}
        out.update(layout.deserialise(self._files[sid], self._n_aux))
        return {n: out[n] for n in TENSOR_NAMES}

    def _dequantized(self, sid: str, aux: torch.Tensor, final: torch.Tensor) -> dict[str, torch.Tensor]:
        t, h, n_aux = int(final.shape[0]), int(final.shape[-1]), self._n_aux
        states = torch.cat([aux.view(t, n_aux, h), final.view(t, 1, h)], dim=1)
        scales = self._f.get_tensor(tensor_key(sid, SCALES_NAME)).unsqueeze(-1)
        full = fp8.dequantize_checked(f"{self._path} sample {sid!r}", states, scales)
        return {"aux_hidden_states": full[:, :n_aux].flatten(1), "final_hidden_state": full[:, n_aux]}


@contextmanager
def open_shard(out_dir: str | Path, shard_index: int) -> Iterator[ShardReader]:
    """A reader over one shard's samples (states in the shard file, or in a trainer's files)."""
    from safetensors import safe_open

    st_path, idx_path = shard_paths(out_dir, shard_index)
    meta = read_index_meta(idx_path)
    with safe_open(str(st_path), framework="pt") as f:
        yield ShardReader(f, meta, Path(out_dir))


def iter_shard_samples(
    hs_dir: str | Path, *, skip_layout: str | None = None
) -> Iterator[tuple[str, dict[str, torch.Tensor], ShardReader]]:
    """(sample_id, the four tensors, the reader of its shard: its index metadata and fingerprint) for every sample
    of every shard, one at a time; shards already in `skip_layout` are passed over."""
    for shard, meta, sample_ids in shard_indexes(hs_dir):
        if skip_layout is not None and recorded_fingerprint(meta).layout == skip_layout:
            continue
        with open_shard(hs_dir, shard) as reader:
            for sid in sample_ids:
                yield sid, reader.get(sid), reader


def direct_samples(hs_dir: str | Path, target: LayoutTarget) -> set[str]:
    """Samples whose states extraction already wrote in `target`'s layout, checked to sit where the current merged
    table puts them."""
    found: set[str] = set()
    for _shard, meta, _ids in shard_indexes(hs_dir):
        if recorded_fingerprint(meta).layout != target.name:
            continue
        for d in meta.get("sample_files", []):
            want = target.file_of.get(d["sample_id"])
            if want is None or (Path(hs_dir) / d["path"]).resolve() != (target.root / want).resolve():
                raise ValueError(
                    f"{hs_dir}: shard {meta['shard_index']} wrote {d['sample_id']!r} to {d['path']}, but the merged "
                    f"table now puts it at {target.root / str(want)}: re-extract the shard"
                )
            found.add(d["sample_id"])
    return found


def safe_file_stem(sample_id: str) -> str:
    if not sample_id or "/" in sample_id or "\\" in sample_id or sample_id.startswith(".") or "\x00" in sample_id:
        raise ValueError(f"sample_id {sample_id!r} cannot name a file: SpecForge features are one file per sample id")
    return sample_id


def load_sample(
    out_dir: str | Path, sample_id: str, *, index: dict[str, SampleLocation] | None = None
) -> dict[str, torch.Tensor]:
    """The four tensors of one sample, from the shard file or the trainer layout the shard was written in (keys
    without the sample_id prefix). Pass a `build_sample_index` result as `index` when loading many samples, to avoid
    rescanning the index files each time."""
    loc = (index if index is not None else build_sample_index(out_dir)).get(sample_id)
    if loc is None:
        raise KeyError(f"sample {sample_id!r} not in any shard index under {out_dir}")
    with open_shard(out_dir, loc.shard_index) as reader:
        return reader.get(sample_id)


def _speculators_table(merged_dir: str | Path, left_out: set[str]) -> tuple[pa.Table, int]:
    """The merged rows as speculators' dataset columns, train rows (merged order) then eval rows, less the rows
    `left_out` (row i is read from hs_{i}: `SpeculatorsLayout.file_names`); and n_train."""
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
    # Each hs_{i} stacks the aux layers and then the final state (`SpeculatorsLayout.serialise`): n_aux + 1 slots.
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
    write_readme(out_dir, lines)
