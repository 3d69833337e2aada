"""`loss_on: all_turns`: the turns of a regenerated conversation folded into its later turns' rows.

With `regenerate: all_turns` every generated turn is its own token sample (prompt, then that turn's output), so the
default `loss_on: last_turn` supervises each turn exactly once, in the row that generated it. `all_turns` instead
folds turn k into turn k+1 when turn k+1's prompt ids start with turn k's prompt and output ids verbatim (the chat
template kept that turn as generated: Kimi keeps the reasoning of the tool-call turns of an agent loop): the row of
turn k is dropped and its output span is supervised inside turn k+1's prompt. A turn the template rewrote in later
prompts (reasoning dropped from history, SpecForge #419) is never folded: its row stays, supervised on its own
output only, so no token is ever trained on text the target did not produce at that position.

Weights and caps pick whole conversations (`select_groups`): a conversation is kept or dropped with all its turns.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from eagle_pipeline.merge.arrow_ops import hash_u64
from eagle_pipeline.shared.arrow import list_parts, list_rows, make_list

LOSS_ON_MODES = ("last_turn", "all_turns")


def select_groups(groups: np.ndarray, weight: float, cap: int | None, salt: str) -> tuple[np.ndarray, int, int]:
    """Which rows a dataset's weight and cap keep, whole groups only (`groups`: each row's conversation, its own
    sample id when it is none), and the rows dropped by the weight and by the cap.

    The groups are ranked by the seeded hash of their id (`salt`), ties by id. The weight keeps the first
    `round(G * weight)` of the G groups; the cap then keeps the longest prefix of those whose rows together do not
    exceed it: never more rows than the cap, and short of it by less than the next group's rows. With one row per
    group (no conversations) that is `round(n * weight)` rows, then at most `cap`, as before.
    """
    n = len(groups)
    keep = np.ones(n, dtype=bool)
    if n == 0:
        return keep, 0, 0
    names, inverse, sizes = np.unique(groups.astype(str), return_inverse=True, return_counts=True)
    n_weighted = math.floor(len(names) * float(weight) + 0.5)
    if n_weighted == len(names) and (cap is None or cap >= n):
        return keep, 0, 0
    ranked = np.lexsort((names, hash_u64(list(names), salt)))[:n_weighted]
    rows_weighted = np.cumsum(sizes[ranked])
    n_capped = n_weighted if cap is None else int(np.searchsorted(rows_weighted, cap, side="right"))
    chosen = np.zeros(len(names), dtype=bool)
    chosen[ranked[:n_capped]] = True
    keep = chosen[inverse]
    weighted = int(rows_weighted[-1]) if n_weighted else 0
    return keep, n - weighted, weighted - int(np.count_nonzero(keep))


def fold_turns(table: pa.Table) -> tuple[np.ndarray, dict[int, list[tuple[int, int]]]]:
    """Which rows of a table (columns dataset, conversation_id, turn_index, prompt_ids, output_ids) stay, and for each
    staying row that absorbed earlier turns the [start, end) spans of their outputs in its prompt ids."""
    n = table.num_rows
    keep = np.ones(n, dtype=bool)
    spans: dict[int, list[tuple[int, int]]] = {}
    if n == 0 or "conversation_id" not in table.column_names:
        return keep, spans
    conv = table.column("conversation_id").to_pylist()
    turn = table.column("turn_index").to_pylist()
    ds = table.column("dataset").to_pylist()
    groups: dict[tuple[str, str], list[int]] = {}
    for i, c in enumerate(conv):
        if c is not None and turn[i] is not None:
            groups.setdefault((ds[i], c), []).append(i)
    if not groups:
        return keep, spans
    prompts = list_rows(table.column("prompt_ids"), np.int32, name="prompt_ids")
    outputs = list_rows(table.column("output_ids"), np.int32, name="output_ids")
    for rows in groups.values():
        rows.sort(key=lambda i: turn[i])
        for a, b in zip(rows, rows[1:]):
            if turn[b] != turn[a] + 1:
                continue  # a missing turn (not admitted): nothing to fold across
            p, o, nxt = prompts[a], outputs[a], prompts[b]
            end = len(p) + len(o)
            if len(nxt) >= end and np.array_equal(nxt[: len(p)], p) and np.array_equal(nxt[len(p) : end], o):
                keep[a] = False
                spans[b] = spans.pop(a, []) + [(len(p), end)]
    return keep, spans


def apply_spans(loss_mask: pa.Array, row_spans: list[list[tuple[int, int]]]) -> pa.ListArray:
    """The loss mask with 1 set on each row's extra spans (`row_spans[i]` for row i)."""
    lengths, values = list_parts(loss_mask, pa.int8())
    values = values.copy()
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    for i, row in enumerate(row_spans):
        for a, b in row:
            values[starts[i] + a : starts[i] + b] = 1
    return make_list(lengths, values, pa.int8())
