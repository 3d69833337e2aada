"""`hidden_states.quantize: fp8` in `layout: speculators`: each hs_{i} read back through a reader written from
speculators' FP8 contract, and through the project's readers, within e4m3's bound of the bf16 states of the same
extraction, per layer; the audit on the dequantized states; a changed setting refused or redone; kill -9 mid-shard."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle_pipeline.drafter_types import SPECULATORS
from eagle_pipeline.hidden_states.checks.audit import TeacherJudgement, audit_shard
from eagle_pipeline.hidden_states.checks.verify import verify_shard
from eagle_pipeline.hidden_states.layouts.trainer_exports import StatesExport
from eagle_pipeline.hidden_states.layouts.trainer_layouts import LAYOUTS, load_sample, plan_layout_target
from eagle_pipeline.hidden_states.run import extract_shard
from eagle_pipeline.hidden_states.store import fp8
from eagle_pipeline.hidden_states.store.format import shard_status
from eagle_pipeline.hidden_states.store.shards import ShardMismatchError
from eagle_pipeline_tests.doubles.speculators_fp8 import load_fp8_sample, trainer_inputs

from .conftest import greedy_rows, make_rows, write_merged

BF16 = torch.bfloat16
# The teacher-agreement figure of FP8 states may fall this far below bf16's on the same rows (e4m3 keeps 2^-4 of
# each value; the tiny target's greedy texts are decided by wide margins).
TEACHER_TOLERANCE = 0.05


def _extract(model, merged: Path, out: Path, hs: Path, quantize: str, *, shards: int = 2, **kw) -> None:
    target = plan_layout_target("speculators", out, merged, quantize=quantize)
    for shard in range(shards):
        extract_shard(
            model, merged, shard_index=shard, shard_size=4, out_dir=hs, dtype=BF16, layout_target=target, **kw
        )


@pytest.fixture(scope="module")
def both(normed_model, tmp_path_factory):
    """The same rows extracted twice into the speculators layout, bf16 and fp8 (tests that damage files copy)."""
    tmp = tmp_path_factory.mktemp("fp8_layout")
    rows = greedy_rows(normed_model, 8, seed=31, new_tokens=16)
    merged = write_merged(tmp / "merged", rows, [len(rows)])
    _extract(normed_model, merged, tmp / "bf16" / "sp", tmp / "bf16" / "hs", "none")
    _extract(normed_model, merged, tmp / "fp8" / "sp", tmp / "fp8" / "hs", "fp8")
    return rows, merged, tmp / "bf16", tmp / "fp8"


def test_fp8_hs_files_read_through_speculators_contract_within_e4m3_bound(both):
    rows, _merged, ref, got = both
    for i in range(len(rows)):
        name = f"hidden_states/hs_{i}.safetensors"
        want = load_file(ref / "sp" / name)
        raw = load_file(got / "sp" / name)
        assert set(raw) == {"hidden_states", "hidden_states_scales", "token_ids"}
        assert tuple(raw["hidden_states_scales"].shape) == (*raw["hidden_states"].shape[:2], 1)  # per token per layer
        sample = load_fp8_sample(got / "sp" / name)
        assert torch.equal(sample["token_ids"], want["token_ids"])
        assert want["hidden_states"].dtype == BF16
        for layer in range(want["hidden_states"].shape[1]):
            x = want["hidden_states"][:, layer]
            err = (sample["hidden_states"][:, layer].float() - x.float()).abs()
            bound = fp8.error_bound(x, raw["hidden_states_scales"][:, layer], BF16)
            assert bool((err <= bound).all()), (i, layer, float((err - bound).max()))
            assert float(err.max()) > 0  # really quantized, not a bf16 copy
        assert trainer_inputs(sample)["hidden_states"].shape[1] == 3 * want["hidden_states"].shape[2]
    fp8_bytes = sum(p.stat().st_size for p in (got / "sp" / "hidden_states").glob("hs_*.safetensors"))
    bf16_bytes = sum(p.stat().st_size for p in (ref / "sp" / "hidden_states").glob("hs_*.safetensors"))
    assert fp8_bytes < 0.6 * bf16_bytes


def test_fp8_through_the_project_readers_checks_and_audit(both):
    rows, merged, ref, got = both
    agreement = {}
    for name, root in (("bf16", ref), ("fp8", got)):
        for shard in range(2):
            assert shard_status(root / "hs", shard) == "done"
            assert all(r.passed for r in verify_shard(root / "hs", shard, merged).values())
            audit = audit_shard(root / "hs", shard, merged, expected_aux_layers=None, judgement=TeacherJudgement(True))
            assert all(r.passed for r in audit.values()), {n: r.detail for n, r in audit.items()}
            agreement[name, shard] = audit["teacher_agreement"].metrics["top1_agreement"]
    for shard in range(2):
        assert agreement["fp8", shard] >= agreement["bf16", shard] - TEACHER_TOLERANCE, agreement
    for r in rows:
        a, b = load_sample(got / "hs", r["sample_id"]), load_sample(ref / "hs", r["sample_id"])
        assert a["aux_hidden_states"].dtype == torch.float32  # dequantized by the reader
        assert torch.equal(a["input_ids"], b["input_ids"])
        for key in ("aux_hidden_states", "final_hidden_state"):
            err = (a[key] - b[key].float()).abs()
            assert bool((err <= fp8.E4M3_RELATIVE_ERROR * b[key].float().abs() + 1e-3).all()), key


def test_fp8_export_names_speculators_fp8_backend(both):
    _rows, merged, _ref, got = both
    s = LAYOUTS[SPECULATORS].export(StatesExport(got / "hs", merged, got / "sp"))
    assert s.bytes_written == 0 and s.extra["hidden_states_backend"] == "fp8"
    assert "--hidden-states-backend fp8" in s.extra["args"]
    saved = json.loads((got / "sp" / "export.json").read_text())
    assert saved["extra"]["capture"]["quantize"] == "fp8"
    command = saved["extra"]["drafters"][0]["command"]
    assert "--hidden-states-backend fp8" in command and "--hidden-states-path" not in command
    readme = (got / "sp" / "README.md").read_text()
    assert "--hidden-states-backend fp8" in readme and "float8_e4m3fn" in readme


def test_the_fp8_readme_states_the_shape_of_its_files_at_another_layer_count(normed_model, merged_factory, tmp_path):
    merged = merged_factory(make_rows(4, seed=33))
    out, hs = tmp_path / "sp", tmp_path / "hs"
    _extract(normed_model, merged, out, hs, "fp8", shards=1, aux_layers=2)
    LAYOUTS[SPECULATORS].export(StatesExport(hs, merged, out))
    raw = load_file(out / "hidden_states" / "hs_0.safetensors")
    assert raw["hidden_states"].shape[1] == raw["hidden_states_scales"].shape[1] == 3  # 2 aux layers + the final
    readme = (out / "README.md").read_text()
    assert "`hidden_states` [T, 3, H]" in readme and "`hidden_states_scales` fp32 [T, 3, 1]" in readme


def test_a_bad_scale_or_nan_byte_is_refused_naming_the_file(both, tmp_path):
    _rows, merged, _ref, fp8_root = both
    got = tmp_path / "fp8"
    shutil.copytree(fp8_root, got)
    target = plan_layout_target("speculators", got / "sp", merged)
    assert target is not None
    file_of = target.file_of
    sid = next(s for s, rel in file_of.items() if rel == "hidden_states/hs_0.safetensors")
    path = got / "sp" / "hidden_states" / "hs_0.safetensors"
    raw = load_file(path)
    for damage in ("scale", "nan"):
        bad = dict(raw)
        if damage == "scale":
            bad["hidden_states_scales"] = raw["hidden_states_scales"].clone()
            bad["hidden_states_scales"][0, 0, 0] = 0.0
        else:
            u8 = raw["hidden_states"].view(torch.uint8).clone()
            u8[0, 0, 0] = 0x7F  # e4m3fn's NaN
            bad["hidden_states"] = u8.view(torch.float8_e4m3fn)
        save_file(bad, path)
        match = "not finite and > 0" if damage == "scale" else "NaN values"
        with pytest.raises(ValueError, match=rf"sp/hidden_states/hs_0\.safetensors: .*{match}"):
            load_sample(got / "hs", sid)


def test_changing_quantize_makes_done_shards_stale_naming_the_setting(normed_model, merged_factory, tmp_path):
    rows = greedy_rows(normed_model, 4, seed=5)
    merged = merged_factory(rows)
    out, hs = tmp_path / "sp", tmp_path / "hs"
    _extract(normed_model, merged, out, hs, "fp8", shards=1)
    with pytest.raises(ShardMismatchError, match="quantize"):
        _extract(normed_model, merged, out, hs, "none", shards=1)
    _extract(normed_model, merged, out, hs, "none", shards=1, on_mismatch="redo")
    assert shard_status(hs, 0) == "done"
    assert load_file(out / "hidden_states" / "hs_0.safetensors")["hidden_states"].dtype == BF16
    assert (hs / "superseded").is_dir()


_CHILD = textwrap.dedent(
    """
    import os, signal, sys, torch
    from pathlib import Path
    from eagle_pipeline.hidden_states.run import extract_shard
    from eagle_pipeline.hidden_states.layouts.trainer_layouts import plan_layout_target
    from eagle_pipeline_tests.hidden_states.conftest import VOCAB, with_norm_weights
    from eagle_pipeline.hidden_states.models.model import build_tiny_model

    merged, out, hs, kill_at = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    model = with_norm_weights(build_tiny_model(VOCAB, family="deepseek_v3", seed=7))

    def progress(rows_done, rows_total, tokens_done, tokens_total):
        if kill_at and rows_done >= kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9 mid-shard: no cleanup of any kind

    target = plan_layout_target("speculators", out, merged, quantize="fp8")
    extract_shard(model, merged, shard_index=0, shard_size=8, out_dir=hs, dtype=torch.bfloat16,
                  max_tokens_per_batch=64, layout_target=target, progress=progress)
    """
)


def _run_child(merged: Path, out: Path, hs: Path, kill_at: int) -> int:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    args = [sys.executable, "-c", _CHILD, str(merged), str(out), str(hs), str(kill_at)]
    return subprocess.run(args, env=env, timeout=300).returncode


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_kill_9_mid_shard_with_fp8_gives_identical_bytes_after_the_rerun(normed_model, merged_factory, tmp_path):
    rows = greedy_rows(normed_model, 8, seed=41)
    merged = merged_factory(rows)
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    assert _run_child(merged, clean / "sp", clean / "hs", 0) == 0
    assert _run_child(merged, killed / "sp", killed / "hs", 3) == -signal.SIGKILL
    assert shard_status(killed / "hs", 0) != "done"
    written = list((killed / "sp" / "hidden_states").glob("hs_*.safetensors"))
    assert 0 < len(written) < len(rows)  # killed mid-shard: some samples' files written, not all
    assert _run_child(merged, killed / "sp", killed / "hs", 0) == 0
    assert shard_status(killed / "hs", 0) == "done"
    assert _tree(killed / "sp") == _tree(clean / "sp")
    a, b = _tree(killed / "hs"), _tree(clean / "hs")
    assert set(a) == set(b) and a["shard-00000.safetensors"] == b["shard-00000.safetensors"]
