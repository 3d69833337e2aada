"""Tolerances for floating-point results that reach the same value through different computation paths.

Two forwards of one model that differ in batching, padding, tensor-parallel splits or kernels are not bit-equal,
and which bits differ depends on the CPU (AVX2 vs AVX-512 kernels block their sums differently). Every test that
compares such results uses this module; exact equality (`torch.equal`) stays where the bytes must be equal: a copy,
a rename, a slice, the same kernel on the same input.

Two kinds of difference, each with its bound:

- **Summation order** (same dtype, another path): a length-n reduction summed in another order moves by up to about
  sqrt(n)·eps·Σ|terms| (the probabilistic rounding bound, Higham & Mary 2019), and a stack of L layers passes each
  layer's difference on to the next, so the differences add up about linearly with depth:
  `SAFETY · eps(dtype) · sqrt(n) · (L + 1)`, n the longest reduction (hidden size, MLP or expert width, MLA's
  latent ranks and heads · v dims, or the sequence length that attention sums over); SAFETY = 4 because the kernels, and so the constant, vary by CPU.
- **Precision** (a bf16 / fp16 run against fp32): PyTorch accumulates low-precision matmuls in fp32, so what differs
  is the rounding of every layer's output to the narrow type, eps/2 each, which random-walks through the residual
  stream: `eps(dtype)/2 · sqrt(L + 1)` (already a bound on the sum, not a typical value).

Measured on a 2-core AMD EPYC (AVX2, the CPU where the older fixed 1e-5 failed) over the suite's 198 comparisons:
the worst element used 0.14 of the summation-order bound (4.9e-5 for the tiny 8-layer models) and 0.26 of the
precision bound (1.2e-2 for bf16), so each bound fails a layer off by one (differences of order 1) and keeps a
margin of 4x or more for other CPUs.

Both are relative; the absolute part scales them by the root-mean-square of the expected tensor, since the Σ|terms|
of the reductions that produced it scale with its magnitude (elements near zero would otherwise need an infinite
relative tolerance).
"""

from __future__ import annotations

import math
from typing import Any

import torch

SAFETY = 4.0  # the summation-order constant differs between CPUs' kernels; the norm and softmax amplify a little


def _widest_reduction(config: Any, tokens: int) -> int:
    heads = getattr(config, "num_attention_heads", 0) or 0
    widths = [
        getattr(config, "hidden_size", 0),
        getattr(config, "intermediate_size", 0),
        getattr(config, "moe_intermediate_size", 0) or 0,
        # MLA (DeepSeek-V3, Kimi): kv_b_proj and q_b_proj reduce over the latent ranks, o_proj over heads · v dims
        getattr(config, "kv_lora_rank", 0) or 0,
        getattr(config, "q_lora_rank", 0) or 0,
        heads * (getattr(config, "v_head_dim", 0) or 0),
        tokens,
    ]
    return max(int(w or 0) for w in widths)


def reorder_tolerance(config: Any, *, tokens: int, dtype: torch.dtype = torch.float32) -> float:
    """Relative tolerance for one model's forward computed along two paths in `dtype` (summation order differs)."""
    n = _widest_reduction(config, tokens)
    return SAFETY * torch.finfo(dtype).eps * math.sqrt(n) * (config.num_hidden_layers + 1)


def precision_tolerance(config: Any, *, dtype: torch.dtype) -> float:
    """Relative tolerance for a forward run in a narrower `dtype` against the same forward in fp32."""
    return torch.finfo(dtype).eps / 2 * math.sqrt(config.num_hidden_layers + 1)


def _scale(expected: torch.Tensor) -> float:
    return float(expected.double().pow(2).mean().sqrt()) if expected.numel() else 0.0


def assert_forwards_close(actual: torch.Tensor, expected: torch.Tensor, config: Any, *, what: str = "") -> None:
    """`actual` and `expected` are one model's states reached along two paths: equal within the summation-order
    bound (same dtype) or the precision bound (`actual` narrower than fp32 `expected`)."""
    if actual.dtype == expected.dtype:
        rel = reorder_tolerance(config, tokens=expected.shape[-2] if expected.dim() > 1 else 1, dtype=expected.dtype)
        kind = "summation order"
    else:
        rel = precision_tolerance(config, dtype=actual.dtype)
        kind = f"{actual.dtype} rounding"
        actual = actual.to(expected.dtype)
    atol = rel * _scale(expected)
    torch.testing.assert_close(
        actual,
        expected,
        rtol=rel,
        atol=atol,
        msg=lambda m: f"{what}: {m}\n({kind} bound: rtol {rel:.2e}, atol {atol:.2e})",
    )
