"""The registry of a shard's checks: each one's name (the name the UI and the docs use), the result it reads
(`verify.verify_shard`'s structural checks, `audit.audit_shard`'s semantic ones) and what it proves. The Dagster
shell declares one blocking check per entry; nothing else names them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ShardCheckSpec:
    """One check of every shard: `name` in the UI, `key` of its result in `verify_shard` (kind 'structure') or
    `audit_shard` (kind 'semantic'), and its description."""

    name: str
    key: str
    kind: Literal["structure", "semantic"]
    description: str


SHARD_CHECKS: tuple[ShardCheckSpec, ...] = (
    ShardCheckSpec(
        "shapes_match_token_counts",
        "shapes",
        "structure",
        "Per sample, every state tensor has one row per token, width 3H / H.",
    ),
    ShardCheckSpec(
        "no_nan_or_inf",
        "finite",
        "structure",
        "No NaN or Inf in any state: a bad sample fails the shard, never skipped silently.",
    ),
    ShardCheckSpec(
        "ids_match_merged",
        "ids_match",
        "structure",
        "Stored input ids equal the merged dataset's ids for the same sample_id.",
    ),
    ShardCheckSpec(
        "states_not_degenerate",
        "degenerate_states",
        "semantic",
        "No all-zero or constant position in any layer, no layer that holds one vector at every position.",
    ),
    ShardCheckSpec(
        "layers_as_configured",
        "layer_layout",
        "semantic",
        "Aux layers are the configured ones in the configured order, T = the merged row's tokens, no two stored "
        "layers identical (a wrong layer id).",
    ),
    ShardCheckSpec(
        "norm_convention_matches_states",
        "norm_convention",
        "semantic",
        "The recorded final-state convention (pre/post final norm) agrees with the states' RMS statistics.",
    ),
    ShardCheckSpec(
        "teacher_agreement",
        "teacher_agreement",
        "semantic",
        "lm_head(final_norm(final state)) predicts the next supervised token as top-1 at least "
        "hidden_states.teacher_min_top1 of the time; says NOT JUDGED when the texts were not written by the "
        "extraction model.",
    ),
)
SHARD_CHECKS_BY_KEY = {c.key: c for c in SHARD_CHECKS}
