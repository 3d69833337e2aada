"""A shard's semantic audit, computed once and stored beside the shards (`audit/shard-NNNNN.audit.json`), and the
summaries of the stored audits that the export manifest and the UI show. The checks themselves are in `audit.py`."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from eagle_pipeline.hidden_states.checks.audit import AUDIT_CHECKS, FAIL, AuditCheck, audit_shard
from eagle_pipeline.hidden_states.store.format import SAMPLE_FILE_DIGEST, read_index_meta, shard_paths
from eagle_pipeline.hidden_states.store.head import recorded_head_sha256, stale_head_note


def audit_path(out_dir: str | Path, shard_index: int) -> Path:
    return Path(out_dir) / "audit" / f"shard-{shard_index:05d}.audit.json"


def audit_shard_cached(
    out_dir: str | Path, shard_index: int, merged_dir: str | Path, **settings: Any
) -> dict[str, AuditCheck]:
    """`audit_shard`, computed once per (shard bytes, recorded head, merged manifest, settings) and kept in
    `{out_dir}/audit/shard-NNNNN.audit.json`, so the four Dagster checks of a shard share one pass over its data
    and the per-dataset summary (`summarize_audits`) reads only these files."""
    from eagle_pipeline.shared.storage import file_sha256, read_json, write_json_atomic

    meta = read_index_meta(shard_paths(out_dir, shard_index)[1])
    manifest = Path(merged_dir) / "manifest.json"
    key = {
        "shard_sha256": meta["sha256"],
        "sample_files_digest": [f[SAMPLE_FILE_DIGEST] for f in meta.get("sample_files", [])],
        "target_head_sha256": meta.get("target_head_sha256"),
        "recorded_head_sha256": recorded_head_sha256(out_dir),  # the head it is judged with now
        "merged_manifest_sha256": file_sha256(manifest) if manifest.exists() else None,
        "settings": {k: (asdict(v) if k == "judgement" else v) for k, v in sorted(settings.items()) if k != "device"},
    }
    path = audit_path(out_dir, shard_index)
    if path.exists():
        stored = read_json(path)
        if stored.get("key") == json.loads(json.dumps(key)):
            return {name: AuditCheck(**d) for name, d in stored["checks"].items()}
    results = audit_shard(out_dir, shard_index, merged_dir, **settings)
    stale = stale_head_note(out_dir, meta.get("target_head_sha256"))  # judged with a head it was not cut with
    for name in ("norm_convention", "teacher_agreement") if stale else ():
        results[name] = replace(results[name], passed=False, verdict=FAIL, failing_sample_ids=[], detail=stale or "")
    write_json_atomic({"key": key, "checks": {n: r.to_dict() for n, r in results.items()}}, path)
    return results


def summarize_audits(out_dir: str | Path, shard_indices: Iterable[int]) -> dict[str, Any]:
    """Per-dataset and per-shard summary of the stored audits of the shards `shard_indices` (the current ones):
    teacher agreement (position-weighted), norm statistics, and which shards and samples failed which check.

    Only an audit of the shard's present bytes counts: audits of superseded shards, and of shards beyond the current
    merged table, stay in `audit/` but never reach the summary. A shard without one is listed in `unaudited_shards`."""
    from eagle_pipeline.shared.storage import read_json

    per_ds: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    shards: dict[str, Any] = {}
    failing: dict[str, list[str]] = defaultdict(list)
    unaudited: list[str] = []
    for index in shard_indices:
        path = audit_path(out_dir, index)
        shard = path.name.split(".")[0]
        stored = read_json(path) if path.exists() else None
        current = read_index_meta(shard_paths(out_dir, index)[1])["sha256"]
        if stored is None or stored.get("key", {}).get("shard_sha256") != current:
            unaudited.append(shard)
            continue
        checks = stored["checks"]
        teacher = checks["teacher_agreement"]["metrics"]
        for ds, d in teacher.get("per_dataset", {}).items():
            per_ds[ds][0] += round(d["agreement"] * d["positions"])
            per_ds[ds][1] += d["positions"]
        shards[shard] = {
            "verdicts": {n: c["verdict"] for n, c in checks.items()},
            "top1_agreement": teacher.get("top1_agreement"),
            "rms_over_norm_weight_median": checks["norm_convention"]["metrics"].get("rms_over_norm_weight_median"),
        }
        for n, c in checks.items():
            if not c["passed"]:
                failing[n].append(shard)
    return {
        "per_dataset_top1_agreement": {ds: round(a / p, 4) for ds, (a, p) in sorted(per_ds.items()) if p},
        "per_dataset_positions": {ds: p for ds, (_a, p) in sorted(per_ds.items())},
        "shards": shards,
        "failing_shards_per_check": dict(failing),
        "unaudited_shards": unaudited,
    }


def audit_markdown(summary: dict[str, Any]) -> str:
    """`summarize_audits` as Markdown tables for the UI: per dataset, then per shard."""
    lines = ["| dataset | top-1 agreement | positions |", "|---|---|---|"]
    for ds, rate in summary["per_dataset_top1_agreement"].items():
        lines.append(f"| {ds} | {rate:.3f} | {summary['per_dataset_positions'][ds]} |")
    lines += ["", "| shard | " + " | ".join(AUDIT_CHECKS) + " | top-1 | median rms(final / w) |"]
    lines.append("|---" * (len(AUDIT_CHECKS) + 3) + "|")
    for shard, d in summary["shards"].items():
        verdicts = " | ".join(d["verdicts"].get(n, "-") for n in AUDIT_CHECKS)
        rms = d["rms_over_norm_weight_median"]
        rms_cell = f"{rms:.3g}" if rms is not None else "-"
        lines.append(f"| {shard} | {verdicts} | {d['top1_agreement']} | {rms_cell} |")
    return "\n".join(lines)
