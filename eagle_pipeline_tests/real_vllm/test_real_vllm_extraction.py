"""`engine: vllm` against a real vLLM 0.32 (CPU build) started from `eagle-pipeline vllm-command`'s output: the
server passes `vllm-smoke`, and a shard extracted through the project's own engine path (config → HTTP → connector
files → shard) equals the in-process extraction of the same checkpoint."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle_pipeline.cli import main
from eagle_pipeline.config import load_config
from eagle_pipeline.hidden_states import extract_shard, shard_status, verify_shard
from eagle_pipeline.hidden_states.engine import ExtractionPaths
from eagle_pipeline.hidden_states.format import read_index_meta
from eagle_pipeline.hidden_states.run import run_shard
from eagle_pipeline_tests.hidden_states.conftest import make_rows, write_merged

from ..tolerances import assert_forwards_close
from .server import VOCAB

pytestmark = pytest.mark.real_vllm


def _files(d: Path) -> set[Path]:
    """The connector files under `d` (other tests' generation requests leave theirs: the server writes one per
    request, and only the extraction client deletes them)."""
    return set(d.iterdir()) if d.exists() else set()


def test_vllm_smoke_passes_against_the_real_server(real_vllm, capsys):
    before = _files(real_vllm.storage)
    assert main(["vllm-smoke", "--config", str(real_vllm.config)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.startswith(f"OK {real_vllm.url}: hidden_states [64, 4, 64] torch.float32")
    assert _files(real_vllm.storage) <= before  # the smoke request's file and lock deleted


def test_engine_shard_equals_in_process_extraction(real_vllm, tmp_path):
    from transformers import AutoModelForCausalLM

    rows = make_rows(12, seed=11, min_len=2, max_len=120)
    merged = write_merged(tmp_path / "merged", rows, [5, 7])
    before = _files(real_vllm.storage)
    h = load_config(real_vllm.config).hidden_states
    h = dataclasses.replace(h, shard_size=len(rows))
    paths = ExtractionPaths(merged, tmp_path / "eng", tmp_path / "exports")
    run = run_shard(h, paths, 0, vocab_size=VOCAB)  # the core call the Dagster asset makes, engine from the config
    s = run.summary
    assert run.device == f"vllm: {real_vllm.url}" and s.rows == len(rows) and not s.skipped
    assert shard_status(tmp_path / "eng", 0) == "done" and not s.final_state_is_post_norm
    assert all(r.passed for r in verify_shard(tmp_path / "eng", 0, merged).values())
    assert _files(real_vllm.storage) <= before  # per-request files and locks deleted after the copy

    model = AutoModelForCausalLM.from_pretrained(real_vllm.model_dir, dtype=torch.float32).eval()
    ref = extract_shard(
        model, merged, shard_index=0, shard_size=len(rows), out_dir=tmp_path / "inp", final_state="pre_norm"
    )
    eng, inp = load_file(s.path), load_file(ref.path)
    assert eng.keys() == inp.keys() and {k.split("/")[0] for k in inp} == {r["sample_id"] for r in rows}
    worst = 0.0
    for key, want in inp.items():
        if want.is_floating_point():
            # fp32 both sides, other kernels (vLLM's CPU attention, fused norms): the summation-order bound
            assert_forwards_close(eng[key], want, model.config, what=key)
            worst = max(worst, float((eng[key] - want).abs().max()))
        else:
            assert torch.equal(eng[key], want), key
    print(f"\nreal vLLM vs in process: max |diff| {worst:.2e} over {len(rows)} samples")
    assert worst < 1e-5  # what docs/hidden_states.md states for Llama in fp32
    meta = read_index_meta(s.index_path)
    assert meta["engine"] == "vllm" and meta["vllm_layer_ids"] == [2, 4, 5, 8]


def test_printed_command_starts_without_warnings_about_its_flags(real_vllm):
    """Issue 25, gaps 3 and 4: the printed environment holds no variable vLLM 0.32 does not know, and the printed
    flags leave chunked prefill on (disabling it made 0.32 warn that the engine may crash or compute wrong outputs)."""
    log = real_vllm.log.read_text(errors="replace")
    assert "Application startup complete" in log  # the log is the server's own
    assert "does not officially support disabling chunked prefill" not in log
    assert "Unknown vLLM environment variable" not in log
