"""scripts/gpu_check.py's CPU smoke mode runs end to end and verifies what it wrote."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
