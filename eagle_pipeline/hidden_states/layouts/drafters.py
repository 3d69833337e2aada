"""The drafter hand-off of a trainer export: what the shards captured (the layer guard's record, both layer
conventions) and, per listed drafter type, the draft-config fragment or flags and the training command.

Written into each trainer export's `export.json` (`capture`, `drafters`) and README.md by the trainer layout's
export (`trainer_layouts`); read back by `drafter_check` (`eagle-pipeline check-drafter`). Which types each trainer trains offline, and why not:
`eagle_pipeline.drafter_types`; the guide: docs/drafters.md.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

from eagle_pipeline.drafter_types import (
    DEFAULT_DRAFTERS,
    SPECFORGE,
    SPECULATORS,
    support,
    to_trainer_ids,
    why_not_served,
)
from eagle_pipeline.hidden_states.settings import SHARDS
from eagle_pipeline.hidden_states.store.fingerprint import recorded_fingerprint
from eagle_pipeline.hidden_states.store.fp8 import FP8_BACKEND, FP8_BACKEND_FLAG, QUANTIZE_FP8, QUANTIZE_NONE
from eagle_pipeline.hidden_states.store.shard_index import shard_indexes

CONVENTIONS = {
    "project": "0-based decoder-layer outputs: the residual stream after layer k",
    SPECFORGE: "layer outputs, as the project's: SpecForge reads hidden_states[id + 1] of transformers' tuple",
    SPECULATORS: "vLLM ids: the residual stream entering layer id, the project's id + 1",
}


@dataclass(frozen=True)
class Capture:
    """What every shard captured: the layers (project convention), the target's depth and width, the states'
    dtype and the target's description and identity, and how the states are stored (`fp8.QUANTIZE_MODES`)."""

    aux_layers: tuple[int, ...]
    num_layers: int | None
    hidden_size: int
    dtype: str
    target: dict[str, Any]
    quantize: str = QUANTIZE_NONE


def capture_of_shards(hs_dir: str | Path) -> Capture:
    """The capture the finished shards under `hs_dir` record; every shard must agree."""
    seen: dict[tuple[Any, ...], int] = {}
    capture: Capture | None = None
    for shard, meta, _ids in shard_indexes(hs_dir):
        model, fp = dict(meta["model"]), recorded_fingerprint(meta)
        c = Capture(
            aux_layers=fp.aux_layers,
            num_layers=int(model["num_layers"]) if model.get("num_layers") is not None else None,
            hidden_size=int(meta["hidden_size"]),
            dtype=str(meta["dtype"]),
            target={"description": model, "identity": fp.model},
            quantize=fp.quantize,
        )
        key = (c.aux_layers, c.hidden_size, c.dtype, c.quantize)
        if seen and key not in seen:
            other = next(iter(seen.items()))
            raise ValueError(
                f"{hs_dir}: shard {shard} captured layers {list(key[0])}, H {key[1]}, {key[2]}, quantize {key[3]}, "
                f"but shard {other[1]} captured {list(other[0][0])}, H {other[0][1]}, {other[0][2]}, quantize "
                f"{other[0][3]}: re-extract so every shard agrees"
            )
        seen.setdefault(key, shard)
        capture = capture or c
    if capture is None:
        raise ValueError(f"{hs_dir}: no finished shard to describe")
    return capture


def capture_record(c: Capture, trainer: str, final_state: str) -> dict[str, Any]:
    """The layer guard's record in an export: the captured ids in the project's and the trainer's conventions
    (and vLLM's), their count, H, the width the trainer's fc sees, the dtype, the final state of the files."""
    return {
        "trainer": trainer,
        "aux_layers": list(c.aux_layers),
        "aux_layers_convention": CONVENTIONS["project"],
        "trainer_layer_ids": to_trainer_ids(trainer, c.aux_layers),
        "trainer_layer_ids_convention": CONVENTIONS[trainer],
        "layer_ids_by_convention": {t: to_trainer_ids(t, c.aux_layers) for t in (SPECFORGE, SPECULATORS)},
        "vllm_layer_ids": to_trainer_ids(SPECULATORS, c.aux_layers),
        "layer_count": len(c.aux_layers),
        "num_layers": c.num_layers,
        "hidden_size": c.hidden_size,
        "aux_width": len(c.aux_layers) * c.hidden_size,
        "dtype": c.dtype,
        "quantize": c.quantize,
        "final_state": final_state,
        "target": c.target,
    }


def drafter_entries(drafters: Sequence[Any]) -> list[tuple[str, tuple[str, ...] | None]]:
    """(type, trainers or None) of each `hidden_states.drafters` entry: a name, a mapping or a `DrafterSpec`."""
    out: list[tuple[str, tuple[str, ...] | None]] = []
    for d in drafters:
        if isinstance(d, str):
            out.append((d, None))
            continue
        m = asdict(d) if is_dataclass(d) and not isinstance(d, type) else dict(d)
        out.append((str(m["type"]), tuple(m["trainers"]) if m.get("trainers") else None))
    return out


def handoff(
    record: Mapping[str, Any],
    drafters: Sequence[Any] = DEFAULT_DRAFTERS,
    *,
    paths: Mapping[str, Any],
    layout: str = SHARDS,
) -> list[dict[str, Any]]:
    """Per listed drafter type, what `record['trainer']` needs to train it from this export: the layer ids in its
    convention, the count, H, the vocabulary mapping, a draft-config fragment (SpecForge) or flags (speculators) and
    the command; or, where it cannot, the reason. `paths`: the export's folders and files (`handoff_paths`)."""
    trainer = str(record["trainer"])
    out = []
    for kind, only in drafter_entries(drafters):
        if only is not None and trainer not in only:
            continue
        why = why_not_served(kind, trainer, n_aux=int(record["layer_count"]), layout=layout)
        entry: dict[str, Any] = {"type": kind, "trainer": trainer, "served": why is None}
        if why is not None:
            out.append({**entry, "reason": why})
            continue
        s = support(kind, trainer)
        entry.update(
            trainer_name=s.name,
            target_layer_ids=list(record["trainer_layer_ids"]),
            layer_count=int(record["layer_count"]),
            hidden_size=int(record["hidden_size"]),
            final_state_read=s.final_state,
            source=s.source,
        )
        build = _specforge_entry if trainer == SPECFORGE else _speculators_entry
        out.append({**entry, **build(kind, record, paths)})
    return out


def _specforge_entry(kind: str, record: Mapping[str, Any], paths: Mapping[str, Any]) -> dict[str, Any]:
    s = support(kind, SPECFORGE)
    ids, hidden = list(record["trainer_layer_ids"]), int(record["hidden_size"])
    fragment: dict[str, Any] = {}
    if "aux_hidden_state" in s.keys:  # the EAGLE-3 family: fc is 3 x target_hidden_size (default hidden_size)
        fragment["target_hidden_size"] = hidden
        fragment["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    else:  # fc is len(target_layer_ids) x hidden_size: the draft is as wide as the target
        fragment["hidden_size"] = hidden
        if record.get("num_layers") is not None:
            fragment["num_target_layers"] = int(record["num_layers"])
        fragment["dflash_config"] = {"target_layer_ids": ids}
    fragment.update(dict(s.draft_json))
    config: dict[str, Any] = {
        "model.draft_model_config": "<your draft JSON, with draft_config_fragment merged in>",
        "data.hidden_states_path": str(paths["train"]),
        "training.strategy": s.name,
    }
    if paths.get("eval") is not None:
        config.update({"data.eval_hidden_states_path": str(paths["eval"]), "training.eval_interval": "<steps>"})
    if s.vocab_mapping:
        config["model.vocab_mapping_path"] = str(paths.get("vocab_mapping") or "<draft_vocab.pt>")
    notes = ["do not set model.draft_num_hidden_layers: it resamples the target layer ids (model_providers.py:477-501)"]
    if s.explicit_draft_config:
        notes.append(f"{kind} needs an explicit draft JSON (docs/basic_usage/training.md:182-186)")
    return {
        "keys": list(s.keys),
        "vocab_mapping": config.get("model.vocab_mapping_path"),
        "draft_config_fragment": fragment,
        "training_config": config,
        "command": "specforge train --config <config.yaml>",
        "notes": notes if "dflash_config" in fragment else notes[1:],
    }


def _speculators_entry(kind: str, record: Mapping[str, Any], paths: Mapping[str, Any]) -> dict[str, Any]:
    s = support(kind, SPECULATORS)
    flags = ["--speculator-type", s.name, "--target-layer-ids", *map(str, record["trainer_layer_ids"]), *s.flags]
    flags += ["--data-path", str(paths["data"])]
    if record.get("quantize") == QUANTIZE_FP8:
        # speculators' fp8 backend (#1028) loads hs_{i} from --data-path/hidden_states, where the export puts them;
        # the file backend's --hidden-states-path is that backend's own flag (one dest per backend, c05b95b).
        flags += [FP8_BACKEND_FLAG, FP8_BACKEND]
    else:
        flags += ["--hidden-states-path", str(paths["hidden_states"])]
    flags += ["--on-missing", "raise"]
    if paths.get("train_data_ratio") is not None:
        flags += ["--train-data-ratio", repr(paths["train_data_ratio"])]
    vocab = None
    if s.vocab_mapping and paths.get("d2t") is not None:
        vocab = {"d2t": str(paths["d2t"]), "t2d": str(paths["t2d"])}
        flags += ["--d2t-path", vocab["d2t"], "--t2d-path", vocab["t2d"]]
    verifier = str(paths.get("verifier") or "<the target model>")
    command = "torchrun --standalone --nproc_per_node <gpus> scripts/train.py " + shlex.join(
        ["--verifier-name-or-path", verifier, *flags, "--save-path", "<checkpoints>"]
    )
    return {"vocab_mapping": vocab, "flags": flags, "command": command}


def handoff_markdown(record: Mapping[str, Any], entries: Sequence[Mapping[str, Any]]) -> list[str]:
    """The README section: the captured layers in both conventions, then one part per drafter type."""
    lines = [
        "## What was captured (the layer guard)",
        "",
        f"- aux layers {record['aux_layers']}, {record['aux_layers_convention']}",
        f"- as {record['trainer']} names them: {record['trainer_layer_ids']}, {record['trainer_layer_ids_convention']}",
        f"- vLLM ids {record['vllm_layer_ids']}",
        f"- {record['layer_count']} layers of H = {record['hidden_size']} ({record['aux_width']} wide), "
        f"{record['dtype']}; target with {record['num_layers']} decoder layers; final state {record['final_state']}",
        "- check a draft config or flag file against it before training: "
        "`eagle-pipeline check-drafter --export <this folder> --draft-config FILE`",
        "",
        "## Drafters",
        "",
    ]
    for e in entries:
        lines.append(f"### {e['type']}")
        lines.append("")
        if not e["served"]:
            lines += [f"Not from this export: {e['reason']}", ""]
            continue
        vocab = e.get("vocab_mapping")
        if isinstance(vocab, Mapping):
            vocab = f"--d2t-path {vocab['d2t']} --t2d-path {vocab['t2d']}"
        lines.append(
            f"target layer ids {e['target_layer_ids']} ({e['layer_count']} layers), H {e['hidden_size']}; vocabulary "
            f"mapping: {vocab if vocab else 'none (the target vocabulary through its lm_head)'}."
        )
        lines.append("")
        if "draft_config_fragment" in e:
            lines += [
                "Draft JSON fragment:",
                "",
                "```json",
                json.dumps(e["draft_config_fragment"]),
                "```",
                "",
            ]
            lines += ["Training config:", "", "```yaml", *(f"{k}: {v}" for k, v in e["training_config"].items()), "```"]
            lines += ["", f"`{e['command']}`; keys read: {e['keys']}.", *(f"- {n}" for n in e["notes"]), ""]
        else:
            lines += ["```", e["command"], "```", ""]
    return lines
