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
    tmp_path.mkdir(parents=True, exist_ok=True)
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


def _ragged(n_conv: int) -> pa.Table:
    """Conversations of 1, 2 or 3 turns (conversation c keeps its first c % 3 + 1), and two rows of no conversation."""
    table = _conversations(n_conv).to_pylist()
    rows = [r for r in table if r["turn_index"] <= int(r["conversation_id"][1:]) % 3]
    for i in range(2):
        rows.append({**rows[i], "sample_id": f"single-{i}", "prompt_key": f"single-{i}", "conversation_id": None})
        rows[-1]["turn_index"] = None
    return pa.Table.from_pylist(rows, schema=_conversations(1).schema)


def _kept_conversations(rows: list[dict]) -> dict[str, int]:
    kept: dict[str, int] = {}
    for r in rows:
        group = r["sample_id"].rsplit("-t", 1)[0]
        kept[group] = kept.get(group, 0) + 1
    return kept


def test_caps_and_weights_keep_whole_conversations(tmp_path):
    from eagle_pipeline.merge.arrow_ops import hash_u64

    table = _ragged(30)
    size = _kept_conversations(table.to_pylist())  # rows of each conversation (a single row: its own group)
    assert sorted(set(size.values())) == [1, 2, 3] and sum(size.values()) == table.num_rows == 62
    # The documented ranking: the seeded hash of the conversation id, ties by id.
    names = sorted(size)
    ranking = [names[i] for i in np.lexsort((np.array(names), hash_u64(names, "select:3:B5")))]

    short_of_cap = 0
    for cap in (0, 1, 2, 5, 9, 10, 31, 61):
        manifest, rows = _merge(tmp_path / f"cap{cap}", table, seed=3, caps={"B5": cap}, eval_fraction=0.3)
        kept = _kept_conversations(rows)
        assert all(kept[c] == size[c] for c in kept), cap  # no conversation cut
        n = len(rows)
        assert n <= cap and (manifest.excluded["B5"]["cap"], manifest.excluded["B5"]["weight"]) == (62 - n, 0)
        # Whole conversations in ranking order until the next one would exceed the cap.
        prefix = ranking[: len(kept)]
        assert set(kept) == set(prefix), cap
        if len(kept) < len(ranking):
            assert n + size[ranking[len(kept)]] > cap, cap
        short_of_cap += n < cap
        split_of: dict[str, set[str]] = {}
        for r in rows:
            split_of.setdefault(r["sample_id"].rsplit("-t", 1)[0], set()).add(r["split"])
        assert all(len(s) == 1 for s in split_of.values())
    assert short_of_cap >= 2  # some caps fell inside a conversation: a row cap would have cut it

    manifest, rows = _merge(tmp_path / "weight", table, seed=3, weights={"B5": 0.4})
    kept = _kept_conversations(rows)
    assert set(kept) == set(ranking[: round(len(ranking) * 0.4)])
    assert all(kept[c] == size[c] for c in kept)
    assert manifest.excluded["B5"]["weight"] == 62 - len(rows) and manifest.excluded["B5"]["cap"] == 0
    # A cap with a weight: a prefix of the weighted conversations.
    manifest, capped = _merge(tmp_path / "both", table, seed=3, weights={"B5": 0.4}, caps={"B5": 7})
    both = _kept_conversations(capped)
    assert set(both) <= set(kept) and len(capped) <= 7 and all(both[c] == size[c] for c in both)
    assert manifest.excluded["B5"]["cap"] == len(rows) - len(capped)
