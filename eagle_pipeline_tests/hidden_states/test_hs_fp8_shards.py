"""`hidden_states.quantize: fp8` in `layout: shards`: the shard file holds e4m3 states with fp32 scales per token per
layer; read back by hand from the file's own header, through the project's readers, checks and audit, and through
the speculators export (read as speculators' FP8 contract), each within e4m3's bound of the bf16 states of the same
extraction, per layer; SpecForge refused with its reason; a damaged scale or NaN byte refused naming the file and
sample; a changed setting refused or redone; kill -9 mid-shard."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from eagle_pipeline.drafter_types import SPECFORGE, SPECULATORS
from eagle_pipeline.hidden_states.checks.audit import TeacherJudgement, audit_shard
from eagle_pipeline.hidden_states.checks.verify import verify_shard
from eagle_pipeline.hidden_states.layouts.trainer_exports import StatesExport
from eagle_pipeline.hidden_states.layouts.trainer_layouts import LAYOUTS, load_sample
from eagle_pipeline.hidden_states.run import extract_shard
from eagle_pipeline.hidden_states.settings import HiddenStatesConfig
from eagle_pipeline.hidden_states.store import fp8
from eagle_pipeline.hidden_states.store.fingerprint import recorded_fingerprint
from eagle_pipeline.hidden_states.store.format import SCALES_NAME, shard_paths, shard_status, tensor_key
from eagle_pipeline.hidden_states.store.shards import ShardMismatchError
from eagle_pipeline_tests.doubles.speculators_fp8 import load_fp8_sample

from .conftest import greedy_rows, write_merged

BF16 = torch.bfloat16
N_AUX = 3  # the tiny target's default aux layers
# As in test_hs_fp8_layout: FP8's teacher agreement may fall this far below bf16's on the same rows.
TEACHER_TOLERANCE = 0.05


def _extract(model, merged: Path, hs: Path, quantize: str, *, shards: int = 2, **kw) -> None:
    for shard in range(shards):
        extract_shard(model, merged, shard_index=shard, shard_size=4, out_dir=hs, dtype=BF16, quantize=quantize, **kw)


@pytest.fixture(scope="module")
def both(normed_model, tmp_path_factory):
    """The same rows extracted twice into the project's shards, bf16 and fp8 (tests that damage files copy)."""
    tmp = tmp_path_factory.mktemp("fp8_shards")
    rows = greedy_rows(normed_model, 8, seed=31, new_tokens=16)
    merged = write_merged(tmp / "merged", rows, [len(rows)])
    _extract(normed_model, merged, tmp / "bf16", "none")
    _extract(normed_model, merged, tmp / "fp8", "fp8")
    return rows, merged, tmp / "bf16", tmp / "fp8"


def _layers(aux: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """[T, n_aux + 1, H] from a shard's aux [T, n_aux*H] and final [T, H]."""
    t, h = final.shape
    return torch.cat([aux.reshape(t, N_AUX, h), final.reshape(t, 1, h)], dim=1)


def test_fp8_shard_files_hold_e4m3_states_and_per_token_per_layer_scales_within_e4m3_bound(both):
    """Read with safetensors alone, as a trainer would from the file's own header: e4m3 aux and final, fp32 scales
    [T, n_aux + 1]; `stored * scale` per layer is within e4m3's bound of the bf16 extraction's states."""
    rows, _merged, ref, got = both
    fp8_bytes = bf16_bytes = checked = 0
    for shard in range(2):
        path, ref_path = shard_paths(got, shard)[0], shard_paths(ref, shard)[0]
        fp8_bytes, bf16_bytes = fp8_bytes + path.stat().st_size, bf16_bytes + ref_path.stat().st_size
        with safe_open(str(path), framework="pt") as f, safe_open(str(ref_path), framework="pt") as r:
            meta = f.metadata()
            assert meta["scale_granularity"] == fp8.PER_TOKEN_LAYER and meta["scales_tensor"] == "state_scales"
            assert meta["stored_dtype"] == "float8_e4m3fn" and meta["dtype"] == "bfloat16"  # before quantizing
            assert recorded_fingerprint(meta).quantize == "fp8"
            ids = {
                name: [k.removesuffix("/input_ids") for k in h.keys() if k.endswith("/input_ids")]  # noqa: SIM118 (a safe_open handle is no dict: not iterable)
                for name, h in (("ref", r), ("got", f))
            }
            sample_ids = ids["ref"]
            assert sorted(sample_ids) == sorted(ids["got"]) and sample_ids
            for sid in sample_ids:
                checked += 1
                want = _layers(*(r.get_tensor(tensor_key(sid, n)) for n in ("aux_hidden_states", "final_hidden_state")))
                aux, final = (f.get_tensor(tensor_key(sid, n)) for n in ("aux_hidden_states", "final_hidden_state"))
                scales = f.get_tensor(tensor_key(sid, SCALES_NAME))
                assert aux.dtype == final.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
                assert tuple(scales.shape) == (want.shape[0], N_AUX + 1)
                stored = _layers(aux, final).float() * scales.unsqueeze(-1)
                for layer in range(N_AUX + 1):
                    x = want[:, layer]
                    err = (stored[:, layer] - x.float()).abs()
                    bound = fp8.error_bound(x, scales[:, layer : layer + 1], torch.float32)
                    assert bool((err <= bound).all()), (sid, layer, float((err - bound).max()))
                    assert float(err.max()) > 0  # really quantized, not a bf16 copy
    assert fp8_bytes < 0.6 * bf16_bytes
    assert checked == len(rows)


def test_fp8_shards_through_the_project_readers_checks_and_audit(both):
    rows, merged, ref, got = both
    agreement = {}
    for name, root in (("bf16", ref), ("fp8", got)):
        for shard in range(2):
            assert shard_status(root, shard, check_hash=True) == "done"
            assert all(r.passed for r in verify_shard(root, shard, merged).values())
            audit = audit_shard(root, shard, merged, expected_aux_layers=None, judgement=TeacherJudgement(True))
            assert all(r.passed for r in audit.values()), {n: r.detail for n, r in audit.items()}
            agreement[name, shard] = audit["teacher_agreement"].metrics["top1_agreement"]
    for shard in range(2):
        assert agreement["fp8", shard] >= agreement["bf16", shard] - TEACHER_TOLERANCE, agreement
    for r in rows:
        a, b = load_sample(got, r["sample_id"]), load_sample(ref, r["sample_id"])
        assert a["aux_hidden_states"].dtype == torch.float32  # dequantized by the reader
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for key in ("aux_hidden_states", "final_hidden_state"):
            err = (a[key] - b[key].float()).abs()
            assert bool((err <= fp8.E4M3_RELATIVE_ERROR * b[key].float().abs() + 1e-3).all()), key


def test_the_speculators_export_of_fp8_shards_is_fp8_read_through_speculators_contract(both, tmp_path):
    rows, merged, ref, got = both
    out = tmp_path / "sp"
    s = LAYOUTS[SPECULATORS].export(StatesExport(got, merged, out))
    assert s.extra["hidden_states_backend"] == "fp8" and "--hidden-states-backend fp8" in s.extra["args"]
    assert "--hidden-states-backend fp8" in (out / "README.md").read_text()
    # each exported file against the bf16 shard of the same sample
    target = LAYOUTS[SPECULATORS].target(out, merged)
    assert len(target.file_of) == len(rows) == len(list((out / "hidden_states").glob("hs_*.safetensors")))
    for sid, rel in target.file_of.items():
        sample = load_fp8_sample(out / rel)
        want = load_sample(ref, sid)
        x = _layers(want["aux_hidden_states"], want["final_hidden_state"])
        with safe_open(str(out / rel), framework="pt") as f:
            scales = f.get_tensor("hidden_states_scales")
        assert tuple(scales.shape) == (x.shape[0], N_AUX + 1, 1)  # per token per layer, as the shards
        for layer in range(N_AUX + 1):
            # the shard's e4m3 values requantized by the export: one more rounding within the same bound of
            # the shard's own dequantized states, so twice the bound of the bf16 originals at most
            err = (sample["hidden_states"][:, layer].float() - x[:, layer].float()).abs()
            bound = 2 * fp8.error_bound(x[:, layer], scales[:, layer], BF16)
            assert bool((err <= bound).all()), (sid, layer)


def test_specforge_is_refused_beside_fp8_shards_with_its_reason(both, tmp_path):
    _rows, merged, _ref, got = both
    with pytest.raises(ValueError, match=r"fp8 states and specforge has no reader for them.*quantize: none"):
        LAYOUTS[SPECFORGE].export(StatesExport(got, merged, tmp_path / "sf"))
    problems = HiddenStatesConfig.rule_problems(
        {"quantize": "fp8", "layout": "shards", "trainer_layouts": ["specforge"]}
    )
    assert [where for where, _why in problems] == [("trainer_layouts",)]
    assert "specforge has no fp8 reader" in problems[0][1]
    assert HiddenStatesConfig.rule_problems({"quantize": "fp8", "layout": "shards"}) == []


def _tensor_span(path: Path, key: str) -> tuple[int, int]:
    """The byte range of tensor `key` in a safetensors file."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    begin, end = json.loads(raw[8 : 8 + n])[key]["data_offsets"]
    return 8 + n + begin, 8 + n + end


@pytest.mark.parametrize("damage", ["scale", "nan"])
def test_a_bad_scale_or_nan_byte_is_refused_naming_the_file_and_sample(damage, both, tmp_path):
    rows, _merged, _ref, got = both
    sid = rows[0]["sample_id"]
    hs = tmp_path / "hs"
    hs.mkdir()
    for p in got.iterdir():
        if p.is_file():
            (hs / p.name).write_bytes(p.read_bytes())
    path = shard_paths(hs, 0)[0]
    name = SCALES_NAME if damage == "scale" else "aux_hidden_states"
    begin, _end = _tensor_span(path, tensor_key(sid, name))
    raw = bytearray(path.read_bytes())
    raw[begin : begin + 4] = b"\x00\x00\x00\x00" if damage == "scale" else b"\x7f\x7f\x7f\x7f"  # 0x7F: e4m3fn's NaN
    path.write_bytes(bytes(raw))
    match = "not finite and > 0" if damage == "scale" else "NaN values"
    with pytest.raises(ValueError, match=rf"shard-00000\.safetensors sample '{sid}': .*{match}"):
        load_sample(hs, sid)


def test_changing_quantize_makes_done_shards_stale_naming_the_setting(normed_model, merged_factory, tmp_path):
    rows = greedy_rows(normed_model, 4, seed=5)
    merged = merged_factory(rows)
    _extract(normed_model, merged, tmp_path / "hs", "fp8", shards=1)
    with pytest.raises(ShardMismatchError, match="quantize"):
        _extract(normed_model, merged, tmp_path / "hs", "none", shards=1)
    _extract(normed_model, merged, tmp_path / "hs", "none", shards=1, on_mismatch="redo")
    assert shard_status(tmp_path / "hs", 0, check_hash=True) == "done"
    with safe_open(str(shard_paths(tmp_path / "hs", 0)[0]), framework="pt") as f:
        assert "quantize" not in f.metadata()
        assert f.get_tensor(tensor_key(rows[0]["sample_id"], "aux_hidden_states")).dtype == BF16
    assert (tmp_path / "hs" / "superseded").is_dir()


_CHILD = textwrap.dedent(
    """
    import os, signal, sys, torch
    from pathlib import Path
    from eagle_pipeline.hidden_states.run import extract_shard
    from eagle_pipeline_tests.hidden_states.conftest import VOCAB, with_norm_weights
    from eagle_pipeline.hidden_states.models.model import build_tiny_model

    merged, hs, kill_at = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    model = with_norm_weights(build_tiny_model(VOCAB, family="deepseek_v3", seed=7))

    def progress(rows_done, rows_total, tokens_done, tokens_total):
        if kill_at and rows_done >= kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9 mid-shard: no cleanup of any kind

    extract_shard(model, merged, shard_index=0, shard_size=8, out_dir=hs, dtype=torch.bfloat16,
                  max_tokens_per_batch=64, quantize="fp8", progress=progress)
    """
)


def _run_child(merged: Path, hs: Path, kill_at: int) -> int:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    args = [sys.executable, "-c", _CHILD, str(merged), str(hs), str(kill_at)]
    return subprocess.run(args, env=env, timeout=300).returncode


def test_kill_9_mid_shard_with_fp8_shards_gives_identical_bytes_after_the_rerun(normed_model, merged_factory, tmp_path):
    merged = merged_factory(greedy_rows(normed_model, 8, seed=41))
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    assert _run_child(merged, clean, 0) == 0
    assert _run_child(merged, killed, 3) == -signal.SIGKILL
    assert shard_status(killed, 0) != "done"
    assert _run_child(merged, killed, 0) == 0
    assert shard_status(killed, 0, check_hash=True) == "done"
    for name in ("shard-00000.safetensors", "target_head.safetensors"):
        assert (killed / name).read_bytes() == (clean / name).read_bytes(), name
    with safe_open(str(killed / "shard-00000.safetensors"), framework="pt") as f:
        assert recorded_fingerprint(f.metadata()).quantize == "fp8"
