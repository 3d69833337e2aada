"""Which drafter types each trainer can train offline from the project's states, and what each one reads.

Torch-free, so the configuration can refuse a combination at load time (`drafter_problems`). Every fact is from
the trainers' code at the commits the project checks against (SpecForge `a6b6b02`, speculators `c05b95b`), with
its file:line, collected in the field notes `shared/reference/drafter_formats.md`; docs/drafters.md is the guide.

Layer conventions: the project's aux layer `k` is the **output** of 0-based decoder layer `k`. SpecForge uses the
same ids (`hidden_states[layer_id + 1]` of transformers' tuple); speculators / vLLM name the residual stream
**entering** layer `k + 1`, so their ids are the project's plus one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPECFORGE, SPECULATORS = "specforge", "speculators"
TRAINERS = (SPECFORGE, SPECULATORS)
DRAFTER_TYPES = ("eagle3", "eagle3.1", "p-eagle", "dflash", "domino", "dspark")
DEFAULT_DRAFTERS = ("eagle3",)
POST_NORM, PRE_NORM = "post_norm", "pre_norm"

# SpecForge's `.ckpt` keys: EAGLE-3's, and the DFlash family's names for the same tensors (aliases: one storage).
SF_EAGLE3_KEYS = ("input_ids", "loss_mask", "aux_hidden_state", "hidden_state")
SF_ALIASES = {"hidden_states": "aux_hidden_state", "target_last_hidden_states": "hidden_state"}


@dataclass(frozen=True)
class TrainerSupport:
    """How one trainer trains one drafter type from offline states (or why it cannot)."""

    name: str  # the trainer's own name: SpecForge's `training.strategy`, speculators' `--speculator-type`
    offline: bool
    source: str  # where the trainer says so (repository path:line)
    why_not: str = ""  # when not offline: the reason
    exact_layers: int | None = None  # the aux layer count the trainer requires (None: any)
    keys: tuple[str, ...] = ()  # SpecForge: the `.ckpt` keys its loader reads
    final_state: str | None = None  # the final state it reads and in which convention (None: not read)
    vocab_mapping: bool = True  # reads the draft vocabulary (d2t / t2d, draft_vocab.pt)
    explicit_draft_config: bool = False  # SpecForge refuses to run without a draft JSON
    draft_json: tuple[tuple[str, Any], ...] = ()  # SpecForge draft-JSON fields the type sets
    flags: tuple[str, ...] = ()  # speculators flags the type adds


_SF_EAGLE3 = dict(
    offline=True,
    exact_layers=3,
    keys=SF_EAGLE3_KEYS,
    final_state=POST_NORM,
    source="specforge/algorithms/model_providers.py:204-211 (exactly three capture layers); "
    "modeling/draft/llama3_eagle.py:1674-1678 (fc is 3·H)",
)
_SF_DFLASH = dict(
    offline=True,
    keys=("input_ids", "loss_mask", "hidden_states"),
    vocab_mapping=False,
    source="specforge/algorithms/model_providers.py:230-241 (ids from dflash_config.target_layer_ids); "
    "modeling/draft/dflash.py:356-366 (fc is len(ids)·H); algorithms/common/dflash_family_data.py:110",
)
_SP = "src/speculators/train/data.py:294-302 (slots [:, :-1] -> [T, n·H], slot -1 the final state); "
SUPPORT: dict[tuple[str, str], TrainerSupport] = {
    ("eagle3", SPECFORGE): TrainerSupport(name="eagle3", **_SF_EAGLE3),  # type: ignore[arg-type]
    ("eagle3.1", SPECFORGE): TrainerSupport(
        name="eagle3",
        draft_json=(("fc_norm", True), ("norm_output", True)),
        **_SF_EAGLE3,  # type: ignore[arg-type]
    ),
    ("p-eagle", SPECFORGE): TrainerSupport(
        name="peagle",
        offline=False,
        source="specforge/algorithms/peagle/providers.py:80-95,134-151; docs/basic_usage/training.md:259-265",
        why_not="SpecForge trains P-EAGLE online only (a streaming contract, no offline provider)",
    ),
    ("dflash", SPECFORGE): TrainerSupport(name="dflash", **_SF_DFLASH),  # type: ignore[arg-type]
    ("domino", SPECFORGE): TrainerSupport(name="domino", explicit_draft_config=True, **_SF_DFLASH),  # type: ignore[arg-type]
    ("dspark", SPECFORGE): TrainerSupport(
        name="dspark",
        offline=True,
        keys=("input_ids", "loss_mask", "hidden_states", "target_last_hidden_states"),
        final_state=POST_NORM,
        vocab_mapping=False,
        explicit_draft_config=True,
        source=str(_SF_DFLASH["source"]) + ",132-137 (target_last_hidden_states, post-norm: "
        "dflash_family_model.py:864-872 applies lm_head only)",
    ),
    ("eagle3", SPECULATORS): TrainerSupport(
        name="eagle3", offline=True, final_state=PRE_NORM, source=_SP + "models/eagle3/core.py:71-78 (fc len(ids)·H)"
    ),
    ("eagle3.1", SPECULATORS): TrainerSupport(
        name="eagle3",
        offline=True,
        final_state=PRE_NORM,
        flags=("--fc-norm", "--no-norm-before-fc"),
        source=_SP + "models/eagle3/config.py:58-96 (fc_norm; not with norm_before_fc)",
    ),
    ("p-eagle", SPECULATORS): TrainerSupport(
        name="peagle", offline=True, final_state=PRE_NORM, source=_SP + "models/peagle/core.py:233-237"
    ),
    ("dflash", SPECULATORS): TrainerSupport(
        name="dflash", offline=True, final_state=PRE_NORM, source=_SP + "models/dflash/core.py:105-109,389-405"
    ),
    ("domino", SPECULATORS): TrainerSupport(
        name="domino",
        offline=False,
        source="docs/cli/train.md:49 (types: eagle3, dflash, dspark, peagle, mtp)",
        why_not="speculators has no Domino drafter",
    ),
    ("dspark", SPECULATORS): TrainerSupport(
        name="dspark", offline=True, final_state=PRE_NORM, source=_SP + "models/dspark/core.py:138-149"
    ),
}


def resample_layer_ids(n: int, num_layers: int) -> list[int]:
    """SpecForge's target layers for an `n`-layer DFlash draft of an `num_layers`-layer target
    (`build_target_layer_ids`, modeling/draft/dflash.py:271-281): [L//2] for one, else `round(1 + i·(L-4)/(n-1))`
    (Python's round). The ids are layer outputs, the project's convention. K2.5 (61), n = 5: [1, 15, 30, 44, 58]."""
    if n < 1:
        raise ValueError(f"a layer count must be >= 1, got {n}")
    if n == 1:
        return [num_layers // 2]
    span = num_layers - 4
    ids = [round(1 + i * span / (n - 1)) for i in range(n)]
    if len(set(ids)) != n or not 0 <= ids[0] <= ids[-1] < num_layers:
        raise ValueError(f"{n} layers cannot be spread over a {num_layers}-layer model by SpecForge's rule: {ids}")
    return ids


def eagle3_default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high capture layers, outputs: (1, L//2 - 1, L - 4) (K2.5: 1, 29, 57)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def to_trainer_ids(trainer: str, aux_layers: Sequence[int]) -> list[int]:
    """The captured layers as `trainer` names them: SpecForge's ids are the project's, speculators' one more."""
    return [int(x) + (1 if trainer == SPECULATORS else 0) for x in aux_layers]


def support(drafter: str, trainer: str) -> TrainerSupport:
    return SUPPORT[(drafter, trainer)]


_OTHER = {SPECFORGE: SPECULATORS, SPECULATORS: SPECFORGE}


def why_not_served(drafter: str, trainer: str, *, n_aux: int, layout: str) -> str | None:
    """Why `trainer` cannot train `drafter` from this extraction, with the setting that would make it possible;
    None when it can."""
    s = support(drafter, trainer)
    other = _OTHER[trainer]
    if not s.offline:
        if support(drafter, other).offline:
            return f"{s.why_not} ({s.source}); {other} trains it offline: add {other} to hidden_states.trainer_layouts"
        return f"{s.why_not} ({s.source})"
    if s.exact_layers is not None and n_aux != s.exact_layers:
        return (
            f"{trainer}'s {drafter} reads exactly {s.exact_layers} aux layers ({s.source}), but the extraction "
            f"captures {n_aux}: leave hidden_states.aux_layers unset (low/mid/high) or train {drafter} with {other}"
        )
    # A trainer's own files written at extraction time (the layout is the trainer's) hold the EAGLE-3 keys alone.
    if layout == trainer and set(s.keys) - set(SF_EAGLE3_KEYS):
        return (
            f"hidden_states.layout: {layout} writes the EAGLE-3 keys at extraction time; the DFlash-family keys "
            f"{sorted(set(s.keys) - set(SF_EAGLE3_KEYS))} are added by exports converted from the shards: set "
            "hidden_states.layout: shards"
        )
    return None


def served_by(drafter: str, trainers: Sequence[str], *, n_aux: int, layout: str) -> dict[str, str | None]:
    """Trainer -> None (served) or the reason it is not, for each of `trainers`."""
    return {t: why_not_served(drafter, t, n_aux=n_aux, layout=layout) for t in trainers}


def specforge_aliases(drafters: Sequence[str]) -> dict[str, str]:
    """The DFlash-family `.ckpt` keys the listed drafters need beyond EAGLE-3's -> the EAGLE-3 key whose tensor
    they name (same storage, written once)."""
    wanted = {k for d in drafters for k in support(d, SPECFORGE).keys if support(d, SPECFORGE).offline}
    return {alias: src for alias, src in SF_ALIASES.items() if alias in wanted}


def model_depth(model: str) -> int | None:
    """The decoder-layer count of a local model directory from its config.json (text_config for multimodal ones),
    without loading anything heavy; None when it cannot be read (the built-in tiny model, a hub id)."""
    path = Path(model) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config") or cfg
    n = cfg.get("num_hidden_layers", cfg.get("num_layers"))
    return int(n) if isinstance(n, int) else None


def _layers_hint(n: int, num_layers: int | None) -> str:
    if num_layers is not None:
        try:
            return f"e.g. hidden_states.aux_layers: {n} ({resample_layer_ids(n, num_layers)}, SpecForge's rule)"
        except ValueError:
            pass
    return (
        f"e.g. hidden_states.aux_layers: {n} (SpecForge's rule round(1 + i·(L-4)/(n-1)); for a 61-layer target "
        f"{resample_layer_ids(n, 61)})"
    )


def drafter_problems(
    entries: Sequence[Mapping[str, Any]],
    *,
    n_aux: int,
    trainers: Sequence[str],
    layout: str,
    num_layers: int | None = None,
) -> list[tuple[tuple[str | int, ...], str]]:
    """Configuration problems of `hidden_states.drafters` (each a mapping with `type`, optional `layers` and
    `trainers`), as (location under hidden_states, message). `n_aux` is the captured layer count, `trainers` the
    trainer layouts the export writes, `num_layers` the extraction model's depth when known (for the hint)."""
    problems: list[tuple[tuple[str | int, ...], str]] = []
    for i, e in enumerate(entries):
        kind, layers, asked = e.get("type"), e.get("layers"), e.get("trainers")
        if kind not in DRAFTER_TYPES:
            continue  # the field's own validation names it
        if isinstance(layers, int) and layers != n_aux:
            problems.append(
                (
                    ("drafters", i, "layers"),
                    f"a {layers}-layer {kind} reads {layers} target layers, but the extraction captures {n_aux}: "
                    f"set {_layers_hint(layers, num_layers)}",
                )
            )
        for t in asked or ():
            if t in TRAINERS and t not in trainers:
                msg = f"{t} is not exported: add it to hidden_states.trainer_layouts"
                problems.append((("drafters", i, "trainers"), msg))
        candidates = [t for t in (asked or trainers) if t in trainers and t in TRAINERS]  # others: the field's error
        why = served_by(str(kind), candidates, n_aux=n_aux, layout=layout)
        refused = {t: r for t, r in why.items() if r is not None}
        if asked:
            problems += [(("drafters", i, "type"), f"{kind} for {t}: {r}") for t, r in refused.items()]
        elif candidates and len(refused) == len(candidates):
            problems += [
                (("drafters", i, "type"), f"no exported trainer serves {kind}: {t}: {r}") for t, r in refused.items()
            ]
        elif not candidates and not asked and kind != "eagle3":
            # EAGLE-3 (the default) is what the project's own shards hold; any other type needs a trainer's files.
            problems.append(
                (("drafters", i, "type"), f"{kind}: no trainer layout is exported (hidden_states.trainer_layouts)")
            )
    return problems
