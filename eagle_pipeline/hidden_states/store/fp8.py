"""FP8 (`float8_e4m3fn`) hidden states: quantize with a scale per token per layer, dequantize as speculators does.

speculators' FP8 backend (`hs_connectors/fp8_utils.py`, `transfer.FP8Transfer`, vllm-project/speculators #1028)
stores `hidden_states` [T, L, H] as e4m3 with fp32 `hidden_states_scales` [T, 1, 1] (one scale per token over all
layers, `scale = amax / 448`) and loads them as `fp8.to(dtype) * scale.to(dtype)`. That product broadcasts a
[T, L, 1] scale unchanged, so this module keeps one scale per token **per layer**: an early layer's residual stream
is far smaller than a late one's, and a shared amax spends the quiet layers' 3 mantissa bits on the loudest layer.
`benchmarks/bench_fp8.py` measures what each choice loses (docs/hidden_states.md, "FP8 states").

The key names are speculators': `STATES_KEY`, `SCALES_KEY` (and `token_ids` beside them in a sample file).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
STATES_KEY = "hidden_states"
SCALES_KEY = "hidden_states_scales"
QUANTIZE_NONE, QUANTIZE_FP8 = "none", "fp8"
QUANTIZE_MODES = (QUANTIZE_NONE, QUANTIZE_FP8)
# speculators' training command selects its FP8 reader with `--hidden-states-backend fp8` (the backend's registered
# name, #1028; the flag as in c05b95b's scripts/train.py and DataArgs.hidden_states_backend).
FP8_BACKEND = "fp8"
FP8_BACKEND_FLAG = "--hidden-states-backend"

# e4m3 keeps 3 mantissa bits: round-to-nearest of a normal value errs by at most half a unit in the last place,
# 2^-4 of the value; below the smallest normal (2^-6) the spacing is the subnormal step 2^-9, so at most 2^-10.
E4M3_RELATIVE_ERROR = 2.0**-4
E4M3_ABSOLUTE_ERROR = 2.0**-10

PER_TOKEN = "token"  # speculators': one scale per token over all layers, [T, 1, 1]
PER_TOKEN_LAYER = "token_layer"  # ours: one scale per token per layer, [T, L, 1]
GRANULARITIES = (PER_TOKEN, PER_TOKEN_LAYER)


@dataclass(frozen=True)
class Quantized:
    """e4m3 states and the fp32 scales that broadcast against them (`dequantize`)."""

    states: torch.Tensor  # float8_e4m3fn [T, L, H]
    scales: torch.Tensor  # float32 [T, L, 1] (or speculators' [T, 1, 1])

    def tensors(self) -> dict[str, torch.Tensor]:
        """Under speculators' key names."""
        return {STATES_KEY: self.states, SCALES_KEY: self.scales}


def scales_for(states: torch.Tensor, granularity: str = PER_TOKEN_LAYER) -> torch.Tensor:
    """fp32 scales `amax / 448` of [T, L, H] states: per token per layer [T, L, 1], or per token [T, 1, 1].

    An all-zero row has amax 0: its scale is 1 (finite and > 0, which the state audit requires), and its zeros
    quantize to zeros exactly.
    """
    if states.dim() != 3:
        raise ValueError(f"FP8 quantization takes hidden states [T, L, H]; got shape {tuple(states.shape)}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"FP8 scale granularity {granularity!r}: expected one of {', '.join(GRANULARITIES)}")
    dims = (-1,) if granularity == PER_TOKEN_LAYER else (-2, -1)
    amax = torch.empty((states.shape[0], *((states.shape[1], 1) if granularity == PER_TOKEN_LAYER else (1, 1))))
    for block in _token_blocks(states):
        # amax in the states' own dtype is exact (and NaN if any value is), then fp32 for the scale
        amax[block] = states[block].detach().abs().amax(dim=dims, keepdim=True)
    return scales_from_amax(amax)


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """`scales_for`'s scales from the largest |x| of each row (any shape: [T, L, 1] per token per layer)."""
    amax = amax.to(SCALE_DTYPE)
    return torch.where(amax == 0, torch.ones_like(amax), amax / E4M3_MAX)


def quantize(
    states: torch.Tensor, granularity: str = PER_TOKEN_LAYER, *, scales: torch.Tensor | None = None
) -> Quantized:
    """[T, L, H] states (any float dtype) as e4m3 with fp32 scales; NaN or inf states are refused. `scales`: the
    ones `scales_for` would give, when a check already reduced every row (`scales_from_amax`; the vLLM engine's
    validator does), so the states are read once more only to quantize."""
    if scales is None:
        scales = scales_for(states, granularity)
    if not bool(torch.isfinite(scales).all()):  # amax carries any NaN or inf of its row
        raise ValueError("FP8 quantization refused: the hidden states hold NaN or inf values")
    out = torch.empty(states.shape, dtype=FP8_DTYPE)
    # In blocks of a few tokens through one fp32 buffer that stays in the CPU's cache: a whole row's fp32 quotient
    # would be 4 B a value (30 GB for one of Kimi's 262k-token rows) and 2.5x slower (docs/hidden_states.md §15).
    # Each token's values depend only on its own scales, so the result is the same.
    buf = torch.empty((_block_tokens(states), *states.shape[1:]), dtype=SCALE_DTYPE)
    for block in _token_blocks(states):
        part = buf[: block.stop - block.start]
        torch.div(states[block], scales[block], out=part)
        # The clamp only catches fp32 rounding of amax / (amax / 448) a hair above 448 (e4m3fn has no inf).
        out[block] = part.clamp_(-E4M3_MAX, E4M3_MAX)
    return Quantized(states=out, scales=scales)


_BLOCK_VALUES = 1 << 19  # 2 MB of fp32 per block: 18 tokens of Kimi's [4, 7168]


def _block_tokens(states: torch.Tensor) -> int:
    return max(1, _BLOCK_VALUES // max(1, states[0].numel())) if states.shape[0] else 1


def _token_blocks(states: torch.Tensor) -> list[slice]:
    n, step = states.shape[0], _block_tokens(states)
    return [slice(start, min(start + step, n)) for start in range(0, n, step)]


def sample_file(states: torch.Tensor, token_ids: torch.Tensor, *, scales: torch.Tensor | None = None) -> bytes:
    """speculators' FP8 `hs_{i}.safetensors` of [T, L, H] states: e4m3 `hidden_states`, fp32
    `hidden_states_scales` [T, L, 1] and int64 `token_ids`, what its fp8 backend loads. Every engine writes it."""
    from safetensors.torch import save

    q = quantize(states, scales=scales)
    return save({**q.tensors(), "token_ids": token_ids.to(torch.int64).contiguous()})


def dequantize(states: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """speculators' `FP8Transfer` product: `fp8.to(dtype) * scale.to(dtype)`, scales broadcast."""
    return states.to(dtype) * scales.to(dtype)


def dequantize_checked(path: object, states: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`dequantize` to fp32 for the project's readers, refusing (naming `path`) what no quantizer here writes:
    states not e4m3, scales not fp32 or not broadcasting, a scale not finite and > 0, a NaN after dequantizing."""
    if states.dtype != FP8_DTYPE or scales.dtype != SCALE_DTYPE:
        raise ValueError(f"{path}: FP8 states {states.dtype} with scales {scales.dtype}; expected {FP8_DTYPE}, fp32")
    if states.dim() != 3 or torch.broadcast_shapes(scales.shape, states.shape) != states.shape:
        raise ValueError(f"{path}: scales {tuple(scales.shape)} do not broadcast against {tuple(states.shape)}")
    bad = int((~(torch.isfinite(scales) & (scales > 0))).sum())
    if bad:
        raise ValueError(f"{path}: {bad} FP8 scales not finite and > 0")
    out = dequantize(states, scales, torch.float32)
    nan = int(torch.isnan(out).sum())
    if nan:
        raise ValueError(f"{path}: {nan} NaN values after dequantizing (e4m3 NaN bytes in the file)")
    return out


def error_bound(original: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The largest |dequantize(quantize(x)) - x| e4m3 allows, elementwise (fp32), for states read back in `dtype`.

    Quantizing errs by at most 2^-4 |x| + 2^-10 s (s the scale); the product in `dtype` rounds the scale and the
    result once each, adding (2u + u^2) of the dequantized magnitude, u being `dtype`'s unit roundoff.
    """
    x = original.to(SCALE_DTYPE).abs()
    s = scales.to(SCALE_DTYPE)
    quantized = E4M3_RELATIVE_ERROR * x + E4M3_ABSOLUTE_ERROR * s
    u = torch.finfo(dtype).eps / 2
    return quantized + (x + quantized) * (2 * u + u * u)


def fp8_nbytes(tokens: int, layers: int, hidden: int) -> int:
    """Bytes of one sample's FP8 states and their per-token-per-layer fp32 scales (the safetensors payload)."""
    return tokens * layers * hidden + tokens * layers * torch.finfo(SCALE_DTYPE).bits // 8
