"""Teacher-agreement rates the semantic audit's threshold is chosen from (docs/hidden_states.md §7).

Tiny seeded targets (final-norm weights far from 1) write their own texts, greedy and sampled; the states are then
extracted cleanly and with each corruption injected through hooks on the model, and the audit's top-1 agreement
is printed. No real target's weights are available offline here, so real-model figures are not measured.

    python benchmarks/bench_teacher_agreement.py [--rows 24] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from eagle_pipeline.hidden_states.checks.audit import TeacherJudgement, audit_shard
from eagle_pipeline.hidden_states.models.layers import get_backbone
from eagle_pipeline.hidden_states.models.model import build_tiny_model
from eagle_pipeline.hidden_states.run import extract_shard

VOCAB = 4096


def texts(model, n: int, new_tokens: int, temperature: float, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    ids_l, mask_l = [], []
    for _ in range(n):
        ids = rng.integers(1, VOCAB, int(rng.integers(4, 16))).tolist()
        prompt = len(ids)
        with torch.no_grad():
            for _ in range(new_tokens):
                h = get_backbone(model)(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state[0, -1]
                logits = model.lm_head(h)
                if temperature == 0:
                    ids.append(int(logits.argmax()))
                else:
                    ids.append(int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)))
        ids_l.append(ids)
        mask_l.append([0] * prompt + [1] * (len(ids) - prompt))
    return pa.table(
        {
            "sample_id": [f"s{i}" for i in range(n)],
            "dataset": ["D"] * n,
            "input_ids": pa.array(ids_l, pa.list_(pa.int32())),
            "loss_mask": pa.array(mask_l, pa.list_(pa.int8())),
            "n_tokens": pa.array([len(x) for x in ids_l], pa.int32()),
        }
    )


@contextlib.contextmanager
def hooks(pairs):
    handles = [m.register_forward_hook(lambda _m, a, o, fn=fn: fn(a, o)) for m, fn in pairs]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def final_from(source, last) -> list:
    """Hooks that make the last layer output what `source` output (a wrong layer id for the final state)."""
    store: dict[str, torch.Tensor] = {}
    return [(source, lambda _a, o: store.__setitem__("x", o)), (last, lambda _a, _o: store["x"])]


def agreement(model, table: pa.Table, work: Path, name: str, pairs=()) -> float:
    merged = work / name / "merged"
    merged.mkdir(parents=True)
    pq.write_table(table, merged / "part-00000.parquet")
    with hooks(pairs):
        extract_shard(model, merged, shard_index=0, shard_size=table.num_rows, out_dir=work / name / "hs")
    r = audit_shard(work / name / "hs", 0, merged, expected_aux_layers=None, judgement=TeacherJudgement(True))
    return float(r["teacher_agreement"].metrics["top1_agreement"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=48)
    args = ap.parse_args()
    print(f"chance = 1/V = {1 / VOCAB:.5f}; rows {args.rows}, {args.new_tokens} output tokens each")
    for family in ("deepseek_v3", "llama"):
        model = build_tiny_model(VOCAB, family=family, seed=1)
        other = build_tiny_model(VOCAB, family=family, seed=2)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for m in (model, other):
                get_backbone(m).norm.weight.copy_(
                    0.5 + 1.5 * torch.rand(get_backbone(m).norm.weight.shape, generator=g)
                )
        bb = get_backbone(model)
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            for temp in (0.0, 0.7, 1.0):
                t = texts(model, args.rows, args.new_tokens, temp, seed=3)
                print(f"{family:12s} own text, temperature {temp}: clean {agreement(model, t, work, f'c{temp}'):.3f}")
            t = texts(model, args.rows, args.new_tokens, 0.0, seed=3)
            cases = {
                "shifted by one token": [(bb.layers[-1], lambda _a, o: o.roll(1, dims=1))],
                "final = layer L-4 output": final_from(bb.layers[-4], bb.layers[-1]),
                "final = layer 1 output": final_from(bb.layers[1], bb.layers[-1]),
                "zeroed": [(bb.layers[-1], lambda _a, o: torch.zeros_like(o))],
            }
            for name, pairs in cases.items():
                print(f"{family:12s} greedy text, {name}: {agreement(model, t, work, name, pairs):.3f}")
            print(f"{family:12s} greedy text, another model's states: {agreement(other, t, work, 'other'):.3f}")


if __name__ == "__main__":
    main()
