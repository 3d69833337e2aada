"""The cross-path tolerance helper fails what it must: a difference beyond its bound, a wrong layer."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from .tolerances import assert_forwards_close, precision_tolerance, reorder_tolerance

CONFIG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8)


def test_bounds_follow_the_computation():
    fp32 = reorder_tolerance(CONFIG, tokens=10)
    assert reorder_tolerance(CONFIG, tokens=512) == pytest.approx(fp32 * 2)  # sqrt(512 / 128): attention dominates
    deeper = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=17)
    assert reorder_tolerance(deeper, tokens=10) == pytest.approx(fp32 * 2)  # (17 + 1) / (8 + 1)
    assert reorder_tolerance(CONFIG, tokens=10, dtype=torch.bfloat16) > 1e4 * fp32
    assert precision_tolerance(CONFIG, dtype=torch.bfloat16) == pytest.approx(2**-7 / 2 * 3)  # bf16 eps = 2^-7


def test_helper_passes_rounding_and_fails_beyond_it():
    torch.manual_seed(0)
    expected = torch.randn(32, 64)
    rel = reorder_tolerance(CONFIG, tokens=32)
    assert_forwards_close(expected * (1 + rel / 4), expected, CONFIG)
    with pytest.raises(AssertionError, match="summation order bound"):
        assert_forwards_close(expected * (1 + 3 * rel), expected, CONFIG, what="row 0")
    other_layer = torch.randn(32, 64)
    with pytest.raises(AssertionError, match="row 1"):
        assert_forwards_close(other_layer, expected, CONFIG, what="row 1")
    assert_forwards_close(expected.to(torch.bfloat16), expected, CONFIG)  # bf16 rounding alone is within its bound
    with pytest.raises(AssertionError, match="bfloat16 rounding bound"):
        assert_forwards_close((expected * 1.05).to(torch.bfloat16), expected, CONFIG)
