"""The target's final RMSNorm and lm_head, recorded once beside the shards.

The project stores the final hidden state **pre-norm** (the last decoder layer's output, what vLLM's
`extract_hidden_states` gives). The post-norm state a SpecForge trainer wants is `final_norm(pre)`, and the audit's
teacher check needs `lm_head(final_norm(pre))`; both need only these two weights and the norm's epsilon, never the
model. Any engine records them with `save_target_head` (the transformers engine takes them from the loaded model;
an engine without the model in process reads `model.norm.weight` and `lm_head.weight` from the checkpoint).
"""

from __future__ import annotations

import json
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
