"""Regenerated conversations in the merge: one split per conversation; `loss_on: all_turns` folds verbatim turns."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle_pipeline.merge import MergeInput, MergeSettings, merge_datasets
from eagle_pipeline.merge.reader import read_merged

from .conftest import EOT


def _conversations(n_conv: int, *, rewrite_every: int = 0, seed: int = 0) -> pa.Table:
    """3-turn conversations: turn k+1's prompt holds turn k's prompt and output verbatim, except in every
    `rewrite_every`-th conversation, whose template rewrote turn 0 in later prompts (its first id dropped)."""
    rng = np.random.default_rng(seed)
    rows = []
    for c in range(n_conv):
        prompt = rng.integers(0, 500, 6).tolist()
        for k in range(3):
            out = rng.integers(0, 500, 4 + k).tolist() + [EOT]
            rows.append((f"c{c:03d}", k, prompt, out))
            shown = out[1:] if rewrite_every and c % rewrite_every == 0 and k == 0 else out
            prompt = prompt + shown + rng.integers(0, 500, 3).tolist()  # the tool result, the next header
    return pa.table(
        {
            "sample_id": [f"{c}-t{k}" for c, k, _, _ in rows],
            "dataset": ["B5"] * len(rows),
            "prompt_ids": pa.array([p for *_, p, _ in rows], pa.list_(pa.int32())),
            "output_ids": pa.array([o for *_, o in rows], pa.list_(pa.int32())),
            "prompt_key": [f"{c}-{k}" for c, k, _, _ in rows],
            "conversation_id": [c for c, *_ in rows],
            "turn_index": pa.array([k for _, k, _, _ in rows], pa.int32()),
        }
    )


def _merge(tmp_path, table: pa.Table, **kw):
    path = tmp_path / "tokens.parquet"
    pq.write_table(table, path)
    manifest = merge_datasets([MergeInput("B5", path)], tmp_path / "merged", MergeSettings(**kw))
    return manifest, read_merged(tmp_path / "merged").to_pylist()


def test_a_conversation_stays_in_one_split(tmp_path):
    manifest, rows = _merge(tmp_path, _conversations(40), eval_fraction=0.5)
    split_of: dict[str, set[str]] = {}
    for r in rows:
        split_of.setdefault(r["sample_id"].rsplit("-t", 1)[0], set()).add(r["split"])
    assert len(rows) == 120 and all(len(s) == 1 for s in split_of.values())
    assert 0 < manifest.splits["eval"] < 120  # both splits used, whole conversations each


@pytest.mark.parametrize("loss_on", ["last_turn", "all_turns"])
def test_loss_on(tmp_path, loss_on):
    table = _conversations(6, rewrite_every=3)  # conversations c000 and c003 had turn 0 rewritten
    manifest, rows = _merge(tmp_path, table, loss_on=loss_on)
    src = {r["sample_id"]: r for r in table.to_pylist()}
    by_id = {r["sample_id"]: r for r in rows}
    if loss_on == "last_turn":
        assert set(by_id) == set(src) and manifest.excluded["B5"]["folded"] == 0
        for sid, r in by_id.items():
            assert r["loss_mask"] == [0] * len(src[sid]["prompt_ids"]) + [1] * len(src[sid]["output_ids"])
        return
    rewritten = {"c000", "c003"}
    expect = {f"{c}-t2" for c in ("c001", "c002", "c004", "c005")} | {f"{c}-t{k}" for c in rewritten for k in (0, 2)}
    assert set(by_id) == expect and manifest.excluded["B5"]["folded"] == 18 - len(expect)
    for sid, r in by_id.items():
        conv, k = sid.rsplit("-t", 1)
        own = src[sid]
        assert r["input_ids"] == own["prompt_ids"] + own["output_ids"]
        mask = np.asarray(r["loss_mask"])
        want = np.zeros(len(mask), dtype=np.int64)
        want[len(own["prompt_ids"]) :] = 1
        folded = [1] if conv in rewritten and k == "2" else ([0, 1] if k == "2" else [])
        for j in folded:
            turn = src[f"{conv}-t{j}"]
            start = len(turn["prompt_ids"])
            want[start : start + len(turn["output_ids"])] = 1
            assert r["input_ids"][start : start + len(turn["output_ids"])] == turn["output_ids"]
        assert mask.tolist() == want.tolist(), sid
    assert manifest.supervised_tokens_total == sum(int(np.sum(r["loss_mask"])) for r in rows)
    assert manifest.supervised_tokens_total == sum(len(r["output_ids"]) for r in src.values())
