"""What the pipeline needs to run extraction from its configuration: the device, the model, the fingerprint."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from eagle_pipeline.hidden_states.engines.engine import RunFacts
from eagle_pipeline.hidden_states.engines.extract import default_state_dtype
from eagle_pipeline.hidden_states.layouts.trainer_layouts import layout_of
from eagle_pipeline.hidden_states.models.layers import resolve_aux_layers
from eagle_pipeline.hidden_states.models.model import (
    TINY_RANDOM,
    build_tiny_model,
    describe_model_config,
    load_text_config,
    tiny_config,
)
from eagle_pipeline.hidden_states.store.fingerprint import (
    ExtractionFingerprint,
    config_sha256,
    merged_version,
    model_dir_identity,
)
from eagle_pipeline.hidden_states.store.format import dtype_name

if TYPE_CHECKING:
    from eagle_pipeline.hidden_states.settings import HiddenStatesConfig


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
    dtype = default_state_dtype(device)
    if model == TINY_RANDOM:
        return build_tiny_model(vocab_size, family=family, seed=seed, device=device, dtype=dtype)
    path = Path(model)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"hidden_states.model: {path} is not a local transformers model directory (no config.json)"
        )
    from transformers import AutoModelForCausalLM

    loaded = cast(torch.nn.Module, AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype))
    return loaded.to(device).eval()


def materialized_model_dir(model: str, *, family: str, seed: int, vocab_size: int, cache_dir: Path) -> Path:
    """A checkpoint directory for `model`: itself, or the seeded tiny model saved once under `cache_dir` (what
    torchrun's ranks load and where the vllm engine reads the head of the model the loopback double serves)."""
    if model != TINY_RANDOM:
        return Path(model)
    d = cache_dir / f"tiny-random-{family}-seed{seed}-vocab{vocab_size}"
    if not (d / "config.json").exists():
        tiny: Any = load_extraction_model(model, family=family, seed=seed, vocab_size=vocab_size, device="cpu")
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=cache_dir))
        tiny.save_pretrained(tmp)
        try:
            os.replace(tmp, d)
        except OSError:  # another shard run saved the same seeded model first
            if not (d / "config.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    return d


def model_identity_for_spec(model: str, *, family: str, seed: int, vocab_size: int) -> dict[str, Any]:
    """The identity of the model `load_extraction_model` would load, computed without loading it.

    A tiny random model is named by its recipe (family, seed, vocabulary and the config's hash); whether it was
    initialised on CUDA or the CPU (different random streams) follows the stored dtype, a field of its own."""
    if model == TINY_RANDOM:
        return {
            "kind": TINY_RANDOM,
            "family": family,
            "seed": seed,
            "vocab_size": vocab_size,
            "config_sha256": config_sha256(tiny_config(vocab_size, family=family)),
        }
    return model_dir_identity(model)


def _num_layers(model: str, family: str, vocab_size: int) -> int:
    if model == TINY_RANDOM:
        return int(tiny_config(vocab_size, family=family).num_hidden_layers)
    return int(describe_model_config(load_text_config(model))["num_layers"])


def fingerprint_for_config(
    h: HiddenStatesConfig,
    *,
    merged_dir: str | Path,
    vocab_size: int,
    facts: RunFacts | None = None,
    final_state: str | None = None,
    pin_dtype: bool = True,
) -> ExtractionFingerprint:
    """The fingerprint extraction under the configuration `h` gives its shards, without loading the model: the one
    place a fingerprint is built (`run.run_shard` records it; the checks and the export compare with it).

    `facts` (`engine.RunFacts`): what the engine knows beyond the settings (a model in memory, a stored dtype, rows
    it leaves out); without them (a check or an export on another host) the settings alone decide and the rows
    left out are not compared. `final_state` defaults to the convention `h.layout` stores
    (its `trainer_layouts.Layout.final_state`). `pin_dtype=False` leaves the dtype open, for a check that runs on a
    host other than the extraction's (a CPU step checking shards written on a GPU host); otherwise it is the dtype
    this host's device would store, or the engine's."""
    facts = facts or RunFacts()
    n_layers = facts.num_layers or _num_layers(h.model, h.family, vocab_size)
    vllm = h.engine == "vllm"  # the servers give the last layer's output before the norm, in their model's dtype
    dtype = facts.dtype or dtype_name(default_state_dtype(_device_type(h.device)))
    return ExtractionFingerprint(
        model=facts.model_identity
        if facts.model_identity is not None
        else model_identity_for_spec(h.model, family=h.family, seed=h.seed, vocab_size=vocab_size),
        aux_layers=resolve_aux_layers(h.aux_layers, n_layers),
        final_state=final_state or _engine_final_state(h),
        shard_size=h.shard_size,
        dtype=dtype if pin_dtype and not vllm else None,
        merged_version=merged_version(merged_dir),
        engine=h.engine,
        layout=h.layout,
        quantize=h.quantize,
        left_out=facts.left_out,
    )


def _engine_final_state(h: HiddenStatesConfig) -> str:
    """The convention every engine stores: the one `h.layout` needs (pre-norm for shards and speculators, the vLLM
    servers' own; post-norm for SpecForge)."""
    return layout_of(h.layout).final_state


def _device_type(device: str) -> str:
    """'cuda' or 'cpu': the kind of device `shard_device` gives a shard on this host (no lease is taken)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


class ModelCache:
    """Extraction models loaded once per (model, family, seed, vocab_size, device) per process, least recently
    used evicted first, so consecutive shards in one process (in-process executor, `execute_in_process`) skip the
    load. Spawned step processes start empty; a forked child drops what it inherited (CUDA state does not survive
    fork); the lock stops two threads loading the same model twice."""

    def __init__(self, max_models: int = 2):
        self.max_models = max_models
        self._models: dict[tuple[str, str, int, int, str], torch.nn.Module] = {}
        self._lock = threading.Lock()
        self._inherited: list[dict[tuple[str, str, int, int, str], torch.nn.Module]] = []

    def get(self, model: str, family: str, seed: int, vocab_size: int, device: str) -> torch.nn.Module:
        key = (model, family, seed, vocab_size, device)
        with self._lock:
            if key in self._models:
                self._models[key] = self._models.pop(key)
                return self._models[key]
            while len(self._models) >= self.max_models:
                del self._models[next(iter(self._models))]
            self._models[key] = load_extraction_model(
                model, family=family, seed=seed, vocab_size=vocab_size, device=device
            )
            return self._models[key]

    def devices(self) -> list[str]:
        """Devices this process holds an extraction model on, most recently used first."""
        return [key[-1] for key in reversed(list(self._models))]

    def facts(self) -> RunFacts:
        """Nothing beyond the settings: the cache loads the model `hidden_states.model` names."""
        return RunFacts()

    def models(self) -> list[torch.nn.Module]:
        return list(self._models.values())

    def forget_after_fork(self) -> None:
        # The child's copies of its parent's models stay referenced, so that no tensor destructor runs against the
        # parent's device memory; a lock held by another parent thread at fork time would never be released in the
        # child, so the child gets a new one.
        self._inherited.append(self._models)
        self._models, self._lock = {}, threading.Lock()


MODEL_CACHE = ModelCache()
os.register_at_fork(after_in_child=MODEL_CACHE.forget_after_fork)
