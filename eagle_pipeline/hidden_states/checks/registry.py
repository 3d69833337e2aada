"""The registry of a shard's checks: each one's name (the name the UI and the docs use), the result it reads
(`verify.verify_shard`'s structural checks, `audit.audit_shard`'s semantic ones), how it gets it and what it proves.
Each entry is a `shared.checks.CheckSpec`, the type of every stage's registry. The Dagster shell declares one blocking
check per entry; nothing else names them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from eagle_pipeline.shared.checks import CheckResult, CheckSpec

if TYPE_CHECKING:
    from eagle_pipeline.hidden_states.engines.engine import ExtractionPaths
    from eagle_pipeline.hidden_states.settings import HiddenStatesConfig


@dataclass(frozen=True)
class ShardCheckContext:
    """What a shard's check runs over: the stage's settings, its folders, and the shard."""

    settings: HiddenStatesConfig
    paths: ExtractionPaths
    shard: int


# Imported when a check runs: the code location declares the checks without loading torch.
def _structure(key: str) -> Callable[[ShardCheckContext], CheckResult]:
    def run(c: ShardCheckContext) -> CheckResult:
        from eagle_pipeline.hidden_states.checks.verify import verify_shard

        return verify_shard(c.paths.out_dir, c.shard, c.paths.merged_dir)[key]

    return run


def _semantic(key: str) -> Callable[[ShardCheckContext], CheckResult]:
    def run(c: ShardCheckContext) -> CheckResult:
        # The semantic audit is computed once per shard and shared by its four checks (audit.audit_shard_cached).
        return audit_shard_for_settings(c.settings, c.paths, c.shard)[key]

    return run


def _check(
    name: str, key: str, reader: Callable[[str], Callable[[ShardCheckContext], CheckResult]], description: str
) -> CheckSpec[ShardCheckContext]:
    return CheckSpec(name, description, key, reader(key))


SHARD_CHECKS: tuple[CheckSpec[ShardCheckContext], ...] = (
    _check(
        "shapes_match_tokens",
        "shapes",
        _structure,
        "Per sample, every state tensor has one row per token, width 3H / H.",
    ),
    _check(
        "no_nan_or_inf",
        "finite",
        _structure,
        "No NaN or Inf in any state: a bad sample fails the shard, never skipped silently.",
    ),
    _check(
        "ids_match_merged",
        "ids_match",
        _structure,
        "Stored input ids equal the merged dataset's ids for the same sample_id.",
    ),
    _check(
        "states_not_degenerate",
        "degenerate_states",
        _semantic,
        "No all-zero or constant position in any layer, no layer that holds one vector at every position.",
    ),
    _check(
        "layers_as_configured",
        "layer_layout",
        _semantic,
        "Aux layers are the configured ones in the configured order, T = the merged row's tokens, no two stored "
        "layers identical (a wrong layer id).",
    ),
    _check(
        "norm_convention_holds",
        "norm_convention",
        _semantic,
        "The recorded final-state convention (pre/post final norm) agrees with the states' RMS statistics.",
    ),
    _check(
        "teacher_agreement",
        "teacher_agreement",
        _semantic,
        "lm_head(final_norm(final state)) predicts the next supervised token as top-1 at least "
        "hidden_states.teacher_min_top1 of the time; says NOT JUDGED when the texts were not written by the "
        "extraction model.",
    ),
)
SHARD_CHECKS_BY_KEY = {c.result: c for c in SHARD_CHECKS}


def audit_shard_for_settings(settings: HiddenStatesConfig, paths: ExtractionPaths, shard: int) -> dict[str, Any]:
    """The semantic audit of shard `shard` (`audit.audit_shard_cached`: computed once, shared by its four checks)
    under the settings: the configured aux layers, the teacher threshold, and whether the texts were written by the
    extraction model (`audit.teacher_judgement`, from the merged rows' sources)."""
    import pyarrow.parquet as pq

    from eagle_pipeline.hidden_states.checks.audit import teacher_judgement
    from eagle_pipeline.hidden_states.checks.stored_audits import audit_shard_cached
    from eagle_pipeline.hidden_states.engines.runtime import resolve_device
    from eagle_pipeline.hidden_states.store.merged import merged_parts

    h = settings
    sources = {
        s for p in merged_parts(paths.merged_dir) for s in pq.read_table(p, columns=["source"])["source"].to_pylist()
    }
    judgement = teacher_judgement(
        extraction_model=h.model,
        sources=sorted(sources, key=str),
        texts_by_extraction_model=h.texts_by_extraction_model,
    )
    options: dict[str, Any] = {"expected_aux_layers": h.aux_layers, "judgement": judgement}
    if h.teacher_min_top1 is not None:
        options["min_top1"] = h.teacher_min_top1
    return audit_shard_cached(paths.out_dir, shard, paths.merged_dir, device=resolve_device(h.device), **options)
