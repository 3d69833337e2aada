"""The layer guard: a draft config (JSON) or trainer flag file held against what an export captured.

Neither trainer checks that the states it loads come from the layers its draft config names (drafter_formats.md,
"Checks on load"): same-width states of the wrong layers train silently. The export records the captured layers in
both conventions (`drafters.capture_record`); this module reads what a draft config claims, in its own trainer's
convention, and names every mismatch with both values. `eagle-pipeline check-drafter` and the `trainer_exports`
asset check both call `check_drafter`.

What is read: SpecForge's draft JSON (`dflash_config.target_layer_ids`, `hidden_size` and `num_target_layers` for
DFlash / Domino / DSpark; `eagle_config.eagle_aux_hidden_state_layer_ids`, else its default `[1, L//2-1, L-4]`, and
`target_hidden_size`, else `hidden_size`, for EAGLE-3); speculators' saved config (`eagle_aux_hidden_state_layer_ids` / `aux_hidden_state_layer_ids`,
`target_hidden_size` or `transformer_layer_config.hidden_size`); a speculators flag set (`--target-layer-ids`, else
its default `[2, L//2, L-3]`; the width comes from the verifier, so flags are checked for ids and count only).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle_pipeline.drafter_types import SPECFORGE, SPECULATORS, eagle3_default_layers
from eagle_pipeline.hidden_states.layouts.trainer_exports import EXPORT_JSON
from eagle_pipeline.shared.storage import read_json


@dataclass(frozen=True)
class DraftClaim:
    """What a draft config says it reads, in its trainer's convention."""

    trainer: str
    source: str  # the field or flag the ids came from
    layer_ids: list[int]
    hidden_size: int | None = None
    num_target_layers: int | None = None
    kind: str = ""


@dataclass
class DrafterCheck:
    passed: bool
    export_dir: str
    draft_config: str
    claim: DraftClaim | None
    problems: list[str] = field(default_factory=list)

    def describe(self) -> str:
        if self.passed:
            assert self.claim is not None
            return (
                f"{self.draft_config} matches {self.export_dir}: {self.claim.source} {self.claim.layer_ids} "
                f"({self.claim.trainer}) are the captured layers"
            )
        return f"{self.draft_config} does not match {self.export_dir}: " + "; ".join(self.problems)


def read_claim(path: str | Path, *, num_layers: int | None = None) -> DraftClaim:
    """The layers, width and depth a draft config or flag file claims. `num_layers` (the target's depth) resolves a
    trainer's default ids where the file names none. Raises ValueError naming the file when it says nothing usable."""
    path = Path(path)
    text = path.read_text()
    try:
        cfg = json.loads(text)
    except ValueError:
        return _flags_claim(shlex.split(text.replace("\\\n", " "), comments=True), str(path), num_layers)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: a draft config must be a JSON object")
    return _json_claim(cfg, str(path), num_layers)


def _json_claim(cfg: dict[str, Any], where: str, num_layers: int | None) -> DraftClaim:
    if isinstance(cfg.get("dflash_config"), dict):
        ids = cfg["dflash_config"].get("target_layer_ids")
        if not ids:
            raise ValueError(f"{where}: dflash_config.target_layer_ids is empty (SpecForge needs it)")
        return DraftClaim(
            SPECFORGE,
            "dflash_config.target_layer_ids",
            [int(x) for x in ids],
            _int(cfg.get("hidden_size")),
            _int(cfg.get("num_target_layers")),
            kind=str((cfg["dflash_config"].get("projector_type")) or "dflash"),
        )
    if "speculators_model_type" in cfg:
        key = (
            "eagle_aux_hidden_state_layer_ids"
            if "eagle_aux_hidden_state_layer_ids" in cfg
            else "aux_hidden_state_layer_ids"
        )
        ids = cfg.get(key)
        if not ids:
            raise ValueError(f"{where}: speculators config names no {key}")
        width = cfg.get("target_hidden_size") or (cfg.get("transformer_layer_config") or {}).get("hidden_size")
        return DraftClaim(SPECULATORS, key, [int(x) for x in ids], _int(width), kind=str(cfg["speculators_model_type"]))
    if "eagle_config" in cfg or any("Eagle3" in str(a) for a in cfg.get("architectures") or []):
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        source = "eagle_config.eagle_aux_hidden_state_layer_ids"
        if ids is None:
            if num_layers is None:
                raise ValueError(f"{where}: no eagle_config.eagle_aux_hidden_state_layer_ids and the depth is unknown")
            ids, source = eagle3_default_layers(num_layers), "SpecForge's default [1, L//2-1, L-4]"
        width = _int(cfg.get("target_hidden_size")) or _int(cfg.get("hidden_size"))  # llama3_eagle.py:1670-1678
        return DraftClaim(SPECFORGE, source, [int(x) for x in ids], width, kind="eagle3")
    raise ValueError(
        f"{where}: not a draft config this check reads (SpecForge: dflash_config or eagle_config / an Eagle3 "
        "architecture; speculators: speculators_model_type), nor a flag file"
    )


def _flags_claim(argv: list[str], where: str, num_layers: int | None) -> DraftClaim:
    ids: list[int] | None = None
    kind = "eagle3"
    for i, a in enumerate(argv):
        if a == "--speculator-type" and i + 1 < len(argv):
            kind = argv[i + 1]
        elif a == "--target-layer-ids":
            ids = []
            for v in argv[i + 1 :]:
                if v.startswith("--"):
                    break
                ids.append(int(v))
        elif a.startswith("--target-layer-ids="):
            ids = [int(v) for v in a.split("=", 1)[1].replace(",", " ").split()]
    if "--speculator-type" not in argv and "--target-layer-ids" not in argv and ids is None:
        raise ValueError(f"{where}: neither JSON nor speculators flags (--target-layer-ids / --speculator-type)")
    if ids is None:
        if num_layers is None:
            raise ValueError(f"{where}: no --target-layer-ids and the target's depth is unknown")
        return DraftClaim(
            SPECULATORS, "speculators' default [2, L//2, L-3]", [2, num_layers // 2, num_layers - 3], kind=kind
        )
    return DraftClaim(SPECULATORS, "--target-layer-ids", ids, kind=kind)


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def claim_problems(claim: DraftClaim, record: dict[str, Any]) -> list[str]:
    """Every mismatch between a claim and an export's capture record, each naming both values."""
    captured = [int(x) for x in record["layer_ids_by_convention"][claim.trainer]]
    n, h = int(record["layer_count"]), int(record["hidden_size"])
    problems = []
    if claim.trainer != record["trainer"]:
        problems.append(
            f"trainer: the draft config is {claim.trainer}'s, but this is the {record['trainer']} export (its files "
            f"are {record['trainer']}'s format); use the {claim.trainer} export"
        )
    if len(claim.layer_ids) != n:
        problems.append(
            f"layer count: the draft config reads {len(claim.layer_ids)} target layers ({claim.source} "
            f"{claim.layer_ids}), the export captured {n} ({captured})"
        )
    elif claim.layer_ids != captured:
        problems.append(
            f"layer ids: the draft config's {claim.source} {claim.layer_ids} != the captured {captured} "
            f"(both in {claim.trainer}'s convention; the project's ids {record['aux_layers']})"
        )
    if claim.hidden_size is not None and claim.hidden_size != h:
        problems.append(f"width: the draft config's hidden size {claim.hidden_size} != the captured H {h}")
    depth = record.get("num_layers")
    if claim.num_target_layers is not None and depth is not None and claim.num_target_layers != int(depth):
        problems.append(
            f"target depth: the draft config's num_target_layers {claim.num_target_layers} != the target's {depth}"
        )
    return problems


def export_record(export_dir: str | Path) -> dict[str, Any]:
    """The capture record of a trainer export (its export.json's `extra.capture`)."""
    path = Path(export_dir) / EXPORT_JSON
    if not path.exists():
        raise FileNotFoundError(f"{path}: no export.json (is {export_dir} a trainer export? run trainer_exports)")
    record = read_json(path).get("extra", {}).get("capture")
    if not record:
        raise ValueError(f"{path} records no capture (written before the layer guard): re-run trainer_exports")
    return dict(record)


def check_drafter(export_dir: str | Path, draft_config: str | Path) -> DrafterCheck:
    """Hold `draft_config` (a draft JSON or flag file) against the capture of `export_dir`: a trainer export, or the
    exports folder holding one per trainer (the draft config's trainer picks it)."""
    export_dir = Path(export_dir)
    if not (export_dir / EXPORT_JSON).exists():
        try:
            trainer = read_claim(draft_config, num_layers=None).trainer
        except ValueError:
            trainer = SPECFORGE
        if (export_dir / trainer / EXPORT_JSON).exists():
            export_dir = export_dir / trainer
    record = export_record(export_dir)
    try:
        claim = read_claim(draft_config, num_layers=record.get("num_layers"))
    except ValueError as exc:
        return DrafterCheck(False, str(export_dir), str(draft_config), None, [str(exc)])
    problems = claim_problems(claim, record) + stale_export_problems(export_dir)
    return DrafterCheck(not problems, str(export_dir), str(draft_config), claim, problems)


def stale_export_problems(export_dir: str | Path) -> list[str]:
    """Why the export must not be trained on because the dataset audits it was built from are no longer the current
    ones (its manifest's `dataset_audits`, `audit.records.stale_audit_stamps`); empty when they are. The manifest is
    the exports folder's (`export_dir` or its parent); a trainer export copied away from it is not judged."""
    from eagle_pipeline.audit.records import describe_stale, stale_audit_stamps
    from eagle_pipeline.hidden_states.layouts.trainer_exports import EXPORT_MANIFEST

    export_dir = Path(export_dir)
    found = [d / EXPORT_MANIFEST for d in (export_dir, export_dir.parent) if (d / EXPORT_MANIFEST).exists()]
    manifest = found[0] if found else None
    if manifest is None:
        return []
    stamps = read_json(manifest).get("dataset_audits")
    if stamps is None:
        return [f"{manifest} records no dataset audits: re-run trainer_exports"]
    stale = stale_audit_stamps(stamps)
    if not stale:
        return []
    return [
        f"stale export: built from dataset audits that are no longer the current ones ({describe_stale(stale)}); "
        "fix those datasets, then rerun the merge, hidden states and trainer_exports"
    ]
