"""What the pipeline needs to run extraction from its configuration: the device, the model, the plans."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from .model import KIMI_K25_TEXT_CONFIG, build_tiny_model, describe_model_config, load_text_config, tiny_config
from .plan import ExtractionPlan, plan_for_model

TINY_RANDOM = "tiny-random"


def resolve_device(device: str = "auto") -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'; anything else is returned as given (validated)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(
            f"hidden_states.device is {device!r} but torch sees no CUDA device (torch {torch.__version__})"
        )
    if device.startswith("cuda:") and int(device.split(":", 1)[1]) >= torch.cuda.device_count():
        raise RuntimeError(f"hidden_states.device is {device!r} but torch sees {torch.cuda.device_count()} GPU(s)")
    return device


GPU_LEASE_DIR_ENV = "EAGLE_GPU_LEASE_DIR"
GPU_LEASE_WAIT_ENV = "EAGLE_GPU_LEASE_WAIT_S"
DEFAULT_GPU_LEASE_WAIT_S = 1800.0


def _gpu_lease_name(index: int, n_gpus: int | None) -> str:
    # The GPU's UUID, not its index: processes with different CUDA_VISIBLE_DEVICES number the same GPU differently.
    if n_gpus is None:
        with contextlib.suppress(Exception):
            return f"gpu-{torch.cuda.get_device_properties(index).uuid}.lock"
    return f"gpu-index-{index}.lock"


@contextlib.contextmanager
def shard_device(
    device: str,
    shard: int,
    *,
    n_gpus: int | None = None,
    prefer: Sequence[str] = (),
    lease_dir: str | os.PathLike | None = None,
    wait_s: float | None = None,
    poll_s: float = 1.0,
    log: Callable[[str], None] | None = None,
) -> Iterator[str]:
    """The device one shard extracts on, held for the duration of the `with` block.

    'auto' and 'cuda' pick among the visible GPUs and lease the chosen one (an flock on a host-local file) so that
    runs admitted together by the 'gpu' pool never share a GPU; the first free one of `prefer` (devices this
    process already holds a model on), then cuda:{shard % n}, cuda:{shard+1 % n}, ... 'auto' without a GPU is
    'cpu'. An explicit device ('cpu', 'cuda:3') is used as given, without a lease. `n_gpus` overrides the count
    (tests); the lease directory defaults to $EAGLE_GPU_LEASE_DIR, else <tmp>/eagle_pipeline_gpu_leases.
    """
    if device not in ("auto", "cuda"):
        yield resolve_device(device)
        return
    count = torch.cuda.device_count() if n_gpus is None else n_gpus
    if count == 0:
        yield resolve_device(device)  # 'cpu' for auto; raises for cuda
        return
    import fcntl

    directory = Path(
        lease_dir or os.environ.get(GPU_LEASE_DIR_ENV) or Path(tempfile.gettempdir()) / "eagle_pipeline_gpu_leases"
    )
    directory.mkdir(parents=True, exist_ok=True)
    preferred = [int(d.split(":", 1)[1]) for d in prefer if d.startswith("cuda:") and int(d.split(":", 1)[1]) < count]
    order = list(dict.fromkeys([*preferred, *((shard + k) % count for k in range(count))]))
    wait = float(os.environ.get(GPU_LEASE_WAIT_ENV, DEFAULT_GPU_LEASE_WAIT_S)) if wait_s is None else wait_s
    deadline, next_log = time.monotonic() + wait, 0.0
    while True:
        for index in order:
            handle = open(directory / _gpu_lease_name(index, n_gpus), "a")  # noqa: SIM115 (held while the caller runs)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            try:
                yield f"cuda:{index}"
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
                handle.close()
            return
        now = time.monotonic()
        if now >= deadline:
            raise RuntimeError(
                f"no free GPU for shard {shard} after {wait:.0f} s: all {count} visible GPUs are leased by other "
                f"extractions (lease files in {directory}). Set the 'gpu' pool limit to the number of GPUs per host."
            )
        if log is not None and now >= next_log:
            log(f"shard {shard}: all {count} GPUs busy, waiting for one (up to {deadline - now:.0f} s more)")
            next_log = now + 60
        time.sleep(poll_s)


def load_extraction_model(model: str, *, family: str, seed: int, vocab_size: int, device: str) -> torch.nn.Module:
    """The model to extract from: a tiny random model of `family` (offline, seeded) or a local transformers dir.

    bf16 on CUDA, fp32 on CPU. Nothing is ever fetched from a hub.
    """
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if model == TINY_RANDOM:
        return build_tiny_model(vocab_size, family=family, seed=seed, device=device, dtype=dtype)
    path = Path(model)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"hidden_states.model: {path} is not a local transformers model directory (no config.json)"
        )
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    return loaded.to(device).eval()


def _facts(config: Any, name: str) -> dict[str, Any]:
    d = describe_model_config(config)
    return {
        "name": name,
        "hidden_size": d["hidden_size"],
        "num_layers": d["num_layers"],
        "total_params": d["params"],
        "active_params": d["matmul_active_params"],
    }


def plan_for_run(
    *,
    n_tokens: int,
    n_samples: int,
    target_model_config: str | None,
    extraction_model: str,
    extraction_family: str,
    vocab_size: int,
    aux_layers: tuple[int, ...] | None,
    shard_size: int,
    disk_budget_gb: float | None,
) -> dict[str, ExtractionPlan]:
    """Two plans over the merged tokens: 'target' (the real target model, what a production run costs) and
    'this_run' (the model configured for extraction here; the disk budget applies to it)."""
    budget = int(disk_budget_gb * 1e9) if disk_budget_gb is not None else None
    target = (
        _facts(load_text_config(target_model_config), str(target_model_config))
        if target_model_config
        else KIMI_K25_TEXT_CONFIG
    )
    if extraction_model == TINY_RANDOM:
        this_run = _facts(tiny_config(vocab_size, family=extraction_family), f"tiny-random {extraction_family}")
        dtype_bytes = 2 if torch.cuda.is_available() else 4
    else:
        this_run = _facts(load_text_config(extraction_model), extraction_model)
        dtype_bytes = 2
    common = dict(n_tokens=n_tokens, n_samples=n_samples, shard_size=shard_size)
    return {
        "target": plan_for_model(target, aux_layers=None, disk_budget_bytes=None, **common),
        "this_run": plan_for_model(
            this_run, aux_layers=aux_layers, dtype_bytes=dtype_bytes, disk_budget_bytes=budget, **common
        ),
    }
