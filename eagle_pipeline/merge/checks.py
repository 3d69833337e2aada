"""Checks on a merged dataset. Pure functions over the shards; each returns a `shared.checks.CheckResult`, its figures
in `counts` (`counts["failing_rows"]` the failing rows, or shards for the hash check)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle_pipeline.merge.arrow_ops import row_of_position
from eagle_pipeline.merge.manifest import SHARD_GLOB, MergeManifest, merged_shard_paths
from eagle_pipeline.merge.reader import iter_merged_shards
from eagle_pipeline.shared.arrow import as_array, list_parts
from eagle_pipeline.shared.checks import CheckResult, CheckSpec
from eagle_pipeline.shared.storage import file_sha256

# Failing ids are listed up to this many; `counts["failing_rows"]` always holds the full number.
MAX_LISTED_FAILURES = 100
# Streaming granularity for the token-level checks: bounded memory whatever the shard size.
CHECK_BATCH_ROWS = 2048


def _result(name: str, counts: dict[str, int], failing: list[str], ok_msg: str, bad_msg: str) -> CheckResult:
    passed = counts.get("failing_rows", 0) == 0
    return CheckResult(
        name=name,
        passed=passed,
        checked=counts.get("rows", counts.get("listed", 0)),  # rows (shards, for the hash check)
        failing=counts.get("failing_rows", 0),
        failing_sample_ids=failing[:MAX_LISTED_FAILURES],
        detail=ok_msg if passed else bad_msg,
        counts=counts,
    )


def check_row_count(out_dir: str | Path, expected_rows: int) -> CheckResult:
    """Rows in the shards (from Parquet footers) equal `expected_rows`."""
    rows = sum(pq.ParquetFile(p).metadata.num_rows for p in merged_shard_paths(out_dir))
    counts = {"rows": rows, "expected_rows": int(expected_rows), "failing_rows": abs(rows - int(expected_rows))}
    return _result("row_count", counts, [], f"{rows} rows as expected", f"{rows} rows, expected {expected_rows}")


def check_unique_sample_ids(out_dir: str | Path) -> CheckResult:
    """Every sample_id occurs once across all shards."""
    ids = pa.chunked_array(
        [t["sample_id"].combine_chunks() for t in iter_merged_shards(out_dir, ["sample_id"])], pa.string()
    )
    vc = pc.value_counts(ids)
    dup_mask = pc.greater(vc.field("counts"), 1)
    dups = vc.field("values").filter(dup_mask).to_pylist()
    extra = int(pc.sum(pc.subtract(vc.field("counts").filter(dup_mask), 1)).as_py() or 0)
    counts = {"rows": len(ids), "distinct": len(vc), "duplicated_ids": len(dups), "failing_rows": extra}
    return _result(
        "unique_sample_ids",
        counts,
        sorted(dups),
        "all sample ids unique",
        f"{len(dups)} sample ids occur more than once",
    )


def check_loss_mask_aligned(out_dir: str | Path) -> CheckResult:
    """loss_mask has the length of input_ids, n_tokens matches, and the mask holds only 0/1."""
    rows = misaligned = bad_n_tokens = non_binary = 0
    failing: list[str] = []
    for t in iter_merged_shards(
        out_dir, ["sample_id", "input_ids", "loss_mask", "n_tokens"], batch_rows=CHECK_BATCH_ROWS
    ):
        ids_len = np.asarray(pc.list_value_length(as_array(t["input_ids"])), dtype=np.int64)
        mask_len, mask_vals = list_parts(t["loss_mask"], pa.int8())
        bad_len = ids_len != mask_len
        bad_n = np.asarray(t["n_tokens"], dtype=np.int64) != ids_len
        bad_vals = np.zeros(len(ids_len), dtype=bool)
        off_vals = np.flatnonzero((mask_vals != 0) & (mask_vals != 1))
        if len(off_vals):
            bad_vals[row_of_position(mask_len, off_vals)] = True
        bad = bad_len | bad_n | bad_vals
        rows += len(bad)
        misaligned += int(bad_len.sum())
        bad_n_tokens += int(bad_n.sum())
        non_binary += int(bad_vals.sum())
        if bad.any():
            failing.extend(t["sample_id"].filter(pa.array(bad)).to_pylist())
    counts = {
        "rows": rows,
        "misaligned": misaligned,
        "n_tokens_mismatch": bad_n_tokens,
        "non_binary_mask": non_binary,
        "failing_rows": len(failing),
    }
    return _result("loss_mask_aligned", counts, failing, "masks aligned", f"{len(failing)} rows with a bad loss mask")


def check_supervised_spans_end_with_eot(out_dir: str | Path, eot_id: int) -> CheckResult:
    """Every maximal run of loss_mask == 1 ends on `eot_id` (a cut-off or spliced target shows up here).

    Rows whose mask is misaligned cannot be checked and count as failing.
    """
    rows = spans = bad_spans = unchecked = no_supervised = 0
    failing: list[str] = []
    for t in iter_merged_shards(out_dir, ["sample_id", "input_ids", "loss_mask"], batch_rows=CHECK_BATCH_ROWS):
        ids_len = np.asarray(pc.list_value_length(as_array(t["input_ids"])), dtype=np.int64)
        mask_len = np.asarray(pc.list_value_length(as_array(t["loss_mask"])), dtype=np.int64)
        aligned = ids_len == mask_len
        bad_row = ~aligned
        unchecked += int(bad_row.sum())
        if aligned.any():
            sel = pa.array(aligned)
            lengths, ids = list_parts(as_array(t["input_ids"]).filter(sel), pa.int32())
            _, mask = list_parts(as_array(t["loss_mask"]).filter(sel), pa.int8())
            on = mask == 1
            # A span ends where the next position is off or the row ends.
            next_on = np.zeros_like(on)
            next_on[:-1] = on[1:]
            row_ends = np.cumsum(lengths)[lengths > 0] - 1
            next_on[row_ends] = False
            ends = np.flatnonzero(on & ~next_on)
            bad_ends = ends[ids[ends] != eot_id]
            spans += len(ends)
            bad_spans += len(bad_ends)
            supervised_rows = np.zeros(len(lengths), dtype=bool)
            supervised_rows[row_of_position(lengths, ends)] = True
            no_supervised += int((~supervised_rows).sum())
            aligned_rows = np.flatnonzero(aligned)
            bad_row[aligned_rows[row_of_position(lengths, bad_ends)]] = True
        rows += len(ids_len)
        if bad_row.any():
            failing.extend(t["sample_id"].filter(pa.array(bad_row)).to_pylist())
    counts = {
        "rows": rows,
        "spans": spans,
        "spans_not_ending_in_eot": bad_spans,
        "unchecked_misaligned": unchecked,
        "rows_without_supervised_tokens": no_supervised,
        "failing_rows": len(failing),
    }
    return _result(
        "supervised_spans_end_with_eot",
        counts,
        failing,
        f"all {spans} supervised spans end with {eot_id}",
        f"{len(failing)} rows have a supervised span not ending with {eot_id} (or a misaligned mask)",
    )


def check_shard_hashes(out_dir: str | Path) -> CheckResult:
    """The shards on disk are exactly those manifest.json lists, with the recorded sha256.

    Catches a merge interrupted between writing shards and committing its manifest, and hand edits.
    `failing_sample_ids` is empty here; `counts` says what differs.
    """
    out_dir = Path(out_dir)
    listed = {sh["path"]: sh["sha256"] for sh in MergeManifest.read(out_dir).shards}
    present = {p.name for p in out_dir.glob(SHARD_GLOB)}
    missing = sorted(set(listed) - present)
    unlisted = sorted(present - set(listed))
    changed = sorted(n for n in set(listed) & present if file_sha256(out_dir / n) != listed[n])
    counts = {
        "listed": len(listed),
        "missing": len(missing),
        "unlisted": len(unlisted),
        "hash_mismatch": len(changed),
        "failing_rows": len(missing) + len(unlisted) + len(changed),
    }
    detail = f"missing {missing}, unlisted {unlisted}, changed {changed}"
    return _result("shard_hashes", counts, [], f"{len(listed)} shards match the manifest", detail)


def check_row_count_matches_admitted(out_dir: str | Path) -> CheckResult:
    """`check_row_count` against the rows the manifest says were admitted: rows read from each dataset minus every
    counted exclusion (audit filters, dedup, caps, weights)."""
    m = MergeManifest.read(out_dir)
    admitted = sum(m.input_rows.values()) - sum(sum(reasons.values()) for reasons in m.excluded.values())
    return check_row_count(out_dir, admitted)


@dataclass(frozen=True)
class MergedCheckContext:
    """What a check of the merged table runs over: the merged folder, and how to get the target's end-of-turn id
    (called only by the check that needs it: it loads the tokenizer)."""

    out_dir: Path
    eot_id: Callable[[], int]


# The merged table's checks (the Dagster shell declares one blocking check per entry; nothing else names them).
MERGED_CHECKS: tuple[CheckSpec[MergedCheckContext], ...] = (
    CheckSpec(
        "rows_match_admitted",
        "Merged rows equal the rows admitted by the audit.",
        "row_count",
        lambda c: check_row_count_matches_admitted(c.out_dir),
    ),
    CheckSpec(
        "sample_ids_unique",
        "No sample_id appears twice.",
        "unique_sample_ids",
        lambda c: check_unique_sample_ids(c.out_dir),
    ),
    CheckSpec(
        "loss_mask_aligned",
        "Every loss mask is exactly as long as its input_ids.",
        "loss_mask_aligned",
        lambda c: check_loss_mask_aligned(c.out_dir),
    ),
    CheckSpec(
        "spans_end_with_eot",
        "Every supervised span ends with the end-of-turn id.",
        "supervised_spans_end_with_eot",
        lambda c: check_supervised_spans_end_with_eot(c.out_dir, c.eot_id()),
    ),
)
