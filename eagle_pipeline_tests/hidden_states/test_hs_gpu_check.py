"""scripts/gpu_check.py's CPU smoke mode runs end to end through each engine (in process, a torchrun gloo world,
the vLLM engine client against the double) and verifies what it wrote."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from eagle_pipeline.hidden_states.store.format import read_index_meta, shard_paths

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_tiny_smoke(tmp_path, capsys):
    rc = _load().main(["--cpu", "--tiny", "--samples", "12", "--workdir", str(tmp_path), "--keep"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "verification: all shards passed" in out and "tok/s" in out and "bf16 peak" in out
    assert sorted(p.name for p in (tmp_path / "hidden_states").glob("shard-*.safetensors")) == [
        "shard-00000.safetensors",
        "shard-00001.safetensors",
        "shard-00002.safetensors",
    ]


def test_deadline_guard_stops_cleanly(tmp_path, capsys):
    rc = _load().main(["--cpu", "--tiny", "--samples", "12", "--workdir", str(tmp_path), "--max-seconds", "0"])
    assert rc == 3
    assert "--max-seconds" in capsys.readouterr().out
    assert not list((tmp_path / "hidden_states").glob("*"))  # the aborted shard left no file behind


@pytest.mark.parametrize("engine", ["torchrun", "vllm"])
def test_cpu_tiny_smoke_through_each_engine(engine, tmp_path, capsys):
    if engine == "torchrun":
        pytest.importorskip("accelerate")  # transformers' tensor parallelism needs it (a dev dependency)
    argv = ["--cpu", "--tiny", "--samples", "12", "--workdir", str(tmp_path), "--keep", "--engine", engine]
    rc = _load().main(argv)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"ENGINE {engine}" in out and f"RESULT ({engine})" in out and "ENGINE in_process" not in out
    assert "verification: all shards passed" in out and "tok/s" in out and "bf16 peak" in out
    if engine == "torchrun":
        assert "a torchrun world of 2 (gloo)" in out and "2 x 989 TFLOP/s" in out
    shards = sorted(p.name for p in (tmp_path / f"hidden_states_{engine}").glob("shard-*.safetensors"))
    assert shards == [f"shard-{k:05d}.safetensors" for k in range(3)]
    fingerprint = read_index_meta(shard_paths(tmp_path / f"hidden_states_{engine}", 0)[1])["fingerprint"]
    assert fingerprint["engine"] == engine


def test_auto_runs_the_in_process_path_alone_without_several_gpus():
    mod = _load()
    assert mod.resolve_engines("auto", "cpu") == ["in_process"]
    assert mod.resolve_engines("torchrun", "cpu") == ["torchrun"]
