"""Checks of an extracted shard against its own index and the merged table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from eagle_pipeline.hidden_states.store.fingerprint import recorded_fingerprint
from eagle_pipeline.hidden_states.store.format import read_index, read_index_meta, shard_paths
from eagle_pipeline.hidden_states.store.merged import read_rows
from eagle_pipeline.shared.checks import CheckResult

MAX_FAILING_IDS = 10


class _Tally:
    def __init__(self, name: str):
        self.name, self.checked, self.failing = name, 0, 0
        self.ids: list[str] = []
        self.notes: list[str] = []

    def record(self, sample_id: str, ok: bool, note: str = "") -> None:
        self.checked += 1
        if not ok:
            self.failing += 1
            if len(self.ids) < MAX_FAILING_IDS:
                self.ids.append(sample_id)
                if note:
                    self.notes.append(f"{sample_id}: {note}")

    def result(self) -> CheckResult:
        return CheckResult(self.name, self.failing == 0, self.checked, self.failing, self.ids, "; ".join(self.notes))


def verify_shard(out_dir: str | Path, shard_index: int, merged_dir: str | Path) -> dict[str, CheckResult]:
    """Three checks, reading one sample at a time (memory = one sample):

    - `shapes`: every sample has its four tensors, aux [T, n_aux*H], final [T, H], ids and mask [T],
      T = the index's n_tokens;
    - `finite`: no NaN/Inf in aux or final;
    - `ids_match`: the shard holds exactly the merged rows of its range, less those its metadata records as dropped
      by choice (`dropped_rows`: the vllm engine's `too_long_rows: drop`, named in the detail), and each sample's
      stored ids and loss mask equal the merged table's.
    """
    from eagle_pipeline.hidden_states.layouts.trainer_layouts import open_shard

    idx_path = shard_paths(out_dir, shard_index)[1]
    meta = read_index_meta(idx_path)
    index = read_index(idx_path)
    hidden, n_aux = int(meta["hidden_size"]), len(recorded_fingerprint(meta).aux_layers)
    merged = read_rows(merged_dir, int(meta["row_start"]), int(meta["row_stop"]))
    merged_by_id = {sid: i for i, sid in enumerate(merged.sample_ids)}

    shapes, finite, ids_match = _Tally("shapes"), _Tally("finite"), _Tally("ids_match")
    index_ids = index.column("sample_id").to_pylist()
    dropped = {str(d["sample_id"]) for d in meta.get("dropped_rows") or []}
    for sid in sorted(set(merged.sample_ids) - set(index_ids) - dropped):
        ids_match.record(sid, False, "merged row missing from shard")
    if dropped:
        ids_match.notes.append(f"{len(dropped)} rows dropped by choice (dropped_rows): {', '.join(sorted(dropped))}")

    with open_shard(out_dir, shard_index) as reader:
        for sid, t in zip(index_ids, index.column("n_tokens").to_pylist()):
            if not reader.has(sid):
                shapes.record(sid, False, f"missing tensors of {sid} ({reader.layout} layout)")
                finite.record(sid, False, "tensors missing")
                ids_match.record(sid, False, "tensors missing")
                continue
            tensors = reader.get(sid)
            expected = {
                "aux_hidden_states": (t, n_aux * hidden),
                "final_hidden_state": (t, hidden),
                "input_ids": (t,),
                "loss_mask": (t,),
            }
            wrong = {n: tuple(tensors[n].shape) for n, s in expected.items() if tuple(tensors[n].shape) != s}
            shapes.record(sid, not wrong, f"shape {wrong} expected T={t}" if wrong else "")
            n_bad = sum(int((~torch.isfinite(tensors[n])).sum()) for n in ("aux_hidden_states", "final_hidden_state"))
            finite.record(sid, n_bad == 0, f"{n_bad} non-finite values" if n_bad else "")
            row = merged_by_id.get(sid)
            if row is None:
                ids_match.record(sid, False, "sample_id not in the merged rows of this shard's range")
                continue
            same = np.array_equal(tensors["input_ids"].numpy().astype(np.int64), merged.input_ids[row].astype(np.int64))
            same_mask = np.array_equal(
                tensors["loss_mask"].numpy().astype(np.int64), merged.loss_mask[row].astype(np.int64)
            )
            note = "" if same and same_mask else ("input_ids differ" if not same else "loss_mask differs")
            ids_match.record(sid, same and same_mask, note)
    return {c.name: c.result() for c in (shapes, finite, ids_match)}
