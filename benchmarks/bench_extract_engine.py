#!/usr/bin/env python
"""The vLLM engine path's client against the loopback double: is the client ever the bottleneck?

    .venv/bin/python benchmarks/bench_extract_engine.py [--rows 96] [--mean-tokens 256] [--hidden-size 256]

Prints, on synthetic merged data (prints figures only; not a test):
  overhead     one shard through one double in a child process: the client's CPU seconds per 1k tokens (requests,
               lock waits, validation, copy, shard write, all in this process) beside the double's own forward
               seconds per 1k tokens;
  endpoints    rows/s and tokens/s one shard run sustains with 1, 2 and 4 doubles (child processes), each adding
               --gpu-ms of simulated GPU time per request on top of its forward;
  copy+write   the client's cost per GB of states on Kimi-K2.5's shape (H = 7168, 4 layers, bf16): validating a
               connector file (read, finite and zero checks, token ids) and copying it into a shard (read, slice,
               sha256, write), on --storage (default: a temporary directory; try /dev/shm).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from eagle_pipeline.hidden_states.engines.vllm.vllm_files import validate_states_file, vllm_layer_ids
from eagle_pipeline.hidden_states.models.layers import default_aux_layers
from eagle_pipeline.hidden_states.models.model import build_model_from_config, tiny_config
from eagle_pipeline.hidden_states.store.format import StreamingSafetensorsWriter, shard_layout, tensor_key
from eagle_pipeline.hidden_states.store.merged import read_rows
from eagle_pipeline.hidden_states.store.shard_index import IDS_DTYPE, MASK_DTYPE
from eagle_pipeline_tests.doubles.synthetic import write_synthetic_merged
from eagle_pipeline_tests.hidden_states.engine_runs import vllm_shard

VOCAB = 2560


def _serve(conn, storage: str, family: str, hidden: int, layers: int, latency_s: float) -> None:
    """Child process: one double; sends its URL, then its forward seconds when asked, then stops."""
    torch.set_num_threads(1)
    from eagle_pipeline.simulation.vllm_hidden_states import VLLMHiddenStatesDouble

    model = build_model_from_config(tiny_config(VOCAB, family=family, hidden_size=hidden, num_layers=layers))
    ids = vllm_layer_ids(default_aux_layers(layers), layers)
    with VLLMHiddenStatesDouble(model, layer_ids=ids, storage_path=storage, latency_s=latency_s) as srv:
        conn.send(srv.url)
        conn.recv()
        conn.send(srv.compute_seconds)


def _doubles(n: int, storage: Path, family: str, hidden: int, layers: int, latency_s: float):
    ctx = mp.get_context("spawn")
    procs = []
    for _ in range(n):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_serve, args=(child, str(storage), family, hidden, layers, latency_s), daemon=True)
        p.start()
        procs.append((p, parent))
    return procs, [parent.recv() for _, parent in procs]


def _stop(procs) -> float:
    compute = 0.0
    for p, conn in procs:
        conn.send("stats")
        compute += conn.recv()
        p.join(30)
    return compute


def _shard(merged: Path, out: Path, urls: list[str], storage: Path, args: argparse.Namespace):
    shutil.rmtree(out, ignore_errors=True)
    cpu0, t0 = time.process_time(), time.perf_counter()
    s = vllm_shard(  # through the stage's own decision (run.run_shard), as a shard run of the asset goes
        merged,
        shard_index=0,
        shard_size=args.rows,
        out_dir=out,
        endpoints=urls,
        storage_path=storage,
        num_layers=args.layers,
        hidden_size=args.hidden_size,
        concurrency=args.concurrency,
    )
    return s, time.perf_counter() - t0, time.process_time() - cpu0


def copy_write_cost(storage: Path, n_files: int, tokens: int) -> tuple[float, float, float]:
    """(GB of states, validate s/GB, copy+write s/GB) on Kimi-K2.5's shape."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    h, n_ids, layer_ids = 7168, 4, (2, 30, 58, 61)
    ids = list(range(1, tokens + 1))
    paths = []
    for i in range(n_files):
        p = storage / f"cmpl-bench-{i}.safetensors"
        hs = torch.randn(tokens, n_ids, h, dtype=torch.float32).to(torch.bfloat16)
        save_file({"hidden_states": hs, "token_ids": torch.tensor(ids, dtype=torch.int64)}, str(p))
        paths.append(p)
    gb = n_files * tokens * n_ids * h * 2 / 1e9
    t = time.perf_counter()
    for p in paths:
        validate_states_file(p, ids, layer_ids, hidden_size=h).close()
    validate_s = time.perf_counter() - t
    sids = [f"s{i}" for i in range(n_files)]
    layout = shard_layout(
        sids,
        [tokens] * n_files,
        list(range(n_files)),
        n_aux=3,
        hidden=h,
        state_dtype=torch.bfloat16,
        ids_dtype=IDS_DTYPE,
        mask_dtype=MASK_DTYPE,
    )
    out = storage / "shard-bench.safetensors"
    t = time.perf_counter()
    with open(out, "wb") as fh:
        w = StreamingSafetensorsWriter(fh, layout, {})
        for sid, p in zip(sids, paths):
            with safe_open(str(p), framework="pt") as f:
                hs = f.get_tensor("hidden_states")
            w.write(tensor_key(sid, "aux_hidden_states"), hs[:, :3].reshape(tokens, 3 * h))
            w.write(tensor_key(sid, "final_hidden_state"), hs[:, 3])
            w.write(tensor_key(sid, "input_ids"), torch.tensor(ids, dtype=IDS_DTYPE))
        for sid in sids:
            w.write(tensor_key(sid, "loss_mask"), torch.ones(tokens, dtype=MASK_DTYPE))
        w.finish()
        fh.flush()
        os.fsync(fh.fileno())
    copy_s = time.perf_counter() - t
    for p in [*paths, out]:
        p.unlink()
    return gb, validate_s / gb, copy_s / gb


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--mean-tokens", type=float, default=256)
    ap.add_argument("--family", default="llama", help="tiny model family of the doubles (llama: cheapest forward)")
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--gpu-ms", type=float, default=50.0, help="simulated GPU time per request in the doubles")
    ap.add_argument("--endpoints", default="1,2,4")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: overhead, endpoints, copy")
    ap.add_argument("--copy-files", type=int, default=8)
    ap.add_argument("--copy-tokens", type=int, default=2048)
    ap.add_argument("--storage", default=None, help="directory for connector files (default: a temporary one)")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench-engine-"))
    storage = Path(args.storage) if args.storage else work / "connector"
    storage.mkdir(parents=True, exist_ok=True)
    try:
        merged = work / "merged"
        _, tokens = write_synthetic_merged(
            merged, args.rows, vocab_size=VOCAB, mean_tokens=args.mean_tokens, max_tokens=4 * int(args.mean_tokens)
        )
        n = len(read_rows(merged, 0, args.rows))
        print(
            f"{n} rows, {tokens:,} tokens; tiny {args.family} H={args.hidden_size} L={args.layers}; "
            f"concurrency {args.concurrency} per endpoint; torch {torch.__version__}"
        )

        skip = set(args.skip.split(","))
        if "overhead" not in skip:
            procs, urls = _doubles(1, storage, args.family, args.hidden_size, args.layers, 0.0)
            _, wall, cpu = _shard(merged, work / "out", urls, storage, args)
            compute = _stop(procs)
            print("\noverhead (one double, no simulated GPU time):")
            print(f"  client CPU     {cpu / tokens * 1e3:.4f} s per 1k tokens")
            print(
                f"  double forward {compute / tokens * 1e3:.4f} s per 1k tokens  (client / double = {cpu / compute:.2f})"
            )
            print(f"  wall           {wall:.2f} s = {tokens / wall:,.0f} tokens/s")

        if "endpoints" not in skip:
            print(f"\nendpoints (each double adds {args.gpu_ms:g} ms of simulated GPU time per request):")
            for k in (int(x) for x in args.endpoints.split(",")):
                procs, urls = _doubles(k, storage, args.family, args.hidden_size, args.layers, args.gpu_ms / 1e3)
                _, wall, cpu = _shard(merged, work / "out", urls, storage, args)
                _stop(procs)
                print(
                    f"  {k} endpoint(s): {n / wall:7.1f} rows/s  {tokens / wall:9,.0f} tokens/s  "
                    f"client CPU {cpu / wall:.0%} of one core"
                )

        if "copy" in skip:
            return 0
        gb, validate, copy = copy_write_cost(storage, args.copy_files, args.copy_tokens)
        print(f"\ncopy+write on Kimi-K2.5's shape ({gb:.2f} GB of bf16 states in {args.copy_files} files, {storage}):")
        print(f"  validate   {validate:.2f} s/GB   ({1 / validate:.2f} GB/s)")
        print(f"  copy+write {copy:.2f} s/GB   ({1 / copy:.2f} GB/s, sha256 and fsync included)")
        print(
            f"  together   {validate + copy:.2f} s/GB: one core keeps up with {1 / (validate + copy):.2f} GB/s "
            "(a Kimi server at ~3k tokens/s/GPU x 8 GPUs makes ~1.4 GB/s)"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
