"""Tensor (and expert) parallel extraction in transformers: one shard per `torchrun` world.

The shard run starts `torchrun --nproc-per-node tp_size -m eagle_pipeline.hidden_states.engines.engine_torchrun ...`; every
rank loads the model with transformers' `DistributedConfig(tp_size=..., ep_size=...)` and runs the same
`extract.extract_with_model` (the in-process writer: same batches, hooks, format) under the fingerprint the shard
run decided with; rank 0 writes the shard, the other ranks
write to a scratch directory that is deleted. For targets that fit one node in transformers; Kimi-K2.5 does not
(its INT4 experts decompress to bf16): use `engine: vllm` for it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eagle_pipeline.hidden_states.engines.engine import EngineResult, ExtractionPaths, RunFacts, ShardJob
from eagle_pipeline.hidden_states.engines.extract import default_state_dtype, extract_with_model
from eagle_pipeline.hidden_states.layouts.trainer_layouts import layout_of, plan_layout_target
from eagle_pipeline.hidden_states.models.model import load_text_config
from eagle_pipeline.hidden_states.models.world_split import is_routed_expert, world_ep_size
from eagle_pipeline.hidden_states.settings import DEFAULT_MAX_TOKENS_PER_BATCH
from eagle_pipeline.hidden_states.store.fingerprint import ExtractionFingerprint
from eagle_pipeline.hidden_states.store.format import read_index_meta, shard_paths, state_dtype
from eagle_pipeline.hidden_states.store.shards import ShardSummary

if TYPE_CHECKING:
    from eagle_pipeline.hidden_states.settings import HiddenStatesConfig

ENGINE_TORCHRUN = "torchrun"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class TorchrunShard:
    """One shard's world: what the shard run starts it with and what every rank reads (as one JSON argument).
    `fingerprint` is the shard's wanted `ExtractionFingerprint` (as a dict): the ranks extract exactly what it says
    (aux layers, final state, dtype, layout, quantization) and record it. `device` is `hidden_states.device`:
    'cpu' keeps the ranks on the CPU (gloo) on a GPU host, as the fingerprint's dtype then says."""

    model_dir: Path
    merged_dir: Path
    shard_index: int
    out_dir: Path
    tp_size: int
    fingerprint: dict[str, Any]
    ep_size: int | None = None
    max_tokens_per_batch: int = DEFAULT_MAX_TOKENS_PER_BATCH
    exports_dir: Path | None = None  # a trainer's layout: rank 0 writes its files under exports_dir / layout
    device: str = "auto"

    def __post_init__(self) -> None:
        for name in ("model_dir", "merged_dir", "out_dir"):
            object.__setattr__(self, name, Path(getattr(self, name)))
        if self.exports_dir is not None:
            object.__setattr__(self, "exports_dir", Path(self.exports_dir))
        if not layout_of(self.wanted.layout).states_in_shards and self.exports_dir is None:
            raise ValueError(f"the {self.wanted.layout} layout needs exports_dir (where its files go)")

    @property
    def wanted(self) -> ExtractionFingerprint:
        return ExtractionFingerprint.from_dict(self.fingerprint)

    def to_json(self) -> str:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return json.dumps(fields, sort_keys=True, default=str)  # the paths as strings

    @classmethod
    def from_json(cls, text: str) -> TorchrunShard:
        return cls(**json.loads(text))


def torchrun_argv(shard: TorchrunShard, *, port: int | None = None) -> list[str]:
    """The command one shard's world runs (the current interpreter's torch.distributed.run)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(shard.tp_size),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port or _free_port()),
        "-m",
        "eagle_pipeline.hidden_states.engines.engine_torchrun",
        "--shard",
        shard.to_json(),
    ]


def run_world(
    shard: TorchrunShard, *, timeout_s: float | None = None, log: Callable[[str], None] | None = None
) -> ShardSummary:
    """Extract one shard with a `tp_size`-process torchrun world, as `shard.fingerprint` says; whether the shard is
    to be extracted was decided before (`run.run_shard`). The world runs with `world_split.world_ep_size` (a MoE
    model's routed experts split whatever the installed transformers' TP plan does; an `ep_size` that would
    replicate them raises ExpertsReplicated before any process starts). A failed world raises RuntimeError naming
    the shard and the end of its output; rank 0's atomic writes leave no partial shard."""
    config = load_text_config(shard.model_dir)
    # The routed experts are split on purpose: EP where the installed transformers' TP plan would replicate them.
    s = dataclasses.replace(shard, ep_size=world_ep_size(config, shard.tp_size, shard.ep_size))
    argv = torchrun_argv(s)
    if log is not None:
        log(f"shard {s.shard_index:05d}: {' '.join(argv)}")
    repo = str(Path(__file__).resolve().parents[2])  # the ranks import this checkout, as this process does
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    parent = os.getpid()
    proc = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=timeout_s, preexec_fn=die_with_parent(parent)
    )
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(
            f"shard {s.shard_index:05d}: torchrun world of {s.tp_size} exited {proc.returncode}:\n{tail}"
        )
    if log is not None and proc.stdout.strip():
        log(f"shard {s.shard_index:05d}: world done: {proc.stdout.strip().splitlines()[-1]}")
    idx_path = shard_paths(s.out_dir, s.shard_index)[1]
    return ShardSummary.from_index(read_index_meta(idx_path), idx_path)


class TorchrunEngine:
    """`hidden_states.engine: torchrun` (the `ShardEngine` interface): one world of `torchrun.tp_size` processes
    per shard over `hidden_states.model`'s checkpoint (a `tiny-random` model is saved once beside the shards)."""

    def facts(self, settings: HiddenStatesConfig, paths: ExtractionPaths, shard: int, vocab_size: int) -> RunFacts:
        """Nothing beyond the settings: the ranks load the checkpoint `hidden_states.model` names."""
        return RunFacts()

    def extract(self, job: ShardJob) -> EngineResult:
        """The world reports no per-row progress: `job.progress` is not called."""
        from eagle_pipeline.hidden_states.engines.runtime import materialized_model_dir

        h, t = job.settings, job.settings.torchrun
        model_dir = materialized_model_dir(
            h.model, family=h.family, seed=h.seed, vocab_size=job.vocab_size, cache_dir=job.paths.cache_dir
        )
        world = TorchrunShard(
            model_dir,
            job.paths.merged_dir,
            shard_index=job.shard,
            out_dir=job.paths.out_dir,
            tp_size=t.tp_size,
            fingerprint=job.wanted.to_dict(),
            ep_size=t.ep_size,
            max_tokens_per_batch=h.max_tokens_per_batch,
            exports_dir=job.paths.exports_dir,
            device=h.device,
        )
        summary = run_world(world, log=job.log)
        return EngineResult(summary, f"torchrun: tp_size {t.tp_size}" + (f", ep_size {t.ep_size}" if t.ep_size else ""))


def die_with_parent(parent: int) -> Callable[[], None]:
    """A function that has the kernel SIGKILL the calling process when its parent `parent` dies (Linux;
    elsewhere it does nothing): a shard run killed with `kill -9` must not leave a torchrun world holding GPUs and
    writing a shard nobody waits for. The shard run gives it to the torchrun agent (as `preexec_fn`: libc is loaded
    here, before the fork, so the child only makes the call) and every rank calls it for itself."""
    if not sys.platform.startswith("linux"):
        return lambda: None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    def arm() -> None:
        prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return arm


def rank_holdings(model: torch.nn.Module) -> dict[str, int]:
    """What this rank holds, by parameter count, of all the model's parameters and of its routed experts (a split
    parameter is a DTensor: its global numel and this rank's local one), as `world_split.RankShare.as_dict` plans."""
    held = dict.fromkeys(("params", "params_per_rank", "routed_expert_params", "routed_expert_params_per_rank"), 0)
    for name, p in model.named_parameters():
        here = p.to_local().numel() if hasattr(p, "to_local") else p.numel()
        for kind in ("params", "routed_expert_params") if is_routed_expert(name) else ("params",):
            held[kind] += p.numel()
            held[f"{kind}_per_rank"] += here
    return held


def rank_device(device: str, local_rank: int) -> str:
    """The device a rank runs on under `hidden_states.device`: its own GPU unless the setting is 'cpu' or no GPU is
    visible, so that the ranks store the dtype the shard's fingerprint says (bf16 on CUDA, fp32 on the CPU)."""
    if device != "auto" and torch.device(device).type == "cpu":
        return "cpu"
    return f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"


def _rank_main(argv: Sequence[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, DistributedConfig

    ap = argparse.ArgumentParser(description="one rank of a tensor-parallel extraction world (run by torchrun)")
    ap.add_argument("--shard", required=True, help="JSON of the TorchrunShard (engine_torchrun.torchrun_argv)")
    s = TorchrunShard.from_json(ap.parse_args(argv).shard)
    wanted = s.wanted
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = rank_device(s.device, local_rank)
    dtype = state_dtype(wanted.dtype) if wanted.dtype is not None else default_state_dtype(device)
    dist = {"tp_size": s.tp_size, **({"ep_size": s.ep_size} if s.ep_size else {})}
    model = AutoModelForCausalLM.from_pretrained(
        s.model_dir,
        local_files_only=True,
        dtype=dtype,
        distributed_config=DistributedConfig(tp_size=s.tp_size, ep_size=s.ep_size or None),
    ).eval()
    # Every rank runs the same forwards (the collectives need all of them); only rank 0 keeps what it writes.
    out = s.out_dir if rank == 0 else Path(tempfile.mkdtemp(prefix=f"eagle-tp-rank{rank}-"))
    # Rank 0 writes the trainer's files where the trainer reads them; the others into their scratch folder.
    exports = (s.exports_dir if rank == 0 else out / "exports") if s.exports_dir is not None else None
    target = (
        plan_layout_target(wanted.layout, exports / wanted.layout, s.merged_dir, quantize=wanted.quantize)
        if exports is not None
        else None
    )
    try:
        summary = extract_with_model(
            model,
            s.merged_dir,
            wanted,
            shard_index=s.shard_index,
            out_dir=out,
            device=device,
            max_tokens_per_batch=s.max_tokens_per_batch,
            layout_target=target,
        )
    finally:
        if rank != 0:
            shutil.rmtree(out, ignore_errors=True)
    if rank == 0:
        report = {"shard": s.shard_index, "rows": summary.rows, "sha256": summary.sha256, **dist}
        print(json.dumps({**report, "holds": rank_holdings(model)}))
    return 0


def _follow_the_agent() -> None:
    """A rank dies with its torchrun agent; one whose agent died before it could ask (while it imported) exits."""
    agent = os.getppid()
    die_with_parent(agent)()
    with contextlib.suppress(OSError):  # no /proc: nothing more to check
        cmdline = Path(f"/proc/{agent}/cmdline").read_bytes()
        if b"torch.distributed.run" not in cmdline and b"torchrun" not in cmdline:  # `python -m` or the script
            sys.exit(f"rank {os.environ.get('RANK')}: the torchrun agent is gone (parent is now pid {agent})")


if __name__ == "__main__":
    _follow_the_agent()
    sys.exit(_rank_main())
