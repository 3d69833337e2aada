"""A shard's progress reports: rows and tokens done of total (both engines), tokens/s, ETA, throttling."""

from __future__ import annotations

import pytest

from eagle_pipeline.hidden_states.engines.vllm.vllm_files import vllm_layer_ids
from eagle_pipeline.hidden_states.run import extract_shard
from eagle_pipeline.shared.progress import WorkProgress, progress_reporter
from eagle_pipeline.simulation.vllm_hidden_states import VLLMHiddenStatesDouble
from eagle_pipeline_tests.hidden_states.engine_runs import vllm_shard

from .conftest import make_rows

ROWS = make_rows(8, seed=9, min_len=3, max_len=40)
TOKENS = sum(len(r["input_ids"]) for r in ROWS)


@pytest.fixture
def merged(merged_factory):
    return merged_factory(ROWS, [3, 5])


def test_figures_and_eta_by_tokens():
    p = WorkProgress("shard 00002", "rows", done=4, total=8, tokens_done=100, tokens_total=400, elapsed_s=4.0)
    assert p.figures() == {
        "rows_done": 4,
        "rows_total": 8,
        "percent_done": 50.0,
        "eta_s": 12.0,  # 300 tokens left at 25 tokens/s (the rows left, at 1 row/s, would say 4 s)
        "tokens_done": 100,
        "tokens_total": 400,
        "tokens_per_s": 25.0,
        "rows_per_s": 1.0,
        "elapsed_s": 4.0,
    }
    assert p.headline() == "shard 00002 4/8 rows (50%) 25 tokens/s eta 12s"
    assert p.format() == "shard 00002: 4/8 rows (50%), 100/400 tokens, 1.0 rows/s, 25 tokens/s, ETA 12 s"
    assert "eta_s" not in WorkProgress("s", "rows", 0, 8, 0, 400, 0.5).figures()


def test_reporter_is_throttled_and_always_reports_the_end():
    seen: list[WorkProgress] = []
    report = progress_reporter(seen.append, "shard 00000", every_s=3600)
    for done in range(1, 6):
        report(done, 5, 10 * done, 50)
    assert [(p.done, p.tokens_done) for p in seen] == [(1, 10), (5, 50)]


def _check_reports(seen: list[WorkProgress], rows: int, tokens: int) -> None:
    assert seen, "no progress reported"
    assert [p.done for p in seen] == sorted(p.done for p in seen)
    assert [p.tokens_done for p in seen] == sorted(p.tokens_done for p in seen)
    assert all((p.total, p.tokens_total) == (rows, tokens) for p in seen)
    assert (seen[-1].done, seen[-1].tokens_done) == (rows, tokens)


def test_in_process_extraction_reports_rows_and_tokens(tiny_ds, merged, tmp_path):
    seen: list[WorkProgress] = []
    summary = extract_shard(
        tiny_ds,
        merged,
        shard_index=0,
        shard_size=8,
        out_dir=tmp_path / "hs",
        max_tokens_per_batch=64,  # several batches
        progress=progress_reporter(seen.append, "shard 00000", every_s=0),
    )
    assert len(seen) >= 3
    _check_reports(seen, summary.rows, summary.tokens)
    assert summary.tokens == TOKENS


def test_vllm_engine_reports_rows_and_tokens(tiny_ds, merged, tmp_path):
    seen: list[WorkProgress] = []
    storage = tmp_path / "storage"
    with VLLMHiddenStatesDouble(tiny_ds, layer_ids=vllm_layer_ids((1, 3, 4), 8), storage_path=storage) as srv:
        summary = vllm_shard(
            merged,
            shard_index=0,
            shard_size=8,
            out_dir=tmp_path / "eng",
            endpoints=[srv.url],
            storage_path=storage,
            num_layers=8,
            aux_layers=(1, 3, 4),
            hidden_size=64,
            progress=progress_reporter(seen.append, "shard 00000", every_s=0),
        )
    assert [p.done for p in seen] == list(range(1, len(ROWS) + 1))  # one report per row, in row order
    _check_reports(seen, summary.rows, TOKENS)
    lengths = [len(r["input_ids"]) for r in ROWS]
    assert [p.tokens_done for p in seen] == [sum(lengths[: i + 1]) for i in range(len(ROWS))]
