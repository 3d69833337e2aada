"""The target's final RMSNorm and lm_head, recorded once beside the shards.

The project stores the final hidden state **pre-norm** (the last decoder layer's output, what vLLM's
`extract_hidden_states` gives). The post-norm state a SpecForge trainer wants is `final_norm(pre)`, and the audit's
teacher check needs `lm_head(final_norm(pre))`; both need only these two weights and the norm's epsilon, never the
model. Any engine records them with `save_target_head` (the transformers engine takes them from the loaded model;
the vLLM engine, without the model in process, reads only those two tensors from the checkpoint's safetensors files:
`checkpoint_head`, once per checkpoint into a head cache that later shard runs read: `cached_checkpoint_head`).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..storage import atomic_path, file_sha256
from .fingerprint import FINAL_STATES
from .layers import get_backbone

TARGET_HEAD_FILE = "target_head.safetensors"
POST_NORM, PRE_NORM = FINAL_STATES


@dataclass(frozen=True)
class TargetHead:
    norm_weight: torch.Tensor  # [H]
    eps: float
    lm_head: torch.Tensor  # [V, H]
    meta: dict[str, Any]

    def prepared(self, device: str | torch.device) -> TargetHead:
        """This head on `device` with the lm_head in fp32 once (not per call): 4.7 GB for Kimi's 163,840 x 7,168."""
        return TargetHead(
            self.norm_weight.to(device),
            self.eps,
            self.lm_head.to(device=device, dtype=torch.float32),
            self.meta,
        )

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm exactly as transformers' Llama/DeepSeek-V3 norm computes it: fp32 statistics, weight applied
        to the result cast back to the input dtype (bit-equal to the model's own `norm` on the same dtype)."""
        x32 = x.to(torch.float32)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm_weight.to(x.dtype) * normed.to(x.dtype)

    def logits(self, final: torch.Tensor, convention: str) -> torch.Tensor:
        """fp32 logits of final states stored under `convention` ('pre_norm' gets the final norm first)."""
        if convention not in FINAL_STATES:
            raise ValueError(f"unknown final-state convention {convention!r}; expected one of {FINAL_STATES}")
        post = self.final_norm(final) if convention == PRE_NORM else final
        return post.to(torch.float32) @ self.lm_head.to(device=final.device, dtype=torch.float32).T  # no-op if prepared

    def top1(self, final: torch.Tensor, convention: str, *, chunk: int = 256) -> torch.Tensor:
        """argmax of `logits` per position, `chunk` positions at a time (a [T, V] fp32 block is 0.65 MB per
        position at Kimi's vocabulary)."""
        return (
            torch.cat([self.logits(final[i : i + chunk], convention).argmax(-1) for i in range(0, len(final), chunk)])
            if len(final)
            else torch.zeros(0, dtype=torch.int64)
        )


def save_target_head(
    out_dir: str | Path, *, norm_weight: torch.Tensor, eps: float, lm_head: torch.Tensor, source: dict[str, Any]
) -> tuple[Path, str]:
    """Write `{out_dir}/target_head.safetensors` atomically; returns (path, sha256). Idempotent: an identical file
    is left alone, a different one replaced (the shards' metadata records the sha256 of the one they were cut with)."""
    from safetensors.torch import save_file

    path = Path(out_dir) / TARGET_HEAD_FILE
    tensors = {
        "final_norm.weight": norm_weight.detach().cpu().contiguous(),
        "lm_head.weight": lm_head.detach().cpu().contiguous(),
    }
    meta = {"final_norm_eps": repr(float(eps)), "source": json.dumps(source, sort_keys=True)}
    if path.exists():
        try:
            old = load_target_head(path.parent)
            if (
                old.eps == float(eps)
                and torch.equal(old.norm_weight, tensors["final_norm.weight"])
                and torch.equal(old.lm_head, tensors["lm_head.weight"])
            ):
                return path, file_sha256(path)
        except Exception:  # an unreadable file is simply rewritten
            pass
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    return path, file_sha256(path)


def save_target_head_from_model(
    model: torch.nn.Module, out_dir: str | Path, source: dict[str, Any]
) -> tuple[Path, str]:
    """Record a transformers *ForCausalLM's final norm and lm_head."""
    norm: Any = get_backbone(model).norm
    head: Any = getattr(model, "lm_head", None)
    if head is None:
        raise TypeError(f"{type(model).__name__}: no lm_head to record")
    return save_target_head(
        out_dir,
        norm_weight=_full(norm.weight),
        eps=final_norm_eps(model),
        lm_head=_full(head.weight),
        source=source,
    )


def _full(weight: Any) -> torch.Tensor:
    """The whole tensor of a tensor-parallel (DTensor) weight; every rank must call this (it gathers)."""
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight


# Where checkpoints keep the final norm, the lm_head and the (tied) input embedding: a plain *ForCausalLM, Kimi-K2.5's
# remote-code VLM wrapper (`language_model.`), transformers 5's VLM layout (`model.language_model.`).
NORM_KEYS = ("model.norm.weight", "language_model.model.norm.weight", "model.language_model.norm.weight")
LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight")
EMBED_KEYS = (
    "model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
)
SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class CheckpointHead:
    """Where a checkpoint directory holds its final norm and lm_head (found and shape-checked; nothing read yet)."""

    model_dir: Path
    norm_key: str
    norm_file: Path
    head_key: str  # the lm_head, or the input embedding when the config ties them
    head_file: Path
    eps: float
    hidden_size: int
    vocab_size: int

    def source(self) -> dict[str, Any]:
        return {
            "checkpoint": str(self.model_dir),
            "final_norm": f"{self.norm_file.name}:{self.norm_key}",
            "lm_head": f"{self.head_file.name}:{self.head_key}",
        }

    def load(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(final norm weight [H], lm_head [V, H]) as stored: only these two tensors are read."""
        from safetensors import safe_open

        out = []
        for key, file in ((self.norm_key, self.norm_file), (self.head_key, self.head_file)):
            with safe_open(str(file), framework="pt") as f:
                out.append(f.get_tensor(key))
        return out[0], out[1]


def _checkpoint_files(model_dir: Path) -> tuple[dict[str, Path], str]:
    """Every tensor name of the checkpoint -> the file holding it, and what was read to know it (for errors)."""
    from safetensors import safe_open

    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        return {k: model_dir / f for k, f in weight_map.items()}, str(index)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{model_dir}: no {SAFETENSORS_INDEX} and no *.safetensors file. The vllm engine records the target's "
            f"final norm and lm_head for the shards' audit from its checkpoint: put the checkpoint there (or at "
            f"least {SAFETENSORS_INDEX} and the files holding {NORM_KEYS[0]} and {LM_HEAD_KEYS[0]})"
        )
    keys: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys.update(dict.fromkeys(f.keys(), file))
    return keys, ", ".join(str(f) for f in files)


def checkpoint_head(model_dir: str | Path) -> CheckpointHead:
    """Find the final norm weight and lm_head (or the tied embedding) in a local checkpoint's safetensors files,
    sharded (`model.safetensors.index.json`) or not, under the plain or a VLM wrapper's names, and the norm's
    epsilon in its config. Raises FileNotFoundError naming the file when a tensor or a file is absent, and
    ValueError when a shape disagrees with the config."""
    from safetensors import safe_open

    from .model import load_text_config

    d = Path(model_dir)
    config_path = d / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{d} is not a local transformers model directory (no config.json)")
    top = json.loads(config_path.read_text())
    text = load_text_config(d)
    keys, where = _checkpoint_files(d)
    tied = bool(text.get("tie_word_embeddings", top.get("tie_word_embeddings", False)))
    norm_key = next((k for k in NORM_KEYS if k in keys), None)
    head_key = next((k for k in (*LM_HEAD_KEYS, *(EMBED_KEYS if tied else ())) if k in keys), None)
    for what, key, wanted in (
        ("final norm", norm_key, NORM_KEYS),
        ("lm_head", head_key, LM_HEAD_KEYS + (EMBED_KEYS if tied else ())),
    ):
        if key is None:
            raise FileNotFoundError(f"{where}: no {what} tensor (looked for {', '.join(wanted)})")
    assert norm_key is not None and head_key is not None
    eps = text.get("rms_norm_eps")
    if eps is None:
        raise FileNotFoundError(f"{config_path}: no rms_norm_eps (the final norm's epsilon)")
    hidden, vocab = int(text["hidden_size"]), int(text["vocab_size"])
    shapes = {}
    for key in (norm_key, head_key):
        file = keys[key]
        if not file.is_file():
            raise FileNotFoundError(f"{file}: named by {where} for {key}, but absent")
        with safe_open(str(file), framework="pt") as f:
            if key not in set(f.keys()):  # a safe_open handle has no __contains__
                raise FileNotFoundError(f"{file}: has no tensor {key} ({where} says it does)")
            shapes[key] = tuple(f.get_slice(key).get_shape())
    if shapes[norm_key] != (hidden,) or shapes[head_key] != (vocab, hidden):
        raise ValueError(
            f"{d}: {norm_key} {shapes[norm_key]} and {head_key} {shapes[head_key]} do not match the config's "
            f"hidden_size {hidden} / vocab_size {vocab}"
        )
    return CheckpointHead(d, norm_key, keys[norm_key], head_key, keys[head_key], float(eps), hidden, vocab)


def save_target_head_from_checkpoint(
    found: CheckpointHead,
    out_dir: str | Path,
    *,
    cache_dir: str | Path | None = None,
    log: Callable[[str], None] | None = None,
) -> tuple[Path, str]:
    """Record the head `checkpoint_head` found: read straight from the checkpoint (never the whole model), or,
    with `cache_dir`, from the head cache there (`cached_checkpoint_head`), which only the first run reads it into."""
    norm, head = found.load() if cache_dir is None else cached_checkpoint_head(found, cache_dir, log=log)
    return save_target_head(out_dir, norm_weight=norm, eps=found.eps, lm_head=head, source=found.source())


class HeadCacheWarning(UserWarning):
    """A head cache file was unreadable or damaged (it is rebuilt from the checkpoint)."""


def checkpoint_head_key(found: CheckpointHead) -> str:
    """What identifies the head tensors of a checkpoint without reading them: its resolved directory, the sha256 of
    its safetensors index, and each head tensor's name, shape and file (resolved path, size, mtime and ctime: a
    file rewritten, replaced or copied over changes its ctime even when its mtime is restored)."""
    index = found.model_dir / SAFETENSORS_INDEX
    files = {}
    for key, file in ((found.norm_key, found.norm_file), (found.head_key, found.head_file)):
        st = file.stat()
        files[key] = [os.path.realpath(file), st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    ident = {
        "checkpoint": str(found.model_dir.resolve()),
        "index_sha256": file_sha256(index) if index.is_file() else None,
        "tensors": files,
        "hidden_size": found.hidden_size,
        "vocab_size": found.vocab_size,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def head_cache_path(found: CheckpointHead, cache_dir: str | Path) -> Path:
    """One cache file per checkpoint directory (a changed checkpoint replaces its entry, never adds one)."""
    name = hashlib.sha256(str(found.model_dir.resolve()).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"{found.model_dir.name}-{name}.safetensors"


def _tensors_sha256(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


def write_head_cache(path: str | Path, key: str, norm: torch.Tensor, head: torch.Tensor) -> None:
    """Write a head cache file atomically: the two tensors, the checkpoint's `key` and their bytes' sha256."""
    from safetensors.torch import save_file

    meta = {"checkpoint_head_key": key, "tensors_sha256": _tensors_sha256(norm, head)}
    with atomic_path(path) as tmp:
        save_file(
            {"final_norm.weight": norm.contiguous(), "lm_head.weight": head.contiguous()}, str(tmp), metadata=meta
        )


def read_head_cache(path: str | Path, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (norm, lm_head) a cache file holds for `key`; None when it holds another key (the checkpoint changed).
    Raises ValueError naming the file when it is unreadable or its tensors do not match their recorded sha256."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("checkpoint_head_key") != key:
                return None
            norm, head = f.get_tensor("final_norm.weight"), f.get_tensor("lm_head.weight")
    except Exception as exc:  # a truncated or overwritten file: safetensors' own errors do not name it
        raise ValueError(f"{path}: unreadable head cache ({type(exc).__name__}: {exc})") from exc
    if _tensors_sha256(norm, head) != meta.get("tensors_sha256"):
        raise ValueError(f"{path}: head cache tensors do not match their recorded sha256 (damaged file)")
    return norm, head


def cached_checkpoint_head(
    found: CheckpointHead, cache_dir: str | Path, *, log: Callable[[str], None] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(final norm weight, lm_head) of `found`, from its cache file under `cache_dir` when that holds this
    checkpoint's key (`checkpoint_head_key`), else read from the checkpoint once and cached. A damaged cache file
    is rebuilt with a `HeadCacheWarning` naming it."""
    path, key = head_cache_path(found, cache_dir), checkpoint_head_key(found)
    if path.exists():
        try:
            cached = read_head_cache(path, key)
        except ValueError as exc:
            message = f"{exc}; rebuilding it from {found.model_dir}"
            warnings.warn(message, HeadCacheWarning, stacklevel=2)
            if log is not None:
                log(f"warning: {message}")
            cached = None
        if cached is not None:
            return cached
    norm, head = found.load()
    write_head_cache(path, key, norm, head)
    if log is not None:
        log(f"target head of {found.model_dir} cached in {path}")
    return norm, head


def final_norm_eps(model: torch.nn.Module) -> float:
    """The epsilon of a transformers model's final RMSNorm (`variance_epsilon` in Llama/DeepSeek, `eps` elsewhere)."""
    norm = get_backbone(model).norm
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None)
    if eps is None:
        raise TypeError(f"{type(norm).__name__}: the final norm has no epsilon to record")
    return float(eps)


def load_target_head(out_dir: str | Path, *, device: str = "cpu") -> TargetHead:
    from safetensors import safe_open

    path = Path(out_dir) / TARGET_HEAD_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"{path}: no recorded final norm / lm_head; re-extract the shards (extraction writes it) or record it "
            "with eagle_pipeline.hidden_states.head.save_target_head"
        )
    with safe_open(str(path), framework="pt", device=device) as f:
        meta = f.metadata() or {}
        return TargetHead(
            norm_weight=f.get_tensor("final_norm.weight"),
            eps=float(meta["final_norm_eps"]),
            lm_head=f.get_tensor("lm_head.weight"),
            meta={"source": json.loads(meta.get("source", "{}")), "path": str(path)},
        )
