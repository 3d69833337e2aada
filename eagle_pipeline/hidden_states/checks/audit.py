"""Semantic audit of an extracted shard: are these the target's states for these tokens?

The structural checks (`verify.py`) prove shapes, finiteness and ids. The failures that cost the field weeks pass
all of those: all-zero states, a dropped or repeated layer, the wrong layer ids, pre/post-norm confusion, states
of another model or shifted by one token. Four checks, each reading one sample at a time:

* `degenerate_states`: no all-zero or constant position (a row of H values) in any layer, and no layer whose
  every position holds the same vector;
* `layer_layout`: the shard's aux layers are the configured ones in the configured order, the widths match the
  layer count, T equals the merged row's token count, and no two stored layers are identical (a wrong id);
* `norm_convention`: the recorded final-state convention agrees with the states' statistics. A post-norm state
  divided by the final-norm weight has RMS 1 at every position (sqrt(ms / (ms + eps)), to within bf16 rounding);
  a pre-norm residual stream has no reason to;
* `teacher_agreement`: on a sample of rows, `lm_head(final_norm(final state))` at each position whose next token
  is supervised predicts that next token as its top-1 at a rate a target reaches on its own text
  (`DEFAULT_MIN_TOP1`, docs/hidden_states.md §7). A shifted, wrong-layer, wrong-model or zeroed state falls far
  below it (measured: <= 0.16). Where the texts were not written by the extraction model the check reports `not_judged` and says
  why: it never passes or fails silently.

No Dagster imports; `defs/hidden_states.py` turns each result into a blocking asset check.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle_pipeline.drafter_types import POST_NORM, PRE_NORM
from eagle_pipeline.hidden_states.checks.verify import MAX_FAILING_IDS
from eagle_pipeline.hidden_states.layouts.trainer_layouts import open_shard
from eagle_pipeline.hidden_states.store.fingerprint import recorded_fingerprint
from eagle_pipeline.hidden_states.store.format import read_index, read_index_meta, shard_paths
from eagle_pipeline.hidden_states.store.head import TargetHead, load_target_head
from eagle_pipeline.hidden_states.store.merged import read_rows
from eagle_pipeline.shared.checks import CheckResult

# docs/hidden_states.md §7: tiny targets on their own greedy text agree at 1.0, every injected corruption at <= 0.16;
# real targets' rates on sampled text (E[p_max] of their distribution) are not measured here: a judgement, settable.
DEFAULT_MIN_TOP1 = 0.4
DEFAULT_SAMPLE_ROWS = 16
DEFAULT_MAX_POSITIONS = 4096
POST_NORM_RMS_TOLERANCE = 0.02  # |rms(final / w) - 1| for a post-norm position (bf16 rounding is ~0.4%)
POST_NORM_SHARE = 0.99  # a post-norm shard: at least this share of positions within the tolerance
PRE_NORM_MAX_SHARE = 0.5  # a pre-norm shard: at most this share (else it looks normalised: a double norm ahead)
AUDIT_CHECKS = ("degenerate_states", "layer_layout", "norm_convention", "teacher_agreement")
PASS, FAIL, NOT_JUDGED = "pass", "fail", "not_judged"


@dataclass
class AuditCheck(CheckResult):
    """A `CheckResult` with a verdict ('pass' | 'fail' | 'not_judged') and figures a user can act on."""

    verdict: str = PASS
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TeacherJudgement:
    """Whether teacher agreement can be judged here, and why not when it cannot."""

    judge: bool
    reason: str = ""


def teacher_judgement(
    *, extraction_model: str, sources: Sequence[str | None], texts_by_extraction_model: bool | None
) -> TeacherJudgement:
    """Decide from provenance whether the texts were written by the model the states come from.

    `texts_by_extraction_model` (config `hidden_states.texts_by_extraction_model`) overrides; unset, the answer is
    no for a tiny random stand-in model or simulated texts, and yes otherwise (a wrong yes then fails loudly and
    the message says how to declare off-policy texts).
    """
    if texts_by_extraction_model is not None:
        if texts_by_extraction_model:
            return TeacherJudgement(True)
        return TeacherJudgement(False, "hidden_states.texts_by_extraction_model is false (texts from another model)")
    if extraction_model == "tiny-random":
        return TeacherJudgement(
            False, "the extraction model is a tiny random stand-in, not the model that wrote the texts"
        )
    simulated = sorted({s for s in sources if s == "simulated"})
    if simulated:
        return TeacherJudgement(False, "the texts are simulated (source 'simulated'), not written by any model")
    return TeacherJudgement(True)


class _Failures:
    def __init__(self) -> None:
        self.checked = 0
        self.ids: list[str] = []
        self.notes: list[str] = []
        self.failing = 0

    def record(self, sid: str, problems: list[str]) -> None:
        self.checked += 1
        if problems:
            self.failing += 1
            if len(self.ids) < MAX_FAILING_IDS:
                self.ids.append(sid)
                self.notes.append(f"{sid}: {'; '.join(problems)}")

    def result(self, name: str, metrics: dict[str, Any], detail_prefix: str = "") -> AuditCheck:
        passed = self.failing == 0
        detail = "; ".join(([detail_prefix] if detail_prefix else []) + self.notes)
        verdict = PASS if passed else FAIL
        return AuditCheck(name, passed, self.checked, self.failing, self.ids, detail, verdict=verdict, metrics=metrics)


def _layers(t: dict[str, torch.Tensor], n_aux: int, hidden: int) -> dict[str, torch.Tensor]:
    aux = t["aux_hidden_states"]
    out = {f"aux{j}": aux[:, j * hidden : (j + 1) * hidden] for j in range(n_aux)}
    out["final"] = t["final_hidden_state"]
    return out


def _degenerate(name: str, x: torch.Tensor) -> list[str]:
    finite_rows = torch.isfinite(x).all(-1)
    zero = int(((x == 0).all(-1) & finite_rows).sum())
    const = int(((x.amax(-1) == x.amin(-1)) & finite_rows).sum()) - zero
    problems = []
    if zero:
        problems.append(f"{name}: {zero}/{len(x)} positions all zero")
    if const > 0:
        problems.append(f"{name}: {const}/{len(x)} positions constant")
    if len(x) > 1 and not zero and bool(torch.isfinite(x).all()) and bool((x == x[:1]).all()):
        problems.append(f"{name}: every position holds the same vector")
    return problems


def audit_shard(
    out_dir: str | Path,
    shard_index: int,
    merged_dir: str | Path,
    *,
    expected_aux_layers: Sequence[int] | int | None,
    judgement: TeacherJudgement,
    min_top1: float = DEFAULT_MIN_TOP1,
    sample_rows: int = DEFAULT_SAMPLE_ROWS,
    max_positions: int = DEFAULT_MAX_POSITIONS,
    head: TargetHead | None = None,
    device: str = "cpu",
) -> dict[str, AuditCheck]:
    """The four semantic checks of one shard (see the module docstring), keyed by `AUDIT_CHECKS` names.

    `expected_aux_layers` None means the default for the shard's model depth. The target head (final norm +
    lm_head) is read from beside the shards unless given.
    """
    from eagle_pipeline.hidden_states.models.layers import resolve_aux_layers

    idx_path = shard_paths(out_dir, shard_index)[1]
    meta = read_index_meta(idx_path)
    index = read_index(idx_path)
    fp = recorded_fingerprint(meta)
    hidden, aux_layers = int(meta["hidden_size"]), list(fp.aux_layers)
    n_layers = meta["model"].get("num_layers")
    expected = list(resolve_aux_layers(expected_aux_layers, int(n_layers))) if n_layers else aux_layers
    convention = fp.final_state
    head, no_head = _audit_head(out_dir, head, device)
    merged = read_rows(merged_dir, int(meta["row_start"]), int(meta["row_stop"]))
    merged_len = {sid: len(ids) for sid, ids in zip(merged.sample_ids, merged.input_ids)}
    sample_ids = index.column("sample_id").to_pylist()
    datasets = index.column("dataset").to_pylist()

    degenerate, layout = _Failures(), _Failures()
    layer_counts: dict[str, int] = defaultdict(int)
    norm = _NormStats(head, hidden)
    teacher = _TeacherStats(head, convention, len(sample_ids), sample_rows, max_positions, device)
    with open_shard(out_dir, shard_index) as reader:
        for i, (sid, ds) in enumerate(zip(sample_ids, datasets)):
            t = reader.get(sid)
            layers = _layers(t, len(aux_layers), hidden)
            problems = [p for name, x in layers.items() for p in _degenerate(name, x)]
            for p in problems:
                layer_counts[p.split(":", 1)[0]] += 1
            degenerate.record(sid, problems)
            layout.record(sid, _layout_problems(t, layers, len(expected), hidden, merged_len.get(sid)))
            norm.record(t["final_hidden_state"])
            teacher.record(i, sid, ds, t)

    deg = degenerate.result("degenerate_states", {"failing_samples_per_layer": dict(layer_counts)})
    layout_prefix = ""
    if aux_layers != expected:
        layout_prefix = f"shard aux layers {aux_layers} != configured {expected} (count or order)"
    lay_result = layout.result(
        "layer_layout", {"aux_layers": aux_layers, "expected_aux_layers": expected}, detail_prefix=layout_prefix
    )
    if layout_prefix:
        lay_result.passed, lay_result.verdict = False, FAIL
    if head is None:
        unjudged = {
            name: AuditCheck(name, True, 0, 0, [], f"NOT JUDGED: {no_head}", verdict=NOT_JUDGED)
            for name in ("norm_convention", "teacher_agreement")
        }
        return {"degenerate_states": deg, "layer_layout": lay_result, **unjudged}
    return {
        "degenerate_states": deg,
        "layer_layout": lay_result,
        "norm_convention": norm.result(convention, len(sample_ids)),
        "teacher_agreement": teacher.result(judgement, min_top1, int(head.lm_head.shape[0])),
    }


def _audit_head(out_dir: str | Path, head: TargetHead | None, device: str) -> tuple[TargetHead | None, str]:
    """The head to judge with, on `device` (the recorded one unless given), or None and why: an engine that recorded
    no final norm / lm_head leaves the norm and teacher checks unjudged."""
    if head is None:
        try:
            head = load_target_head(out_dir)
        except FileNotFoundError as exc:
            return None, f"no recorded final norm / lm_head ({exc})"
    return head.prepared(device), ""


def _layout_problems(
    t: dict[str, torch.Tensor], layers: dict[str, torch.Tensor], n_aux: int, hidden: int, merged_tokens: int | None
) -> list[str]:
    """One sample's `layer_layout` problems: the aux width, T against the merged row, two identical layers."""
    problems: list[str] = []
    if t["aux_hidden_states"].shape[-1] != n_aux * hidden:
        problems.append(f"aux width {t['aux_hidden_states'].shape[-1]} != {n_aux} layers x {hidden}")
    n_tok = int(t["input_ids"].numel())
    if merged_tokens is not None and n_tok != merged_tokens:
        problems.append(f"T={n_tok} but the merged row has {merged_tokens} tokens")
    names = list(layers)
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            xa, xb = layers[names[a]], layers[names[b]]
            if xa.shape == xb.shape and bool((xa != 0).any()) and torch.equal(xa, xb):
                problems.append(f"{names[a]} and {names[b]} are identical (a wrong layer id)")
    return problems


class _NormStats:
    """`norm_convention`'s figures: rms(final / final-norm weight) at every finite position."""

    def __init__(self, head: TargetHead | None, hidden: int) -> None:
        self.w = head.norm_weight.to(device="cpu", dtype=torch.float32) if head is not None else torch.ones(hidden)
        self.w_ok = self.w != 0
        self.near_one = self.positions = 0
        self.rms_values: list[np.ndarray] = []

    def record(self, final_state: torch.Tensor) -> None:
        final = final_state.to(torch.float32)
        finite = torch.isfinite(final).all(-1)
        r = (final[:, self.w_ok] / self.w[self.w_ok]).pow(2).mean(-1).sqrt()[finite]
        self.near_one += int(((r - 1).abs() < POST_NORM_RMS_TOLERANCE).sum())
        self.positions += int(r.numel())
        self.rms_values.append(r.numpy())

    def result(self, convention: str, n: int) -> AuditCheck:
        near_one, positions, rms_values, w = self.near_one, self.positions, self.rms_values, self.w
        share = near_one / positions if positions else 0.0
        rms = np.concatenate(rms_values) if rms_values else np.zeros(0)
        metrics = {
            "recorded_convention": convention,
            "share_of_positions_with_unit_rms_after_dividing_by_norm_weight": round(share, 4),
            "rms_over_norm_weight_median": float(np.median(rms)) if rms.size else None,
            "rms_over_norm_weight_p05_p95": [float(np.percentile(rms, 5)), float(np.percentile(rms, 95))]
            if rms.size
            else None,
            "final_norm_weight_rms": float(w.pow(2).mean().sqrt()),
            "positions": positions,
        }
        if convention == POST_NORM:
            ok = share >= POST_NORM_SHARE
            detail = (
                f"post-norm recorded and {share:.1%} of positions have rms(final / norm weight) = 1"
                if ok
                else f"post-norm recorded but only {share:.1%} of positions have rms(final / norm weight) = 1 (a post-norm "
                "state has it everywhere): the states are not normalised by this target's final norm"
            )
        elif convention == PRE_NORM:
            ok = share <= PRE_NORM_MAX_SHARE
            detail = (
                f"pre-norm recorded; {share:.1%} of positions look normalised"
                if ok
                else f"pre-norm recorded but {share:.1%} of positions have rms(final / norm weight) = 1: these states are "
                "already normalised, and the trainer's final norm would be applied twice"
            )
        else:
            ok, detail = False, f"unknown final-state convention {convention!r}"
        return AuditCheck(
            "norm_convention", ok, n, 0 if ok else n, [], detail, verdict=PASS if ok else FAIL, metrics=metrics
        )


class _TeacherStats:
    """`teacher_agreement`'s figures: on evenly spread sample rows, whether the head's top-1 at each position whose
    next token is supervised is that token."""

    def __init__(
        self, head: TargetHead | None, convention: str, n: int, sample_rows: int, max_positions: int, device: str
    ) -> None:
        self.head, self.convention, self.device = head, convention, device
        self.rows = set(np.linspace(0, n - 1, min(sample_rows, n)).round().astype(int).tolist()) if n else set()
        self.per_row_positions = max(1, max_positions // max(len(self.rows), 1))
        self.agree = self.positions = 0
        self.by_ds: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self.per_sample: list[tuple[float, str, int]] = []

    def record(self, i: int, sid: str, ds: str, t: dict[str, torch.Tensor]) -> None:
        if self.head is None or i not in self.rows or int(t["input_ids"].numel()) <= 1:
            return
        mask = t["loss_mask"].to(torch.bool)
        pos = torch.nonzero(mask[1:]).flatten()[: self.per_row_positions]  # p whose next token is supervised
        if len(pos):
            top1 = self.head.top1(t["final_hidden_state"][pos].to(self.device), self.convention).cpu()
            agree = int((top1 == t["input_ids"][pos + 1].to(torch.int64)).sum())
            self.agree += agree
            self.positions += len(pos)
            self.by_ds[ds][0] += agree
            self.by_ds[ds][1] += len(pos)
            self.per_sample.append((agree / len(pos), sid, len(pos)))

    def result(self, judgement: TeacherJudgement, min_top1: float, vocab: int) -> AuditCheck:
        agree, positions, by_ds, per_sample = self.agree, self.positions, self.by_ds, self.per_sample
        name = "teacher_agreement"
        rate = agree / positions if positions else None
        worst = sorted(per_sample)[:MAX_FAILING_IDS]
        metrics: dict[str, Any] = {
            "top1_agreement": round(rate, 4) if rate is not None else None,
            "threshold": min_top1,
            "chance": round(1 / vocab, 8),
            "positions": positions,
            "rows_sampled": len(per_sample),
            "per_dataset": {
                ds: {"agreement": round(a / p, 4), "positions": p} for ds, (a, p) in sorted(by_ds.items()) if p
            },
            "lowest_samples": [{"sample_id": sid, "agreement": round(r, 4), "positions": p} for r, sid, p in worst],
        }
        measured = (
            f"top-1 agreement {rate:.3f} over {positions} positions" if rate is not None else "no supervised position"
        )
        if not judgement.judge:
            detail = (
                f"NOT JUDGED: {judgement.reason}. Measured {measured} (threshold {min_top1}); it says nothing here."
            )
            metrics["not_judged_reason"] = judgement.reason
            return AuditCheck(name, True, len(per_sample), 0, [], detail, verdict=NOT_JUDGED, metrics=metrics)
        if rate is None:
            detail = "NOT JUDGED: no supervised position in the sampled rows"
            return AuditCheck(name, True, 0, 0, [], detail, verdict=NOT_JUDGED, metrics=metrics)
        ok = rate >= min_top1
        low = [sid for r, sid, _ in worst if r < min_top1]
        detail = (
            f"{measured} >= {min_top1}"
            if ok
            else f"{measured} < {min_top1} (chance {1 / vocab:.2g}): these are not this target's states for these tokens "
            "(shifted, wrong layer, wrong model, zeroed, or a norm applied wrongly). If the texts were written by "
            "another model, set hidden_states.texts_by_extraction_model: false."
        )
        failing, verdict = (0, PASS) if ok else (len(low), FAIL)
        return AuditCheck(name, ok, len(per_sample), failing, low, detail, verdict=verdict, metrics=metrics)
