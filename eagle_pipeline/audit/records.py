"""Audit results on disk: the audit of one token-samples file, run once and stored bound to that file's sha256; each
check's verdict; and the cross-run gate the merge enforces.

The audit of a dataset's token samples runs once (`audit_token_samples`, called where the file is written) and is
stored as `audit/{dataset}.json`: the report, the rows to keep, the sha256 of the token-samples file it judged and an
`audit_key` naming the settings, tokenizer and profile it ran under. Every asset check and the merge read that
result through `current_audit`, which recomputes it when it is missing or bound to another file or other settings,
so nothing ever passes on an old report.

Dagster's blocking checks hold only inside one run. Each audit check therefore also records its verdict beside the
data (`audit/{dataset}/{gate}.json`, with the sha256 and audit key it judged), and the merge refuses to start unless,
for every dataset, every gate ran on the *current* token samples under the current settings and every blocking gate
passed. This holds for UI clicks, schedules, backfills and the CLI alike, and does not depend on the Dagster instance
database.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as _dt
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eagle_pipeline.audit.report import run_audit
from eagle_pipeline.audit.spec import GATES, AuditSettings
from eagle_pipeline.shared.storage import DataRoot, file_sha256, read_json, write_json_atomic
from eagle_pipeline.tokens.tokenizer import EncodingMemo

# The keep mask is stored as np.packbits (big-endian bit order), base64: one bit per row.
_MASK_ENCODING = "packbits-base64"


class AuditRecordError(RuntimeError):
    """The stored audit could not be produced or read; the message names the file."""


def audit_key(tokenizer: Any, profile_ids: Any, settings: AuditSettings) -> str:
    """What an audit result depends on besides the token samples: the settings, the tokenizer's fingerprint and the
    profile's structural ids. A stored result or verdict with another key is stale."""
    is_instance = dataclasses.is_dataclass(profile_ids) and not isinstance(profile_ids, type)
    profile = dataclasses.asdict(profile_ids) if is_instance else repr(profile_ids)
    blob = json.dumps(
        {"settings": settings.to_dict(), "tokenizer": tokenizer.fingerprint(), "profile": profile},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class StoredAudit:
    """The audit of one token-samples file: `report` is `AuditReport.to_dict()`, `keep_mask` the rows to keep."""

    dataset: str
    tokens_sha256: str
    audit_key: str
    report: dict[str, Any]
    keep_mask: np.ndarray

    @property
    def passed(self) -> bool:
        return bool(self.report["passed"])

    @property
    def excluded_counts(self) -> dict[str, int]:
        """Rows each gate excludes (a row failing two gates counts for both)."""
        return {k: int(v) for k, v in self.report["excluded_counts"].items()}

    def gate(self, name: str) -> dict[str, Any]:
        """One gate's result (`GateResult.to_dict()`); KeyError naming the gates run otherwise."""
        gates = self.report["gates"]
        if name not in gates:
            raise KeyError(f"gate {name!r} is not in the audit of {self.dataset}; run: {sorted(gates)}")
        return gates[name]


def _file_stamp(path: Path) -> tuple[int, ...]:
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


# Readers in one process (the checks run alone, the audit view) need the sha256 of the same file: it is hashed once
# per process while the file's stamp (device, inode, size, mtime, ctime) stays the same; storage's atomic writes give
# every new file a new inode. The merge's gate (audits_for_merge) always hashes afresh, so a verdict never stands for
# another file.
_sha_by_stamp: dict[str, tuple[tuple[int, ...], str]] = {}


def _tokens_sha256(path: Path) -> str:
    stamp = _file_stamp(path)
    known = _sha_by_stamp.get(str(path))
    if known is not None and known[0] == stamp:
        return known[1]
    sha = file_sha256(path)
    if _file_stamp(path) == stamp:
        _sha_by_stamp[str(path)] = (stamp, sha)
    return sha


def audit_token_samples(
    root: DataRoot,
    dataset: str,
    tokenizer: Any,
    profile_ids: Any,
    settings: AuditSettings,
    *,
    table: pa.Table | None = None,
    tokens_sha256: str | None = None,
    memo: EncodingMemo | None = None,
) -> StoredAudit:
    """Run the whole audit once over `tokens/{dataset}.parquet` and store it, bound to the file's sha256.

    `table` and `tokens_sha256` may be given by the writer of the file, which holds both (they must be that file's
    content and hash), with `memo`, the encodings its reconstruction made (run_audit); otherwise the file is read
    and hashed here, and refused if it is replaced meanwhile.
    """
    path = root.tokens(dataset)
    if not path.exists():
        raise AuditRecordError(f"{dataset}: token samples not materialized ({path})")
    if table is None or tokens_sha256 is None:
        stamp = _file_stamp(path)
        tokens_sha256 = file_sha256(path)
        table = pq.read_table(path)
        if _file_stamp(path) != stamp:
            raise AuditRecordError(f"{path} was replaced while it was being audited; run the audit again")
    report = run_audit(table, tokenizer, profile_ids, settings, memo=memo)
    mask = np.asarray(report.filter_mask, dtype=bool)
    key = audit_key(tokenizer, profile_ids, settings)
    body = report.to_dict()
    write_json_atomic(
        {
            **body,
            "tokens_sha256": tokens_sha256,
            "audit_key": key,
            "keep_mask": {
                "encoding": _MASK_ENCODING,
                "n_rows": int(mask.size),
                "data": base64.b64encode(np.packbits(mask).tobytes()).decode("ascii"),
            },
        },
        root.audit_report(dataset),
    )
    return StoredAudit(dataset, tokens_sha256, key, body, mask)


def read_stored_audit(root: DataRoot, dataset: str, *, tokens_sha256: str, key: str) -> StoredAudit | None:
    """The stored audit of `dataset` if it judged the file with `tokens_sha256` under `key`; None when it is missing,
    stale, damaged, or written by a version that stored no keep mask."""
    path = root.audit_report(dataset)
    if not path.exists():
        return None
    try:
        raw = read_json(path)
    except (OSError, ValueError):
        return None  # unreadable: recomputed, never trusted
    if not isinstance(raw, Mapping) or raw.get("tokens_sha256") != tokens_sha256 or raw.get("audit_key") != key:
        return None
    stored_mask = raw.get("keep_mask")
    if not isinstance(stored_mask, Mapping) or stored_mask.get("encoding") != _MASK_ENCODING:
        return None
    report = {k: v for k, v in raw.items() if k not in ("tokens_sha256", "audit_key", "keep_mask")}
    try:
        n = int(stored_mask["n_rows"])
        packed = np.frombuffer(base64.b64decode(stored_mask["data"], validate=True), dtype=np.uint8)
        mask = np.unpackbits(packed, count=n).astype(bool)
    except (KeyError, TypeError, ValueError):  # binascii.Error is a ValueError
        return None
    if mask.size != n or report.get("n_rows") != n or not isinstance(report.get("gates"), Mapping):
        return None  # damaged: recomputed, never trusted
    return StoredAudit(dataset, tokens_sha256, key, report, mask)


def current_audit(
    root: DataRoot, dataset: str, tokenizer: Any, profile_ids: Any, settings: AuditSettings
) -> StoredAudit:
    """The audit of the current `tokens/{dataset}.parquet` under the current settings: the stored one when it is bound
    to this file and these settings, else computed now (and stored)."""
    path = root.tokens(dataset)
    if not path.exists():
        raise AuditRecordError(f"{dataset}: token samples not materialized ({path})")
    sha = _tokens_sha256(path)
    stored = read_stored_audit(root, dataset, tokens_sha256=sha, key=audit_key(tokenizer, profile_ids, settings))
    if stored is not None:
        return stored
    return audit_token_samples(root, dataset, tokenizer, profile_ids, settings)


def gate_record_path(root: DataRoot, dataset: str, gate: str) -> Path:
    return root.root / "audit" / dataset / f"{gate}.json"


def write_gate_record(
    root: DataRoot,
    dataset: str,
    gate: str,
    *,
    tokens_sha256: str,
    action: str,
    blocking_failed: bool,
    checked: int,
    failing: int,
    audit_key: str,
) -> Path:
    """Record one gate's verdict on one dataset's token samples."""
    return write_json_atomic(
        {
            "dataset": dataset,
            "gate": gate,
            "tokens_sha256": tokens_sha256,
            "audit_key": audit_key,
            "action": action,
            "blocking_failed": bool(blocking_failed),
            "checked": int(checked),
            "failing": int(failing),
            "at": _dt.datetime.now(_dt.UTC).isoformat(),
        },
        gate_record_path(root, dataset, gate),
    )


def record_gate_verdict(root: DataRoot, audit: StoredAudit, gate: str) -> dict[str, Any]:
    """Record `gate`'s verdict from a stored audit (what one asset check does) and return that gate's result."""
    result = audit.gate(gate)
    write_gate_record(
        root,
        audit.dataset,
        gate,
        tokens_sha256=audit.tokens_sha256,
        audit_key=audit.audit_key,
        action=result["action"],
        blocking_failed=result["blocking"],
        checked=result["checked"],
        failing=result["failing"],
    )
    return result


@dataclass(frozen=True)
class GateProblem:
    dataset: str
    gate: str
    reason: str

    def __str__(self) -> str:
        return f"{self.dataset}/{self.gate}: {self.reason}"


def _verdict_problems(root: DataRoot, ds: str, gates: list[str], sha: str, key: str) -> list[GateProblem]:
    problems = []
    for gate in gates:
        path = gate_record_path(root, ds, gate)
        if not path.exists():
            problems.append(GateProblem(ds, gate, "audit check never ran"))
            continue
        rec = read_json(path)
        if rec.get("tokens_sha256") != sha:
            problems.append(GateProblem(ds, gate, "audit check did not run on the latest token samples"))
        elif rec.get("audit_key") != key:
            problems.append(
                GateProblem(ds, gate, "audit check ran under other audit settings, tokenizer or model profile")
            )
        elif rec.get("blocking_failed", True):
            problems.append(
                GateProblem(ds, gate, f"blocking audit failed ({rec.get('failing')} of {rec.get('checked')} rows)")
            )
    return problems


@dataclass(frozen=True)
class MergeVerdict:
    """Whether one dataset's latest token samples are fit to merge (`problems` empty) and, when there is one, the
    stored audit of that very file under the current settings (also for an unfit dataset: its gate results)."""

    dataset: str
    problems: list[GateProblem]
    audit: StoredAudit | None

    @property
    def fit(self) -> bool:
        return not self.problems


def merge_verdict(
    root: DataRoot, dataset: str, tokenizer: Any, profile_ids: Any, settings: AuditSettings
) -> MergeVerdict:
    """The merge's verdict on one dataset: every reason it must not be merged (a missing verdict, one reached on
    other token samples or under other settings, tokenizer or profile, a failed blocking gate) and its stored audit.
    The merge (`audits_for_merge`) and the audit view read this one function."""
    key = audit_key(tokenizer, profile_ids, settings)
    tokens = root.tokens(dataset)
    if not tokens.exists():
        return MergeVerdict(dataset, [GateProblem(dataset, "*", "token samples not materialized")], None)
    sha = file_sha256(tokens)
    problems = _verdict_problems(root, dataset, [g.name for g in GATES], sha, key)
    audit = read_stored_audit(root, dataset, tokens_sha256=sha, key=key)
    if problems:
        return MergeVerdict(dataset, problems, audit)
    if audit is None:
        audit = audit_token_samples(root, dataset, tokenizer, profile_ids, settings)
    if audit.tokens_sha256 != sha:
        problems.append(GateProblem(dataset, "*", "token samples were replaced while the merge checked them"))
    elif not audit.passed:  # cannot happen while every verdict passed; a guard, not a path
        problems.append(GateProblem(dataset, "*", f"audit blocked by {audit.report['blocking_failed']}"))
    return MergeVerdict(dataset, problems, audit)


def audits_for_merge(
    root: DataRoot, datasets: Iterable[str], tokenizer: Any, profile_ids: Any, settings: AuditSettings
) -> tuple[list[GateProblem], dict[str, StoredAudit]]:
    """What the merge needs from the audit: every dataset's problems (`merge_verdict`) and, when there is none, each
    dataset's stored audit (its rows to keep), bound to the very token-samples file whose verdicts were checked."""
    problems: list[GateProblem] = []
    audits: dict[str, StoredAudit] = {}
    for ds in datasets:
        verdict = merge_verdict(root, ds, tokenizer, profile_ids, settings)
        problems.extend(verdict.problems)
        if verdict.fit and verdict.audit is not None:
            audits[ds] = verdict.audit
    return problems, (audits if not problems else {})


def audit_stamps(root: DataRoot, upstream_versions: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """What an output built from the merged table records of the dataset audits behind it: each dataset's audit
    report and the token samples the merge took (`upstream_versions`: the merged manifest's sha256 prefixes). A
    dataset with no audit report (a table merged outside the pipeline, which audits nothing) is left out."""
    return {
        ds: {"report": str(root.audit_report(ds)), "tokens_sha256": v}
        for ds, v in sorted(upstream_versions.items())
        if root.audit_report(ds).exists()
    }


def stale_audit_stamps(stamps: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """The datasets whose audit, as recorded in `stamps` (`audit_stamps`), is no longer the current one, each with
    why: its token samples were rebuilt and audited again since, or its audit now fails (other settings, another
    tokenizer), or the report is gone. An output built from such rows is stale, whatever its own checks said."""
    stale: dict[str, str] = {}
    for ds, stamp in stamps.items():
        path = Path(stamp["report"])
        if not path.exists():
            stale[ds] = f"its audit report {path} is gone"
            continue
        current = read_json(path)
        verdict = "passed" if current.get("passed") else "FAILED"
        if not str(current.get("tokens_sha256", "")).startswith(stamp["tokens_sha256"]):
            stale[ds] = f"its token samples were rebuilt and audited again since (that audit {verdict})"
        elif not current.get("passed"):
            stale[ds] = "its audit now fails (other audit settings, tokenizer or profile)"
    return stale


def describe_stale(stale: Mapping[str, str]) -> str:
    """`stale_audit_stamps` in one line, e.g. 'B1: its audit now fails (...); B6: ...'."""
    return "; ".join(f"{ds}: {why}" for ds, why in sorted(stale.items()))
