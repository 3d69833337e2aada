#!/usr/bin/env python
"""The client's CPU per GB of Kimi-K2.5 states for each way a vLLM connector file reaches a layout.

    .venv/bin/python benchmarks/bench_layout_copy.py [--rows 6] [--mean-tokens 3460] [--repeat 3]
        [--storage DIR] [--other-fs DIR]

Kimi's real state shape (H = 7168, 3 aux layers + the final state, bf16: 57,344 B per token); row lengths drawn
around the seed's mean (138.4M tokens / 40K samples ≈ 3,460 tokens; lengths 0.25x to 2.5x of it). Each path gets its
own fresh copies of the same connector files (made outside the timing) and is timed with this process's CPU seconds
(`time.process_time`, user + system, every thread; torch runs on one thread), per GB of states, best of --repeat:

  validate      vllm_files.validate_states_file alone (the check every path must do)
  shards        `engine: vllm` + `layout: shards`: validate, then copy the validated mapping's states into the
                project's shard (slice, sha256, write, fsync; the file is read once)
  speculators   `engine: vllm` + `layout: speculators` (vllm_handoff.hand_off): one mapping of the file, its
                XXH3-128 and the same checks over those pages, rename to hs_{i}.safetensors (one filesystem); the
                same with a sha256 instead (the integrity record before) and with no digest (what one costs); and the
                connector's storage on --other-fs (default /dev/shm, when it is another filesystem), the exports on
                --storage: one streaming copy
  specforge     `layout: specforge`: validate, the post-norm final state (from the validated mapping) with the
                recorded head's norm, the .ckpt
                (torch.save) written atomically and its XXH3-128 (trainer_layouts.SampleFilesWriter's work)

The goal (issue 24): speculators on one filesystem at most 1.2x validate. Prints figures only; not a test.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from eagle_pipeline.drafter_types import SPECFORGE
from eagle_pipeline.hidden_states.engines.vllm.vllm_files import (
    check_states,
    map_file,
    safetensors_views,
    validate_states_file,
)
from eagle_pipeline.hidden_states.engines.vllm.vllm_handoff import hand_off, place_file
from eagle_pipeline.hidden_states.layouts.trainer_layouts import trainer_layout
from eagle_pipeline.hidden_states.store.format import (
    StreamingSafetensorsWriter,
    sample_file_digest,
    shard_layout,
    tensor_key,
)
from eagle_pipeline.hidden_states.store.head import TargetHead
from eagle_pipeline.hidden_states.store.shard_index import IDS_DTYPE, MASK_DTYPE
from eagle_pipeline.shared.storage import write_bytes_atomic

H, N_AUX, LAYERS = 7168, 3, 61  # Kimi-K2.5: hidden size, aux layers, decoder layers (the final vLLM id)
LAYER_IDS = (2, 31, 59, LAYERS)


def make_connector_files(src: Path, lengths: list[int], seed: int) -> list[tuple[Path, list[int]]]:
    """One connector file per row, as vLLM writes it: hidden_states [T, 4, H] bf16, token_ids [T] int64."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    src.mkdir(parents=True, exist_ok=True)
    out = []
    for i, t in enumerate(lengths):
        ids = torch.randint(0, 163_840, (t,), generator=g, dtype=torch.int64)
        hs = (torch.randn(t, len(LAYER_IDS), H, generator=g) * 3).to(torch.bfloat16)
        p = src / f"req-{i}.safetensors"
        save_file({"hidden_states": hs, "token_ids": ids}, str(p))
        out.append((p, ids.tolist()))
    return out


def fresh(files: list[tuple[Path, list[int]]], storage: Path) -> list[tuple[Path, list[int]]]:
    """Copies of the connector files in `storage` (a rename consumes them), out of the page cache's favour: each
    path reads files the copy has just written, as the client reads what the server has just written."""
    storage.mkdir(parents=True, exist_ok=True)
    out = []
    for p, ids in files:
        q = storage / p.name
        shutil.copyfile(p, q)
        out.append((q, ids))
    return out


def cpu_seconds(fn: Callable[[list[tuple[Path, list[int]]]], None], files: list[tuple[Path, list[int]]]) -> float:
    t = time.process_time()
    fn(files)
    return time.process_time() - t


def validate_only(files: list[tuple[Path, list[int]]]) -> None:
    for p, ids in files:
        validate_states_file(p, ids, LAYER_IDS, hidden_size=H).close()


def into_shard(files: list[tuple[Path, list[int]]], out: Path) -> None:
    sids = [f"s{i}" for i in range(len(files))]
    lengths = [len(ids) for _, ids in files]
    layout = shard_layout(
        sids,
        lengths,
        list(range(len(files))),
        n_aux=N_AUX,
        hidden=H,
        state_dtype=torch.bfloat16,
        ids_dtype=IDS_DTYPE,
        mask_dtype=MASK_DTYPE,
    )
    with open(out, "wb") as fh:
        w = StreamingSafetensorsWriter(fh, layout, {})
        for sid, (p, ids) in zip(sids, files):
            file = validate_states_file(p, ids, LAYER_IDS, hidden_size=H)
            hs = file.states
            w.write(tensor_key(sid, "aux_hidden_states"), hs[:, :N_AUX].reshape(file.facts.tokens, N_AUX * H))
            w.write(tensor_key(sid, "final_hidden_state"), hs[:, N_AUX])
            w.write(tensor_key(sid, "input_ids"), torch.tensor(ids, dtype=IDS_DTYPE))
            del hs
            file.close()
        for sid, n in zip(sids, lengths):
            w.write(tensor_key(sid, "loss_mask"), torch.ones(n, dtype=MASK_DTYPE))
        w.finish()
        fh.flush()
        os.fsync(fh.fileno())
    for p, _ in files:
        p.unlink()


def speculators(files: list[tuple[Path, list[int]]], export: Path) -> None:
    for i, (p, ids) in enumerate(files):
        hand_off(p, export / "hidden_states" / f"hs_{i}.safetensors", ids, LAYER_IDS, hidden_size=H)


def speculators_with(digest: Callable[[mmap.mmap], object] | None, files, export: Path) -> None:
    """hand_off's steps with another integrity record (`digest` over the mapping, or none: size only)."""
    for i, (p, ids) in enumerate(files):
        buf = map_file(p)
        if digest is not None:
            digest(buf)
        t = safetensors_views(p, buf)
        check_states(p, t["hidden_states"], t["token_ids"], ids, LAYER_IDS, hidden_size=H)
        del t
        place_file(p, export / "hidden_states" / f"hs_{i}.safetensors", buf)
        buf.close()


def _sha256(buf: mmap.mmap) -> str:
    return hashlib.sha256(buf).hexdigest()


def specforge(files: list[tuple[Path, list[int]]], export: Path, head: TargetHead) -> None:
    for i, (p, ids) in enumerate(files):
        file = validate_states_file(p, ids, LAYER_IDS, hidden_size=H)
        hs = file.states
        t = len(ids)
        tensors = {
            "input_ids": torch.tensor(ids, dtype=torch.int64),
            "loss_mask": torch.ones(t, dtype=torch.int64),
            "aux_hidden_states": hs[:, :N_AUX].reshape(t, N_AUX * H),
            "final_hidden_state": head.final_norm(hs[:, N_AUX]),
        }
        data = trainer_layout(SPECFORGE).serialise(tensors, N_AUX, H)
        write_bytes_atomic(data, export / "train" / f"s{i}.ckpt")
        sample_file_digest(data)
        del hs, tensors
        file.close()
        p.unlink()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--mean-tokens", type=int, default=3460)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3, help="runs of every path, interleaved; the best of each is shown")
    ap.add_argument("--storage", default=None, help="the connector's storage and the export root (default: a temp dir)")
    ap.add_argument(
        "--other-fs", default="/dev/shm", help="connector storage on another filesystem than --storage ('' to skip)"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    rng = np.random.default_rng(args.seed)
    lengths = [max(16, int(args.mean_tokens * x)) for x in rng.uniform(0.25, 2.5, args.rows)]
    work = Path(tempfile.mkdtemp(prefix="bench-layout-", dir=args.storage))
    other = Path(tempfile.mkdtemp(prefix="bench-layout-", dir=args.other_fs)) if args.other_fs else None
    try:
        files = make_connector_files(work / "orig", lengths, args.seed)
        gb = sum(len(ids) * len(LAYER_IDS) * H * 2 for _, ids in files) / 1e9
        head = TargetHead(torch.rand(H) + 0.5, 1e-6, torch.empty(0, H), {})
        print(f"{args.rows} rows, {sum(lengths):,} tokens ({min(lengths)}..{max(lengths)}), {gb:.2f} GB of bf16 states")
        print(f"H = {H}, layer ids {list(LAYER_IDS)}; torch {torch.__version__}, 1 thread; storage {work}\n")
        conn, far = work / "connector", (other / "connector" if other is not None else None)
        runs: list[tuple[str, Path, Callable[[list[tuple[Path, list[int]]]], None]]] = [
            ("validate", conn, validate_only),
            ("shards (today's vllm engine)", conn, lambda f: into_shard(f, work / "shard.safetensors")),
            ("speculators, rename", conn, lambda f: speculators(f, work / "export-spec")),
            ("  the same with a sha256", conn, lambda f: speculators_with(_sha256, f, work / "export-spec")),
            ("  the same with no digest", conn, lambda f: speculators_with(None, f, work / "export-spec")),
            ("specforge (.ckpt, post-norm)", conn, lambda f: specforge(f, work / "export-sf", head)),
        ]
        if far is not None and os.stat(other).st_dev != os.stat(work).st_dev:  # connector on tmpfs, exports on disk
            runs.insert(5, ("speculators, one copy across fs", far, lambda f: speculators(f, work / "export-spec")))
        best = dict.fromkeys((name for name, _, _ in runs), float("inf"))
        # The paths interleaved, the best of each kept: a busy machine's noise only ever adds time.
        for _ in range(args.repeat):
            for name, storage, fn in runs:
                batch = fresh(files, storage)
                best[name] = min(best[name], cpu_seconds(fn, batch) / gb)
                for p in storage.glob("*"):
                    p.unlink()
        base = best["validate"]
        for name, s in best.items():
            print(f"  {name:34s} {s:6.2f} CPU s/GB  {s / base:5.2f}x validate")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if other is not None:
            shutil.rmtree(other, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
