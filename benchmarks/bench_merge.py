"""Full-scale merge benchmark: 40,000 samples, 138.4M tokens over eight datasets.

    .venv/bin/python benchmarks/bench_merge.py [--workdir DIR] [--keep] [--skip-exports]

Builds synthetic token-sample files (log-normal lengths, ~15% prompt, outputs ending in eot 163586,
Zipf-like ids, some cross-dataset prompt duplicates, ~3% audit rejects), then runs each measured step in a
fresh subprocess so its peak RSS (ru_maxrss) is that step's alone. Prints figures and a verdict per target.
Not a test: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

EOT = 163586
VOCAB = 163840
DATASETS = {  # name -> (samples, relative mean length): reasoning-heavy sets are longer
    "B1": (8000, 0.7),
    "B2": (6000, 1.0),
    "B3": (6000, 1.4),
    "B4": (5000, 0.8),
    "B5": (5000, 1.2),
    "B6": (4000, 1.0),
    "B7": (3000, 1.6),
    "B8": (3000, 0.9),
}
TOTAL_TOKENS = 138_400_000
TARGETS = {"merge_s": 60.0, "merge_rss_gib": 4.0, "vocab_s": 30.0}


def _lengths(rng: np.random.Generator) -> dict[str, np.ndarray]:
    raw = {ds: rng.lognormal(np.log(3000 * rel), 0.8, n) for ds, (n, rel) in DATASETS.items()}
    scale = TOTAL_TOKENS / sum(v.sum() for v in raw.values())
    lens = {ds: np.maximum(np.rint(v * scale), 16).astype(np.int64) for ds, v in raw.items()}
    # Put the rounding remainder on the longest row so the total is exact.
    diff = TOTAL_TOKENS - sum(int(v.sum()) for v in lens.values())
    longest = max(lens, key=lambda d: lens[d].max())
    lens[longest][np.argmax(lens[longest])] += diff
    return lens


def _zipf_ids(rng: np.random.Generator, n: int, perm: np.ndarray) -> np.ndarray:
    out = np.empty(n, dtype=np.int32)
    step = 1 << 24
    for i in range(0, n, step):
        m = min(step, n - i)
        # Zipf (s=1) ranks by inverse CDF: P(rank < r) = ln(r + 1) / ln(n + 1), as in natural text.
        rank = np.minimum(np.exp(rng.random(m) * np.log(len(perm) + 1)).astype(np.int64) - 1, len(perm) - 1)
        out[i : i + m] = perm[rank]
    return out


def build_inputs(workdir: Path, seed: int = 0) -> dict:
    from eagle_pipeline.shared.storage import file_sha256, write_parquet_atomic

    rng = np.random.default_rng(seed)
    perm = rng.permutation(VOCAB - 256).astype(np.int32)  # specials (>= VOCAB-256) only appear as eot
    lengths = _lengths(rng)
    inputs = []
    shared_keys = [f"shared-{i}" for i in range(400)]  # prompts that recur across datasets (dedup fodder)
    for ds, total in lengths.items():
        n = len(total)
        plen = np.clip(np.rint(total * rng.beta(3, 17, n)), 1, total - 2).astype(np.int64)  # ~15% prompt
        olen = total - plen
        pv = _zipf_ids(rng, int(plen.sum()), perm)
        ov = _zipf_ids(rng, int(olen.sum()), perm)
        o_off = np.concatenate([[0], np.cumsum(olen)])
        ov[o_off[1:] - 1] = EOT
        p_off = np.concatenate([[0], np.cumsum(plen)]).astype(np.int32)
        keys = np.array([f"{ds}-key-{i}" for i in range(n)], dtype=object)
        dup_rows = rng.choice(n, 100, replace=False)
        keys[dup_rows] = rng.choice(shared_keys, 100)
        table = pa.table(
            {
                "sample_id": [f"{ds}-{i:06d}" for i in range(n)],
                "dataset": [ds] * n,
                "source": ["simulated"] * n,
                "backend": ["bench"] * n,
                "provider": pa.nulls(n, pa.string()),
                "prompt_ids": pa.ListArray.from_arrays(pa.array(p_off), pa.array(pv)),
                "output_ids": pa.ListArray.from_arrays(pa.array(o_off.astype(np.int32)), pa.array(ov)),
                "ids_origin": ["returned"] * n,
                "finish_reason": ["stop"] * n,
                "usage_completion_tokens": olen,
                "thinking": np.ones(n, dtype=bool),
                "dataset_has_tools": np.zeros(n, dtype=bool),
                "n_tool_calls": np.zeros(n, dtype=np.int32),
                "literal_special": np.zeros(n, dtype=bool),
                "prompt_key": pa.array(keys, pa.string()),
            }
        )
        path = write_parquet_atomic(table, workdir / "tokens" / f"{ds}.parquet")
        keep = rng.random(n) >= 0.03
        np.save(workdir / "tokens" / f"{ds}.keep.npy", keep)
        inputs.append(
            {
                "dataset": ds,
                "path": str(path),
                "keep": str(workdir / "tokens" / f"{ds}.keep.npy"),
                "version": file_sha256(path),
                "rejected": int((~keep).sum()),
            }
        )
        del table, pv, ov
    return {"inputs": inputs, "tokens": TOTAL_TOKENS, "samples": sum(n for n, _ in DATASETS.values())}


# --- child steps: each runs in its own process so ru_maxrss is the step's own peak ---------------------


def _child(step: str, workdir: Path) -> None:
    import resource

    from eagle_pipeline import merge as M

    spec = json.loads((workdir / "inputs.json").read_text())
    merged, result = workdir / "merged", {}
    if step == "vocab":
        import torch  # noqa: F401  (import outside the timed region; a long-lived process has it loaded)
    t0 = time.perf_counter()
    if step == "merge":
        inputs = [
            M.MergeInput(
                i["dataset"],
                Path(i["path"]),
                keep_mask=np.load(i["keep"]),
                excluded_by_gate={"synthetic_reject": i["rejected"]},
                upstream_version=i["version"],
            )
            for i in spec["inputs"]
        ]
        man = M.merge_datasets(inputs, merged, M.MergeSettings(seed=0, eval_fraction=0.01), config_hash="bench")
        result = {
            "rows": man.rows_total,
            "tokens": man.tokens_total,
            "supervised": man.supervised_tokens_total,
            "shards": len(man.shards),
            "excluded": {d: v for d, v in man.excluded.items()},
        }
    elif step == "vocab":
        s = M.build_draft_vocab(merged, VOCAB, workdir / "draft_vocab", k=32000)
        result = {"coverage": s.coverage, "distinct": s.distinct_supervised_tokens, "supervised": s.supervised_tokens}
    elif step == "checks":
        man = M.MergeManifest.read(merged)
        rs = [
            M.check_row_count(merged, man.rows_total),
            M.check_unique_sample_ids(merged),
            M.check_loss_mask_aligned(merged),
            M.check_supervised_spans_end_with_eot(merged, EOT),
        ]
        result = {r.name: r.passed for r in rs}
    elif step == "export_jsonl":
        s = M.export_specforge_jsonl(merged, workdir / "exports" / "specforge_train.jsonl")
        result = {"rows": s.rows, "bytes": (workdir / "exports" / "specforge_train.jsonl").stat().st_size}
    elif step == "export_hf":
        s = M.export_hf_parquet(merged, workdir / "exports" / "hf")
        result = {"rows": s.rows}
    wall = time.perf_counter() - t0
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
    print(json.dumps({"step": step, "wall_s": wall, "peak_rss_gib": rss_gib, **result}))


def _run_child(step: str, workdir: Path) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", step, "--workdir", str(workdir)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--keep", action="store_true", help="keep the synthetic data and outputs")
    ap.add_argument("--skip-exports", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.workdir)
        return

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_merge_"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        spec = build_inputs(workdir)
        (workdir / "inputs.json").write_text(json.dumps(spec))
        print(
            f"synthetic inputs: {spec['samples']} samples, {spec['tokens']:,} tokens, 8 datasets "
            f"({time.perf_counter() - t0:.1f} s to build) in {workdir}"
        )
        steps = ["merge", "checks", "vocab"] + ([] if args.skip_exports else ["export_jsonl", "export_hf"])
        res = {}
        for step in steps:
            res[step] = r = _run_child(step, workdir)
            extra = {k: v for k, v in r.items() if k not in ("step", "wall_s", "peak_rss_gib")}
            print(f"{step:13s} wall {r['wall_s']:7.2f} s   peak RSS {r['peak_rss_gib']:5.2f} GiB   {json.dumps(extra)}")
        verdicts = [
            ("merge wall time", res["merge"]["wall_s"], TARGETS["merge_s"], "s"),
            ("merge peak RSS", res["merge"]["peak_rss_gib"], TARGETS["merge_rss_gib"], "GiB"),
            ("draft vocab build", res["vocab"]["wall_s"], TARGETS["vocab_s"], "s"),
        ]
        for name, value, target, unit in verdicts:
            print(f"{'PASS' if value < target else 'FAIL'}: {name} {value:.2f} {unit} (target < {target:g} {unit})")
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
