"""Every file the pipeline writes has the mode any other writer's file gets under the umask (0666 less the umask):
trainers and audits often read the data root as another user on shared storage."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import write_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _demo_under_umask(tmp_path: Path, umask: int) -> Path:
    """`make demo`'s run (eagle_pipeline.demo: every job of the graph) on a small configuration, in a process whose
    umask is `umask`; returns its data root."""
    path = write_config(tmp_path, datasets=("B1", "B6"), limit=4)
    raw = yaml.safe_load(path.read_text())
    raw["generation"]["budget_usd"] = 100.0  # the shared spend ledger writes its files too
    raw["target"]["tokenizer"] = "demo"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    env = {**os.environ, "EAGLE_PIPELINE_CONFIG": str(path)}
    env.pop("DAGSTER_HOME", None)
    proc = subprocess.run(
        [sys.executable, "-m", "eagle_pipeline.demo"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        preexec_fn=lambda: os.umask(umask),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp_path / "data"


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_every_file_of_a_demo_run_respects_the_umask(tmp_path, umask):
    root = _demo_under_umask(tmp_path, umask)
    wanted = 0o666 & ~umask
    files = [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
    names = {p.name for p in files}
    # What the walk must cover: every stage's outputs, the files written by safetensors and torch, the locks and
    # the spend ledger.
    for expected in ("target_head.safetensors", "shard-00000.safetensors", "draft_vocab.pt", "manifest.json"):
        assert expected in names, expected
    assert any(p.suffix == ".parquet" and "responses" in p.parts for p in files)
    assert (root / "responses" / ".spend" / "ledger").is_file()
    wrong = {str(p.relative_to(root)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    wrong = {k: v for k, v in wrong.items() if int(v, 8) != wanted}
    assert wrong == {}, f"files not {oct(wanted)} under umask {oct(umask)}: {wrong}"
