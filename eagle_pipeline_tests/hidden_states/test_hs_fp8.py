"""fp8: e4m3 states with a scale per token per layer, within e4m3's bound, read back through speculators' contract."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from eagle_pipeline.hidden_states.store import fp8
from eagle_pipeline_tests.doubles.speculators_fp8 import load_fp8_sample, trainer_inputs


def spread_states(tokens: int = 64, layers: int = 4, hidden: int = 256, seed: int = 0) -> torch.Tensor:
    """bf16 [T, L, H]: per-layer RMS growing 50x from the first layer to the last, two outlier channels 100x."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, layers, hidden, generator=g)
    x *= torch.logspace(0, torch.log10(torch.tensor(50.0)).item(), layers).view(1, layers, 1)
    x[..., :2] *= 100
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
def test_round_trip_within_e4m3_bound_everywhere(granularity: str, dtype: torch.dtype) -> None:
    x = spread_states().to(dtype)
    x[3] = 0  # an all-zero token
    x[5, 0, 7] = 1e-6  # far below the smallest normal of its row's scale: the subnormal step
    kept = x.clone()
    q = fp8.quantize(x, granularity)
    assert torch.equal(x, kept)  # the caller's states are not scaled in place
    assert q.states.dtype == torch.float8_e4m3fn and q.scales.dtype == torch.float32
    expected = (64, 4, 1) if granularity == fp8.PER_TOKEN_LAYER else (64, 1, 1)
    assert tuple(q.scales.shape) == expected
    assert bool(torch.isfinite(q.scales).all()) and bool((q.scales > 0).all())
    assert bool((q.scales[3] == 1).all())  # the zero token's scale is 1, not 0/448
    back = fp8.dequantize(q.states, q.scales)
    assert back.dtype == torch.bfloat16 and bool((back[3] == 0).all())
    err = (back.float() - x.float()).abs()
    bound = fp8.error_bound(x, q.scales)
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float((err / bound).max()) > 0.25  # the bound is near what e4m3 does, not a loose ceiling


def test_per_layer_scales_no_worse_than_per_token_on_every_layer() -> None:
    x = spread_states(seed=1)
    errors = {}
    for granularity in fp8.GRANULARITIES:
        q = fp8.quantize(x, granularity)
        err = fp8.dequantize(q.states, q.scales, torch.float32) - x.float()
        errors[granularity] = err.pow(2).mean(dim=(0, 2)).sqrt() / x.float().pow(2).mean(dim=(0, 2)).sqrt()
    assert bool((errors[fp8.PER_TOKEN_LAYER] <= errors[fp8.PER_TOKEN]).all()), errors
    assert float(errors[fp8.PER_TOKEN][0] / errors[fp8.PER_TOKEN_LAYER][0]) > 2  # the quiet first layer gains most


def test_non_finite_states_and_bad_shapes_are_refused() -> None:
    x = spread_states()
    x[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        fp8.quantize(x)
    with pytest.raises(ValueError, match=r"\[T, L, H\]"):
        fp8.quantize(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="granularity"):
        fp8.quantize(torch.zeros(4, 2, 8), "tensor")


def test_speculators_contract_reader_takes_per_layer_scales(tmp_path) -> None:
    x = spread_states(tokens=16)
    ids = torch.arange(16, dtype=torch.int64)
    q = fp8.quantize(x)
    path = tmp_path / "hs_0.safetensors"
    save_file({**q.tensors(), "token_ids": ids}, str(path))
    sample = load_fp8_sample(path)
    assert torch.equal(sample["token_ids"], ids)
    for layer in range(x.shape[1]):
        err = (sample["hidden_states"][:, layer].float() - x[:, layer].float()).abs()
        assert bool((err <= fp8.error_bound(x[:, layer], q.scales[:, layer])).all()), layer
    inputs = trainer_inputs(sample)
    assert tuple(inputs["hidden_states"].shape) == (16, 3 * 256)
    assert tuple(inputs["verifier_last_hidden_states"].shape) == (16, 256)


def test_fp8_nbytes_is_the_safetensors_payload(tmp_path) -> None:
    q = fp8.quantize(spread_states(tokens=10, layers=4, hidden=32))
    assert fp8.fp8_nbytes(10, 4, 32) == q.states.nbytes + q.scales.nbytes == 10 * 4 * 32 + 10 * 4 * 4
