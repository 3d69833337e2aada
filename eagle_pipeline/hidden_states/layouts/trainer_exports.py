"""What every trainer layout's files and export share, whichever layout they are in (`trainer_layouts.LAYOUTS` holds
the objects that differ): the export's summary and manifest names, the merged rows and splits the files are planned
over, the draft-vocabulary files copied beside the states, the atomic README, and
speculators' `--train-data-ratio` arithmetic."""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from eagle_pipeline.drafter_types import DEFAULT_DRAFTERS
from eagle_pipeline.hidden_states.settings import SHARDS
from eagle_pipeline.hidden_states.store.shard_index import recorded_drops
from eagle_pipeline.shared.storage import atomic_path

# The export folder's record of what it was built from (the layer guard and check-drafter read it).
EXPORT_MANIFEST = "manifest.json"
EXPORT_JSON = "export.json"  # each layout's summary, in its own folder
SPLITS = ("train", "eval")


@dataclass(frozen=True)
class StatesExport:
    """One trainer export (`TrainerLayout.export`): from the finished shards under `hs_dir` and the merged rows, the
    trainer's folder at `out_dir`. `draft_vocab_dir`: the draft vocabulary copied beside the states (None: none
    built); `drafters`: the drafter types to hand off; `extraction_layout`: where extraction wrote the states
    (`hidden_states.layout`); `verifier`: the target the commands name (None: a placeholder)."""

    hs_dir: Path
    merged_dir: Path
    out_dir: Path
    draft_vocab_dir: Path | None = None
    drafters: Sequence[Any] = DEFAULT_DRAFTERS
    extraction_layout: str = SHARDS
    verifier: str | None = None

    def __post_init__(self) -> None:
        for name in ("hs_dir", "merged_dir", "out_dir", "draft_vocab_dir"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value))


@dataclass
class StatesExportSummary:
    format: str
    path: str
    rows: dict[str, int]
    tokens: dict[str, int]
    bytes_written: int
    final_state: str  # the convention of the final state in the files written
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def merged_tables(merged_dir: str | Path, columns: list[str]) -> list[pa.Table]:
    """The merged part files in global row order, as extraction reads them (`merged.merged_parts`), so the trainer
    files are planned over exactly the rows the shards hold."""
    import pyarrow.parquet as pq

    from eagle_pipeline.hidden_states.store.merged import merged_parts

    return [pq.read_table(p, columns=columns) for p in merged_parts(merged_dir)]


def merged_splits(merged_dir: str | Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for t in merged_tables(merged_dir, ["sample_id", "split"]):
        out.update(zip(t.column("sample_id").to_pylist(), t.column("split").to_pylist()))
    return out


def dropped_ids(hs_dir: str | Path) -> set[str]:
    return {d["sample_id"] for d in recorded_drops(hs_dir)}


def split_counts(merged_dir: str | Path, left_out: set[str]) -> tuple[dict[str, int], dict[str, int]]:
    """(rows, tokens) per split of the merged table, less the rows `left_out`."""
    rows, tokens = dict.fromkeys(SPLITS, 0), dict.fromkeys(SPLITS, 0)
    for t in merged_tables(merged_dir, ["sample_id", "split", "n_tokens"]):
        for sid, split, n in zip(*(t.column(c).to_pylist() for c in ("sample_id", "split", "n_tokens"))):
            if sid in left_out:
                continue
            rows[split] += 1
            tokens[split] += int(n)
    return rows, tokens


def check_complete(found: set[str], expected: Mapping[str, str], hs_dir: str | Path) -> None:
    missing = sorted(set(expected) - found)
    if missing:
        raise ValueError(
            f"{len(missing)} merged rows have no hidden states under {hs_dir} (e.g. {missing[:5]}): extract every "
            "shard before exporting"
        )


def place_draft_vocab(out_dir: Path, sources: Mapping[str, str | Path | None]) -> None:
    """Copy each draft-vocabulary file to `out_dir/{name}` from its source, or, where there is none, remove the copy an
    earlier export left: a mapping from another merged table must not sit beside these states as if it were theirs
    (the README and the commands name the files only when they were copied)."""
    for name, src in sources.items():
        if src is None:
            (out_dir / name).unlink(missing_ok=True)
            continue
        with atomic_path(out_dir / name) as tmp:
            shutil.copyfile(src, tmp)


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


def write_readme(out_dir: Path, lines: list[str]) -> None:
    with atomic_path(out_dir / "README.md") as tmp:
        tmp.write_text("\n".join(lines))
