#!/usr/bin/env python
"""GPU check of the hidden-state extractor: a realistic architecture with random weights, a synthetic merged
dataset, extraction over it through an engine, tokens/s and share of bf16 peak, then `verify_shard` on every shard.

    python scripts/gpu_check.py                      # Llama-3.1-8B shape, bf16, one CUDA GPU (< 5 min on H200)
    python scripts/gpu_check.py --arch kimi-shallow  # Kimi-K2 layer shapes (MLA + 384->32 experts), 8 layers
    python scripts/gpu_check.py --cpu --tiny         # smoke test anywhere
    python scripts/gpu_check.py --cpu --tiny --engine torchrun  # a 2-process gloo world per shard (engine: torchrun)
    python scripts/gpu_check.py --cpu --tiny --engine vllm      # the engine client against the loopback vLLM double

By default (`--engine auto`) the in-process path runs, and where several GPUs are visible the torchrun path over all
of them too (`make gpu-check`); each prints tokens/s and MFU.

Nothing is downloaded: weights are seeded random numbers allocated directly on the device.
Exit codes: 0 all checks passed; 1 a shard failed verification; 2 environment problem or out of memory;
3 the --max-seconds guard stopped the run before any shard completed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from eagle_pipeline.hidden_states.checks.verify import verify_shard
from eagle_pipeline.hidden_states.models.layers import default_aux_layers
from eagle_pipeline.hidden_states.models.model import (
    build_model_from_config,
    build_tiny_model,
    describe_model_config,
    llama_8b_config,
)
from eagle_pipeline.hidden_states.plan.disk_plan import free_bytes
from eagle_pipeline.hidden_states.plan.estimate import ModelShape, Storage, Workload, plan_extraction
from eagle_pipeline.hidden_states.store.format import shard_paths, shard_status
from eagle_pipeline.hidden_states.store.merged import count_rows, num_shards
from eagle_pipeline.hidden_states.store.shards import ShardSummary
from eagle_pipeline.shared.progress import ProgressCallback
from eagle_pipeline_tests.doubles.synthetic import write_synthetic_merged

H200_BF16_PEAK_TFLOPS = 989.0


class Deadline(Exception):
    pass


class CheckRun(NamedTuple):
    """What every engine's run of the check shares: the model, the synthetic merged data and the shard layout
    (immutable; a NamedTuple, since the tests load this script without registering it as a module)."""

    model: Any
    desc: dict[str, Any]
    aux: tuple[int, ...]
    merged: Path
    device: str
    dtype: torch.dtype
    workdir: Path
    shard_size: int
    shards: int
    max_tpb: int


def kimi_shallow_config(num_layers: int = 8, n_routed_experts: int = 32):
    """Kimi-K2.5's per-layer shapes (hidden 7168, MLA ranks, 2048-wide experts, top-8, shared expert), with fewer
    layers and experts so it fits one GPU."""
    from transformers import DeepseekV3Config

    # Not a declared field of transformers 5's config (kept as a plain attribute): no multi-token-prediction layer.
    no_mtp: dict[str, Any] = {"num_nextn_predict_layers": 0}
    return DeepseekV3Config(
        vocab_size=163840,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=num_layers,
        num_attention_heads=64,
        num_key_value_heads=64,
        n_shared_experts=1,
        n_routed_experts=n_routed_experts,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.827,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        **no_mtp,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def print_environment(device: str) -> None:
    import transformers

    print(f"python {platform.python_version()} on {platform.platform()}")
    print(f"torch {torch.__version__} (cuda build {torch.version.cuda}), transformers {transformers.__version__}")
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        print(
            f"GPU: {props.name}, {props.total_memory / 2**30:.1f} GiB, capability {props.major}.{props.minor}, "
            f"{torch.cuda.device_count()} visible"
        )
    else:
        print(f"CPU run, {torch.get_num_threads()} threads")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="run on CPU in fp32 (smoke test)")
    ap.add_argument("--tiny", action="store_true", help="tiny DeepSeek-V3-family model instead of a realistic one")
    ap.add_argument("--arch", choices=("llama8b", "kimi-shallow"), default="llama8b")
    ap.add_argument("--samples", type=int, default=None, help="default 384 (GPU) / 32 (--tiny)")
    ap.add_argument("--mean-tokens", type=float, default=None, help="default 1500 (GPU) / 48 (--tiny)")
    ap.add_argument("--max-len", type=int, default=None, help="default 4096 (GPU) / 128 (--tiny)")
    ap.add_argument("--shard-size", type=int, default=None, help="rows per shard; default samples/3")
    ap.add_argument("--max-tokens-per-batch", type=int, default=None, help="default 32768 (GPU) / 1024 (CPU)")
    ap.add_argument("--max-seconds", type=float, default=240.0, help="stop extracting new batches after this")
    ap.add_argument("--disk-fraction", type=float, default=0.5, help="use at most this share of free disk")
    ap.add_argument("--workdir", type=Path, default=None, help="default: a fresh temporary directory")
    ap.add_argument("--keep", action="store_true", help="keep the shards (default: delete each after verifying)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--engine",
        choices=("auto", "in_process", "torchrun", "vllm"),
        default="auto",
        help="auto: in_process, plus torchrun over every GPU where several are visible; torchrun: one world of "
        "--tp-size processes per shard (gloo on --cpu); vllm: the engine client against the loopback vLLM double "
        "serving the same model",
    )
    ap.add_argument("--tp-size", type=int, default=None, help="torchrun world size; default: visible GPUs (2 on CPU)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("ERROR: CUDA is not available (pass --cpu --tiny for a CPU smoke test)")
        return 2
    print_environment(device)
    tiny = args.tiny
    samples = args.samples or (32 if tiny else 384)
    mean_tokens = args.mean_tokens or (48 if tiny else 1500)
    max_len = args.max_len or (128 if tiny else 4096)
    max_tpb = args.max_tokens_per_batch or (1024 if device == "cpu" else 32768)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16

    t = time.perf_counter()
    try:
        if tiny:
            model = build_tiny_model(1024, seed=args.seed, device=device, dtype=dtype)
        else:
            cfg = llama_8b_config() if args.arch == "llama8b" else kimi_shallow_config()
            model = build_model_from_config(cfg, seed=args.seed, device=device, dtype=dtype)
    except torch.cuda.OutOfMemoryError as exc:
        print(f"ERROR: out of GPU memory while building the model: {exc}")
        return 2
    desc = describe_model_config(model.config)
    n_layers = desc["num_layers"]
    aux = default_aux_layers(n_layers)
    print(f"model: {json.dumps(desc)} built in {time.perf_counter() - t:.1f}s; aux layers {aux}; dtype {dtype}")
    if device == "cuda":
        print(f"GPU memory after build: {torch.cuda.memory_allocated() / 2**30:.1f} GiB")

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="eagle-gpu-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    free = free_bytes(workdir)
    merged, n_tokens = write_synthetic_merged(
        workdir / "merged",
        samples,
        vocab_size=desc["vocab_size"],
        mean_tokens=mean_tokens,
        max_tokens=max_len,
        seed=args.seed,
    )
    shard_size = args.shard_size or max(-(-samples // 3), 1)
    n_rows = count_rows(merged)
    shards = num_shards(n_rows, shard_size)
    plan = plan_extraction(
        ModelShape.of_config(model.config, args.arch),
        Workload(n_tokens, samples),
        Storage(dtype_bytes=dtype.itemsize, shard_size=shard_size),
    )
    print(
        f"data: {samples} samples, {n_tokens:,} tokens (mean {n_tokens / samples:.0f}, max {max_len}), "
        f"{shards} shards of {shard_size}; output ~{plan.bytes_on_disk / 1e9:.2f} GB "
        f"({plan.bytes_per_shard / 1e9:.2f} GB per shard); free disk {free / 1e9:.1f} GB in {workdir}"
    )
    # Shards are deleted after verification, so peak disk is about one shard plus the one being written.
    if 2 * plan.bytes_per_shard > args.disk_fraction * free and not args.keep:
        print(
            f"ERROR: two shards ({2 * plan.bytes_per_shard / 1e9:.1f} GB) exceed {args.disk_fraction:.0%} of free disk;"
            " lower --samples or --shard-size"
        )
        return 2
    if args.keep and n_tokens > int(args.disk_fraction * free / plan.bytes_per_token):  # every shard stays
        print("ERROR: --keep would need more disk than allowed; lower --samples")
        return 2

    engines = resolve_engines(args.engine, device)
    run = CheckRun(model, desc, aux, merged, device, dtype, workdir, shard_size, shards, max_tpb)
    rc = 0
    try:
        for engine in engines:
            rc = max(rc, run_engine(engine, args, run))
    finally:
        if args.workdir is None and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"total wall {time.perf_counter() - started:.0f}s")
    return rc


def resolve_engines(engine: str, device: str) -> list[str]:
    """`auto`: the in-process path, and the torchrun path too where several GPUs are visible."""
    if engine != "auto":
        return [engine]
    several = device == "cuda" and torch.cuda.device_count() >= 2
    return ["in_process", "torchrun"] if several else ["in_process"]


def run_engine(engine: str, args: argparse.Namespace, run: CheckRun) -> int:
    """Extract every shard through `engine`, verify each, print tokens/s and MFU; returns the exit code."""
    device, workdir, max_tpb = run.device, run.workdir, run.max_tpb
    tp_size = args.tp_size or (torch.cuda.device_count() if device == "cuda" else 2)
    n_devices = tp_size if engine == "torchrun" else 1
    out_dir = workdir / ("hidden_states" if engine == "in_process" else f"hidden_states_{engine}")
    print(
        f"\nENGINE {engine}"
        + (
            f": a torchrun world of {tp_size} ({'nccl' if device == 'cuda' else 'gloo'})"
            if engine == "torchrun"
            else ""
        )
    )
    deadline = time.perf_counter() + args.max_seconds

    def guard(done: int, total: int, tokens_done: int, tokens_total: int) -> None:
        if time.perf_counter() > deadline:
            raise Deadline(f"--max-seconds {args.max_seconds} reached at {done}/{total} rows of the current shard")

    with contextlib.ExitStack() as stack:
        extract_one = engine_extractor(engine, stack, run, out_dir=out_dir, tp_size=tp_size, guard=guard)
        summaries, failures = [], 0
        for shard in range(run.shards):
            tw = time.perf_counter()
            try:
                if tw > deadline:
                    raise Deadline(f"--max-seconds {args.max_seconds} reached before shard {shard}")
                s = extract_one(shard)
            except Deadline as exc:
                print(f"stopped: {exc}")
                break
            except torch.cuda.OutOfMemoryError as exc:
                print(
                    f"ERROR: out of GPU memory in shard {shard} with --max-tokens-per-batch {max_tpb}; "
                    f"retry with a smaller budget, e.g. {max_tpb // 2}. ({str(exc).splitlines()[0]})"
                )
                return 2
            summaries.append(s)
            print_shard(shard, s, run.desc["matmul_active_params"], wall=time.perf_counter() - tw)
            failures += 0 if verify_and_drop(out_dir, shard, run.merged, keep=args.keep) else 1
    if not summaries:
        print("no shard completed before the deadline")
        return 3
    print_result(engine, summaries, run.shards, run.desc, device, n_devices, failures)
    return 1 if failures else 0


def engine_extractor(
    engine: str, stack: contextlib.ExitStack, run: CheckRun, *, out_dir: Path, tp_size: int, guard: ProgressCallback
) -> Callable[[int], ShardSummary]:
    """One shard's extraction through `engine`, by the pipeline's own entry point (`run.run_shard`) under settings
    naming the check's model; servers it needs live as long as `stack`. In process the model built here is used as
    it is (`PreloadedModel`: its own identity is the fingerprint's; only its config.json is saved, for the settings'
    `model`); torchrun's ranks and the vLLM
    engine's head read its weights, saved once."""
    from eagle_pipeline.hidden_states.engines.engine import ExtractionPaths
    from eagle_pipeline.hidden_states.engines.engine_in_process import InProcessEngine, PreloadedModel
    from eagle_pipeline.hidden_states.run import run_shard
    from eagle_pipeline.hidden_states.settings import HiddenStatesConfig, TorchrunConfig, VLLMEngineConfig

    if engine not in ("in_process", "torchrun", "vllm"):
        raise ValueError(f"unknown engine {engine!r}")
    model, n_layers = run.model, run.desc["num_layers"]
    model_dir = run.workdir / ("model_config" if engine == "in_process" else "model")
    if engine == "in_process":
        model.config.save_pretrained(model_dir)
    elif not (model_dir / "config.json").exists():  # what every rank (and the vLLM engine's head) loads
        t = time.perf_counter()
        model.save_pretrained(model_dir)
        print(f"saved the model for the ranks in {time.perf_counter() - t:.1f}s")
    vllm = VLLMEngineConfig()
    if engine == "vllm":
        from eagle_pipeline.hidden_states.engines.vllm.vllm_files import vllm_layer_ids
        from eagle_pipeline.simulation.vllm_hidden_states import VLLMHiddenStatesDouble

        storage = run.workdir / "connector"
        double = stack.enter_context(
            VLLMHiddenStatesDouble(model, layer_ids=vllm_layer_ids(run.aux, n_layers), storage_path=storage)
        )
        print(f"the engine client against the loopback vLLM double at {double.url} (one forward per request)")
        vllm = VLLMEngineConfig(endpoints=(double.url,), storage_path=str(storage))
    settings = HiddenStatesConfig(
        model=str(model_dir),
        shard_size=run.shard_size,
        aux_layers=run.aux,
        max_tokens_per_batch=run.max_tpb,
        device=run.device,
        engine=engine,
        vllm=vllm,
        torchrun=TorchrunConfig(tp_size=tp_size),
    )
    paths = ExtractionPaths(run.merged, out_dir, run.workdir / "exports")
    preloaded = InProcessEngine(PreloadedModel(model)) if engine == "in_process" else None
    vocab = int(run.desc["vocab_size"])
    # Pre-norm whatever the engine (the torchrun engine's own default is post-norm): kept shards compare directly.
    return lambda shard: (
        run_shard(
            settings, paths, shard, vocab_size=vocab, progress=guard, engine=preloaded, final_state="pre_norm"
        ).summary
    )


def print_shard(shard: int, s: ShardSummary, flops_params: int, *, wall: float) -> None:
    tflops = 2 * flops_params * s.tokens / max(s.compute_seconds, 1e-9) / 1e12
    print(
        f"shard {shard}: {s.rows} rows, {s.tokens:,} tokens in {s.seconds:.1f}s = {s.tokens_per_s:,.0f} tok/s "
        f"end to end; compute {s.compute_seconds:.1f}s ({s.tokens / max(s.compute_seconds, 1e-9):,.0f} tok/s, "
        f"{tflops:.0f} TFLOP/s), waited on disk {s.write_wait_seconds:.1f}s; {s.batches} batches, "
        f"padding {s.padding_fraction:.1%}, {s.size_bytes / 1e9:.2f} GB, nonfinite samples {s.n_nonfinite_samples}; "
        f"wall {wall:.1f}s"
    )


def verify_and_drop(out_dir: Path, shard: int, merged: Path, *, keep: bool) -> bool:
    """`verify_shard` and `shard_status` of one shard, printed; the shard is deleted unless `keep`."""
    tv = time.perf_counter()
    checks = verify_shard(out_dir, shard, merged)
    status = shard_status(out_dir, shard)
    ok = all(c.passed for c in checks.values()) and status == "done"
    print(
        f"  verify ({time.perf_counter() - tv:.1f}s): status={status} "
        + ", ".join(
            f"{k}={'ok' if c.passed else 'FAIL'} {c.failing}/{c.checked} {c.failing_sample_ids[:3]}"
            for k, c in checks.items()
        )
    )
    if not keep:
        for p in shard_paths(out_dir, shard):
            p.unlink(missing_ok=True)
    return ok


def print_result(engine, summaries, shards, desc, device, n_devices, failures) -> None:
    tokens = sum(s.tokens for s in summaries)
    secs = sum(s.seconds for s in summaries)
    compute = sum(s.compute_seconds for s in summaries)
    # The first shard pays one-off costs (CUDA context, kernel selection); report steady state when there is one.
    steady = summaries[1:] or summaries
    st_tokens, st_compute = sum(s.tokens for s in steady), sum(s.compute_seconds for s in steady)
    peak = H200_BF16_PEAK_TFLOPS * 1e12 * n_devices
    print(f"\nRESULT ({engine})")
    print(
        f"  shards {len(summaries)}/{shards}, tokens {tokens:,}, end-to-end {tokens / secs:,.0f} tok/s, "
        f"compute-only {tokens / compute:,.0f} tok/s ({tokens / compute / n_devices:,.0f} tok/s per device)"
    )
    for label, params in (
        ("matmul params (no embedding lookup, no lm_head)", desc["matmul_active_params"]),
        ("all params", desc["params"]),
    ):
        mfu = 2 * params * st_tokens / st_compute / peak
        print(
            f"  FLOPs = 2 x {params / 1e9:.2f}B {label} x tokens: steady-state compute = {mfu:.1%} of "
            f"{n_devices} x {H200_BF16_PEAK_TFLOPS:.0f} TFLOP/s bf16 peak (end to end {2 * params * tokens / secs / peak:.1%})"
        )
    if device == "cuda":
        print(f"  peak GPU memory (this process) {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    print(f"  verification: {'all shards passed' if not failures else f'{failures} shard(s) FAILED'}")


if __name__ == "__main__":
    sys.exit(main())
