#!/usr/bin/env python
"""What FP8 (e4m3) hidden states lose, per layer, for two scale schemes; and what FP8 costs to write and read per GB.

    .venv/bin/python benchmarks/bench_fp8.py [--demo-dir data/hidden_states] [--tokens 4096] [--hidden 7168]
        [--repeat 3]

Scale schemes (`eagle_pipeline.hidden_states.store.fp8`):
  per-token        speculators' fp8 backend: one fp32 scale per token over all layers, [T, 1, 1], amax / 448
  per-token-layer  this project: one fp32 scale per token per layer, [T, L, 1], amax / 448

State sets:
  demo       the states `make demo` extracted (tiny Llama, every shard under --demo-dir: 3 aux layers + the final
             state pre-norm), if present
  synthetic  generated here, NOT a model's states: Gaussian rows whose per-layer RMS grows 50x (log-spaced) from the
             first aux layer to the final state, and 4 outlier channels of every row at 100x the median channel's
             scale, the shape reported for large models' residual streams; H = --hidden (Kimi's 7168), bf16

Per layer l: RMS relative error = ||deq - x||_F / ||x||_F over that layer's [T, H]; max relative error = the worst
token's ||deq - x|| / ||x|| over its H values in that layer. Dequantized in fp32 (`fp8.dequantize`).

Cost per GB of bf16 states (the same states, best of --repeat, this process's CPU seconds, torch on one thread):
  write bf16  safetensors.save of the bf16 [T, L, H] tensor
  write fp8   fp8.quantize (per-token-layer) + safetensors.save of the e4m3 states and fp32 scales
  read bf16   safetensors.load_file + a copy (load_file maps the file; the copy touches every byte)
  read fp8    safetensors.load_file + fp8.dequantize to bf16 — what speculators' FP8Transfer does
  quantize    fp8.quantize alone
The vLLM engine's two ways to FP8, per GB of bf16 states, at equal checking (shape, token ids, finite, no all-zero
state vector):
  validate bf16                              the check of a bf16 connector file (vllm_files.validate_states_file)
  validate + quantize + write fp8 (client)   what `engine: vllm` with `quantize: fp8` does (vllm_layouts.VllmLayoutRows):
                                             the one read and check of the bf16 file, fp8.sample_file on its mapped
                                             states with the scales from the checks' amax, the FP8 hs_{i} written
                                             atomically and its XXH3-128
  validate fp8 (server connector)            speculators' FP8HiddenStatesConnector quantized on the server: the
                                             client checks the e4m3 file (scales finite > 0, no NaN byte, no zero
                                             vector: check_fp8_file here, an estimate) and renames it
Files go to a temporary directory on the repo's filesystem (page cache: this measures CPU, not the disk).

Prints figures only; not a test.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle_pipeline.hidden_states.engines.vllm.vllm_files import validate_states_file
from eagle_pipeline.hidden_states.store import fp8
from eagle_pipeline.hidden_states.store.format import sample_file_digest
from eagle_pipeline.shared.storage import write_bytes_atomic

SCHEMES = {"per-token": fp8.PER_TOKEN, "per-token-layer": fp8.PER_TOKEN_LAYER}


def demo_states(demo_dir: Path) -> torch.Tensor | None:
    """Every sample of the demo's shards as one [T, 4, H] tensor (aux layers, then the final state)."""
    rows = []
    for path in sorted(demo_dir.glob("**/shard-*.safetensors")):
        with safe_open(str(path), "pt") as f:
            keys = set(f.keys())
            for key in sorted(k for k in keys if k.endswith("/aux_hidden_states")):
                aux = f.get_tensor(key)
                final = f.get_tensor(key.replace("/aux_hidden_states", "/final_hidden_state"))
                t, h = final.shape[-2], final.shape[-1]
                rows.append(torch.cat([aux.reshape(t, -1, h), final.reshape(t, 1, h)], dim=1))
    return torch.cat(rows) if rows else None


def synthetic_states(tokens: int, hidden: int, layers: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, layers, hidden, generator=g)
    x *= torch.logspace(0, math.log10(50.0), layers).view(1, layers, 1)
    outliers = torch.randperm(hidden, generator=g)[:4]
    x[..., outliers] *= 100
    return x.to(torch.bfloat16)


def layer_errors(x: torch.Tensor, granularity: str) -> tuple[list[float], list[float]]:
    q = fp8.quantize(x, granularity)
    ref = x.float()
    err = fp8.dequantize(q.states, q.scales, torch.float32) - ref
    rms = (err.pow(2).sum(dim=(0, 2)) / ref.pow(2).sum(dim=(0, 2))).sqrt()
    per_token = err.norm(dim=2) / ref.norm(dim=2).clamp_min(torch.finfo(torch.float32).tiny)
    return rms.tolist(), per_token.amax(dim=0).tolist()


def error_table(name: str, x: torch.Tensor) -> None:
    print(f"\n{name}: {x.shape[0]:,} tokens x {x.shape[1]} layers x H {x.shape[2]}")
    rms_by_layer = [x[:, layer].float().pow(2).mean().sqrt().item() for layer in range(x.shape[1])]
    figures = {label: layer_errors(x, g) for label, g in SCHEMES.items()}
    print(
        "| layer | state RMS | per-token RMS rel | per-token-layer RMS rel | RMS gain "
        "| per-token max rel | per-token-layer max rel | max gain |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for layer in range(x.shape[1]):
        (t_rms, t_max), (tl_rms, tl_max) = ((f[0][layer], f[1][layer]) for f in figures.values())
        label = "final (pre-norm)" if layer == x.shape[1] - 1 else f"aux {layer}"
        print(
            f"| {label} | {rms_by_layer[layer]:.3g} | {t_rms:.2e} | {tl_rms:.2e} | {t_rms / tl_rms:.2f}x "
            f"| {t_max:.2e} | {tl_max:.2e} | {t_max / tl_max:.2f}x |"
        )
    worse = [
        layer
        for layer in range(x.shape[1])
        if figures["per-token-layer"][0][layer] > figures["per-token"][0][layer]
        or figures["per-token-layer"][1][layer] > figures["per-token"][1][layer]
    ]
    print("per-token-layer no worse on every layer:", "yes" if not worse else f"NO (layers {worse})")


def check_fp8_file(path: Path, ids: torch.Tensor) -> None:
    """The checks a client would run on a server-quantized file: the bf16 checks' FP8 equivalents (estimate)."""
    raw = load_file(str(path))
    states, scales = raw[fp8.STATES_KEY], raw[fp8.SCALES_KEY]
    if not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()):
        raise ValueError(f"{path}: scales not finite and > 0")
    top = (states.view(torch.uint8) & 0x7F).amax(dim=-1)  # e4m3fn: 0x7F is NaN, 0 an all-zero vector
    if bool((top == 0x7F).any()) or bool((top == 0).any()) or not torch.equal(raw["token_ids"], ids):
        raise ValueError(f"{path}: NaN, all-zero vectors or other token ids")


def cpu_seconds(fn: Callable[[], object], repeat: int) -> float:
    best = math.inf
    for _ in range(repeat):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def cost_table(x: torch.Tensor, repeat: int) -> None:
    gb = x.numel() * 2 / 1e9
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parents[1]) as tmp:
        bf16_path, fp8_path = Path(tmp) / "bf16.safetensors", Path(tmp) / "fp8.safetensors"
        ids = torch.arange(x.shape[0], dtype=torch.int64)

        def write_bf16() -> None:
            save_file({"hidden_states": x, "token_ids": ids}, str(bf16_path))

        def write_fp8() -> None:
            save_file({**fp8.quantize(x).tensors(), "token_ids": ids}, str(fp8_path))

        def read_bf16() -> torch.Tensor:
            return load_file(str(bf16_path))["hidden_states"].clone()  # touch every byte, as dequantizing does

        def read_fp8() -> torch.Tensor:
            raw = load_file(str(fp8_path))
            return fp8.dequantize(raw[fp8.STATES_KEY], raw[fp8.SCALES_KEY])

        layer_ids = list(range(x.shape[1]))
        server_fp8 = Path(tmp) / "server_fp8.safetensors"
        q_token = fp8.quantize(x, fp8.PER_TOKEN)  # what FP8HiddenStatesConnector would write
        save_file({**q_token.tensors(), "token_ids": ids}, str(server_fp8))
        write_bf16()

        def validate_bf16() -> None:
            validate_states_file(bf16_path, ids.tolist(), layer_ids).close()

        def client_quantizes() -> None:  # read the bf16 connector file once, check it, write the FP8 hs_{i}
            file = validate_states_file(bf16_path, ids.tolist(), layer_ids)
            scales = fp8.scales_from_amax(file.amax.unsqueeze(-1))  # from the checks' reduction, as the engine does
            data = fp8.sample_file(file.states, file.tensors["token_ids"], scales=scales)
            file.close()
            write_bytes_atomic(data, fp8_path)
            sample_file_digest(data)

        rows = {
            "validate bf16": cpu_seconds(validate_bf16, repeat),
            "validate + quantize + write fp8 (client)": cpu_seconds(client_quantizes, repeat),
            "validate fp8 (server connector)": cpu_seconds(lambda: check_fp8_file(server_fp8, ids), repeat),
            "write bf16": cpu_seconds(write_bf16, repeat),
            "write fp8": cpu_seconds(write_fp8, repeat),
            "read bf16": cpu_seconds(read_bf16, repeat),
            "read fp8": cpu_seconds(read_fp8, repeat),
            "quantize": cpu_seconds(lambda: fp8.quantize(x), repeat),
        }
        sizes = {"bf16": bf16_path.stat().st_size, "fp8": fp8_path.stat().st_size}
    print(f"\ncost per GB of bf16 states ({gb:.2f} GB, best of {repeat}, CPU seconds, 1 torch thread)")
    print("| step | CPU s per GB | vs bf16 |")
    print("|---|---|---|")
    for step, seconds in rows.items():
        base = rows["read bf16"] if step.startswith("read") else rows["write bf16"]
        base = rows["validate bf16"] if step.startswith("validate") else base
        print(f"| {step} | {seconds / gb:.2f} | {seconds / base:.1f}x |")
    print(f"file bytes: bf16 {sizes['bf16']:,}, fp8 {sizes['fp8']:,} ({sizes['fp8'] / sizes['bf16']:.3f} of bf16)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo-dir", type=Path, default=Path("data"))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    demo = demo_states(args.demo_dir)
    if demo is None:
        print(f"demo: no shard-*.safetensors under {args.demo_dir} (run `make demo`)")
    else:
        error_table(f"demo states (tiny Llama, {args.demo_dir})", demo)
    synthetic = synthetic_states(args.tokens, args.hidden)
    error_table("synthetic states (generated: RMS 50x first to last layer, 4 outlier channels 100x)", synthetic)
    cost_table(synthetic, args.repeat)


if __name__ == "__main__":
    main()
