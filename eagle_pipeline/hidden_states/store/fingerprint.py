"""The extraction fingerprint: every setting and input that decides what a hidden-state shard holds.

It is stored with each shard (index metadata and safetensors metadata, key `fingerprint`), and it is the one record
there of the facts it covers (layers, final state, layout, quantization, engine): readers take them from
`recorded_fingerprint`. A finished shard is reused only when its
fingerprint equals the one asked for now; otherwise it is refused with the fields that differ, or, on explicit
request, extracted again with the old files moved aside (`shards.prepare_shard`). See docs/hidden_states.md §6.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from eagle_pipeline.drafter_types import POST_NORM, PRE_NORM
from eagle_pipeline.hidden_states.settings import SHARDS
from eagle_pipeline.hidden_states.store.merged import merged_parts
from eagle_pipeline.merge.manifest import MANIFEST_NAME
from eagle_pipeline.shared.storage import file_sha256, read_json

FINGERPRINT_META_KEY = "fingerprint"
ENGINE_IN_PROCESS = "in_process"  # transformers forward in this process; 'vllm' and 'torchrun' record their own
FINAL_STATES = (POST_NORM, PRE_NORM)
# Keys of a transformers config that do not change what the model computes (or are recorded elsewhere: the stored
# dtype is its own field), so that reloading the same checkpoint gives the same identity.
_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "attn_implementation",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "use_cache",
    }
)
_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
_WEIGHT_SAMPLES = 8  # chunks read per weight file
_WEIGHT_CHUNK = 256 * 1024
_PARAM_SAMPLES = 4096  # values read per parameter tensor


@dataclass(frozen=True)
class ExtractionFingerprint:
    """What a shard's states are a function of. `dtype=None` means "not pinned": a check run on a host that cannot
    tell which dtype the extraction host uses (a CPU pod checking GPU-made shards) compares every other field."""

    model: dict[str, Any]
    aux_layers: tuple[int, ...]
    final_state: str
    shard_size: int
    dtype: str | None
    merged_version: str
    engine: str = ENGINE_IN_PROCESS
    layout: str = SHARDS
    quantize: str = "none"  # fp8.QUANTIZE_MODES: how the states are stored
    # Sample ids of the shard's rows it holds no states for (vLLM, `too_long_rows: drop`), sorted; None where the
    # engine leaves nothing out. The servers' max_model_len and too_long_rows change what a shard holds only through
    # these rows, so they are recorded instead: a server restarted with a larger limit keeps every shard that lost
    # no row, and one that lost rows it could now take is stale.
    left_out: tuple[str, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["aux_layers"] = list(self.aux_layers)
        if self.left_out is None:
            del d["left_out"]  # the engines that never leave a row out record what they always did
        else:
            d["left_out"] = list(self.left_out)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ExtractionFingerprint:
        known = {f.name for f in fields(cls)}
        args = {k: v for k, v in d.items() if k in known}
        args["aux_layers"] = tuple(int(x) for x in d["aux_layers"])
        args["model"] = dict(d["model"])
        if d.get("left_out") is not None:
            args["left_out"] = tuple(str(x) for x in d["left_out"])
        return cls(**args)

    def digest(self) -> str:
        """A short stable id of this fingerprint (names the folder a superseded shard is moved to)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def diff(self, stored: ExtractionFingerprint) -> dict[str, tuple[Any, Any]]:
        """Field -> (on disk, wanted) for every field that differs; nested model fields as `model.<key>`.
        A field this fingerprint leaves unpinned (None) is not compared."""
        mine, theirs = _flat(self.to_dict()), _flat(stored.to_dict())
        return {
            k: (theirs.get(k), mine.get(k))
            for k in sorted(set(mine) | set(theirs))
            if mine.get(k) is not None and mine.get(k) != theirs.get(k)
        }


def recorded_fingerprint(meta: Mapping[str, Any]) -> ExtractionFingerprint:
    """The fingerprint a shard's index or safetensors metadata records (JSON text in the latter)."""
    raw = meta[FINGERPRINT_META_KEY]
    return ExtractionFingerprint.from_dict(json.loads(raw) if isinstance(raw, str) else raw)


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def describe_diff(diff: Mapping[str, tuple[Any, Any]]) -> str:
    """`field: old (on disk) -> new (now)` for each difference, one clause each."""
    return "; ".join(f"{k}: {_short(old)} (on disk) -> {_short(new)} (now)" for k, (old, new) in diff.items())


def _short(v: Any) -> str:
    if isinstance(v, str):
        return v if len(v) <= 24 else v[:12] + "..."  # a hash: its head tells two apart
    if isinstance(v, list) and len(v) > 3:  # rows left out: a shard may drop hundreds
        return f"{len(v)} items {json.dumps(v[:3])[:-1]}, ...]"
    return json.dumps(v)


# ---------------------------------------------------------------- model identity


def config_sha256(config: Any) -> str:
    """sha256 of a transformers config (object or dict) without the keys that do not change the computation."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    kept = {k: v for k, v in d.items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def weight_files_digest(model_dir: str | Path) -> dict[str, Any]:
    """A cheap identity of a checkpoint directory's weights: per file, its name, size and eight 256 KiB chunks
    spread over it (the safetensors header included). A different checkpoint or a fine-tune of the same shape
    changes it; hashing every byte (about 2 TB for Kimi-K2.5) would take longer than many shards' extraction."""
    files = sorted({p for g in _WEIGHT_GLOBS for p in Path(model_dir).glob(g) if p.is_file()})
    h = hashlib.sha256()
    total = 0
    for p in files:
        size = p.stat().st_size
        total += size
        h.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as fh:
            for k in range(_WEIGHT_SAMPLES):
                fh.seek(max(size - _WEIGHT_CHUNK, 0) * k // max(_WEIGHT_SAMPLES - 1, 1))
                h.update(fh.read(_WEIGHT_CHUNK))
    return {"weights_sha256": h.hexdigest(), "weight_files": len(files), "weight_bytes": total}


def model_dir_identity(model_dir: str | Path) -> dict[str, Any]:
    """Identity of a local transformers checkpoint: its config.json's sha256 and its weight files' digest."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a local transformers model directory (no config.json)")
    return {"kind": "local_dir", "config_sha256": file_sha256(path / "config.json"), **weight_files_digest(path)}


def parameters_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter's name, shape, dtype and up to 4,096 evenly spaced values: tells apart models
    of one shape with other weights (another seed, a fine-tune) at the cost of one small copy per tensor."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            step = max(flat.numel() // _PARAM_SAMPLES, 1)
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
            h.update(flat[::step][:_PARAM_SAMPLES].float().cpu().numpy().tobytes())
    return h.hexdigest()


def model_identity(model: torch.nn.Module) -> dict[str, Any]:
    """Identity of an in-memory model: that of its checkpoint directory when it was loaded from a local one (the
    same identity the configuration path computes without loading it), else its config and a parameter digest."""
    config = getattr(model, "config", None)
    path = str(getattr(model, "name_or_path", "") or getattr(config, "_name_or_path", "") or "")
    if path and (Path(path) / "config.json").is_file():
        return model_dir_identity(path)
    return {
        "kind": "in_memory",
        "config_sha256": config_sha256(config) if config is not None else None,
        "weights_sha256": parameters_digest(model),
    }


# ---------------------------------------------------------------- the merged table's version


def merged_version(merged_dir: str | Path) -> str:
    """The merged table's content version: sha256 over its files' names, rows and sha256 as the merge manifest
    records them (not the whole manifest, whose settings and config hash change with unrelated edits). The files
    are the manifest's (`merge.manifest.merged_shard_paths`, as extraction reads them); without a manifest, or
    where one of its files is missing, the files present are hashed instead."""
    parts = merged_parts(merged_dir)
    manifest = Path(merged_dir) / MANIFEST_NAME
    entries: list[list[Any]] = []
    if manifest.exists() and all(p.exists() for p in parts):
        shards = read_json(manifest).get("shards") or []
        entries = sorted([Path(s["path"]).name, int(s["rows"]), str(s["sha256"])] for s in shards)
    if not entries:
        entries = [[p.name, p.stat().st_size, file_sha256(p)] for p in parts if p.exists()]
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()
