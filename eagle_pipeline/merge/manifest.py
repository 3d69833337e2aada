"""The merge's settings, inputs and manifest, and the merged table's schema and file names (`merge_datasets` writes
them, the reader, checks, exports and extraction read them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from eagle_pipeline.merge.turns import LOSS_ON_MODES
from eagle_pipeline.shared.storage import read_json

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


def merged_shard_paths(out_dir: str | Path) -> list[Path]:
    """The files of the merged table, in merged row order: the shards its manifest lists (the committed set; the
    merge deletes stale ones only after writing it), or every `part-*.parquet` by name where there is no manifest
    (a table written by hand, tests). The one definition every reader uses (merge reader, checks, extraction)."""
    out_dir = Path(out_dir)
    if (out_dir / MANIFEST_NAME).exists():
        return [out_dir / sh["path"] for sh in MergeManifest.read(out_dir).shards]
    return sorted(out_dir.glob(SHARD_GLOB), key=lambda p: p.name)


# The draft vocabulary's size when none is given (the `merge.draft_vocab_size` setting).
DEFAULT_DRAFT_VOCAB_SIZE = 32_000
# Setting -> (type, lower bound, upper bound, upper bound excluded) of each number.
_NUMBERS: dict[str, tuple[type, float | None, float | None, bool]] = {
    "seed": (int, None, None, False),
    "eval_fraction": (float, 0.0, 1.0, True),
    "rows_per_shard": (int, 1, None, False),
    "draft_vocab_size": (int, 1, None, False),
}


@dataclass(frozen=True)
class MergeSettings:
    """How datasets are combined (and the size of the draft vocabulary built from the result): the `merge` section
    of the configuration is this class. Every random choice is a keyed hash of (seed, sample_id), so a row's fate
    does not depend on which other rows are present or on input row order."""

    seed: int = 0
    # Whole conversations only (turns.select_groups): a fraction of a dataset's conversations, a cap never exceeded.
    weights: Mapping[str, float] = field(default_factory=dict)  # dataset -> keep fraction in [0, 1]
    caps: Mapping[str, int] = field(default_factory=dict)  # dataset -> max rows
    dedup: bool = True
    eval_fraction: float = 0.0
    rows_per_shard: int = 10_000
    loss_on: str = "last_turn"  # or "all_turns": fold a conversation's verbatim turns into its later rows
    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB_SIZE  # read by the draft vocabulary, not by the merge

    def validate(self, datasets: list[str]) -> None:
        """Raise ValueError naming every problem: `merge_settings_problems`, and tables naming datasets that are
        not being merged."""
        problems = [f"{'.'.join(map(str, path))}: {message}" for path, message in merge_settings_problems(self)]
        known = set(datasets)
        for name, table in (("weights", self.weights), ("caps", self.caps)):
            unknown = sorted(set(table) - known)
            if unknown:
                problems.append(f"{name} name datasets not being merged: {unknown}")
        if problems:
            raise ValueError("invalid merge settings: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        """The settings the manifest records: those of the merged table (not the draft vocabulary's size)."""
        d = asdict(self)
        del d["draft_vocab_size"]
        d["weights"] = {k: float(v) for k, v in sorted(self.weights.items())}
        d["caps"] = {k: int(v) for k, v in sorted(self.caps.items())}
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MergeSettings:
        """From plain values that `merge_settings_problems` found valid (numbers as their type, tables copied)."""
        values = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        for name, (kind, *_) in _NUMBERS.items():
            if name in values:
                values[name] = kind(values[name])
        for name in ("weights", "caps"):
            values[name] = dict(values.get(name) or {})
        return cls(**values)


def merge_settings_problems(data: MergeSettings | Mapping[str, Any]) -> list[tuple[tuple[Any, ...], str]]:
    """Every problem of merge settings (an object, or the plain mapping of the configuration's `merge` section), as
    (path within the section, message); [] when valid. The one validation of merge settings: `validate` and the
    configuration loader report exactly these."""
    if isinstance(data, MergeSettings):
        values: Mapping[str, Any] = {k: getattr(data, k) for k in MergeSettings.__dataclass_fields__}
    elif isinstance(data, Mapping):
        values = data
    else:
        return [((), f"merge settings must be a mapping, got {type(data).__name__}")]
    problems: list[tuple[tuple[Any, ...], str]] = [
        ((k,), "unknown key") for k in values if k not in MergeSettings.__dataclass_fields__
    ]
    for name, (kind, lo, hi, open_hi) in _NUMBERS.items():
        if name in values:
            problems += [((name,), m) for m in _number_problems(values[name], kind, lo, hi, open_hi)]
    # Upsampling would duplicate sample ids (and their hidden states); repeat in the trainer instead.
    for name, kind, lo, hi in (("weights", float, 0.0, 1.0), ("caps", int, 0, None)):
        table = values.get(name) or {}
        if not isinstance(table, Mapping):
            problems.append(((name,), f"expected a mapping of dataset -> number, got {type(table).__name__}"))
            continue
        for ds, v in table.items():
            problems += [((name, ds), m) for m in _number_problems(v, kind, lo, hi, False)]
    if not isinstance(values.get("dedup", True), bool):
        problems.append((("dedup",), f"expected true or false, got {values['dedup']!r}"))
    if values.get("loss_on", "last_turn") not in LOSS_ON_MODES:
        problems.append((("loss_on",), f"{values['loss_on']!r}: must be one of {list(LOSS_ON_MODES)}"))
    return problems


def _number_problems(value: Any, kind: type, lo: float | None, hi: float | None, open_hi: bool) -> list[str]:
    """[] or the one problem of `value` as a setting of type `kind` within [lo, hi] (or [lo, hi))."""
    whole = isinstance(value, float) and value.is_integer()
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (kind is int and not (isinstance(value, int) or whole))
    ):
        return [f"expected {'int' if kind is int else 'number'}, got {type(value).__name__} {value!r}"]
    below = lo is not None and value < lo
    if hi is not None and (below or (value >= hi if open_hi else value > hi)):
        return [f"{value}: must be in [{lo:g}, {hi:g}{')' if open_hi else ']'}"]
    if below:
        return [f"{value}: must be a non-negative integer" if (kind, lo) == (int, 0) else f"{value}: must be >= {lo}"]
    return []


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
