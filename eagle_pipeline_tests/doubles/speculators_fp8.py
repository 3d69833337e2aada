"""A reader of speculators' FP8 sample files, written from the contract alone (no project code, no speculators code).

The contract (vllm-project/speculators #1028, `fp8` backend; `FP8Transfer` loads `hs_{i}.safetensors`):

* `hidden_states`: `float8_e4m3fn` [T, L, H];
* `hidden_states_scales`: `float32`, broadcast against `hidden_states` (speculators writes [T, 1, 1]; any shape
  that broadcasts, such as [T, L, 1], goes through the same product);
* `token_ids`: integer [T];
* dequantized on load as `fp8.to(dtype) * scale.to(dtype)`; the trainer then takes `hidden_states[:, :-1]`
  flattened as the aux input and `hidden_states[:, -1]` as the verifier's last state (`train/data.py`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file


def load_fp8_sample(path: Path, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """`{"hidden_states": [T, L, H] in dtype, "token_ids": [T]}` as speculators' FP8 transfer hands them on."""
    raw = load_file(str(path))
    fp8, scales, ids = raw["hidden_states"], raw["hidden_states_scales"], raw["token_ids"]
    assert fp8.dtype == torch.float8_e4m3fn and fp8.dim() == 3, (path, fp8.dtype, fp8.shape)
    assert scales.dtype == torch.float32, (path, scales.dtype)
    assert torch.broadcast_shapes(scales.shape, fp8.shape) == fp8.shape, (path, scales.shape, fp8.shape)
    assert not ids.is_floating_point() and ids.shape == (fp8.shape[0],), (path, ids.dtype, ids.shape)
    return {"hidden_states": fp8.to(dtype) * scales.to(dtype), "token_ids": ids}


def trainer_inputs(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What speculators' eagle3 data loader builds from a loaded sample."""
    states = sample["hidden_states"]
    return {
        "hidden_states": states[:, :-1].flatten(start_dim=1),
        "input_ids": sample["token_ids"],
        "verifier_last_hidden_states": states[:, -1],
    }
