"""A wheel built from the repository ships the package (not the tests) and the embedded default configuration, and
loads the Dagster code location from a fresh virtual environment, outside the repository, with no configuration set."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

LOAD = """
import json, eagle_pipeline
from eagle_pipeline.definitions import defs
from eagle_pipeline.defs.partitions import dataset_partitions
from eagle_pipeline.config import load_config
from eagle_pipeline.tokens.demo import build_demo_tokenizer
defs.resolve_all_job_defs()
print(json.dumps({"module": eagle_pipeline.__file__, "demo_ids": build_demo_tokenizer().encode_with_specials("The answer, step by step: def main(): return 42"), "datasets": dataset_partitions.get_partition_keys(),
                  "prompts": str(load_config().datasets["B1"].prompts), "assets": sorted(k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys())}))
"""


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert result.returncode == 0, f"{cmd}: {result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


def test_wheel_ships_no_tests_and_loads_the_code_location_from_a_fresh_venv(tmp_path):
    import json

    # Build from a copy of the tree, so the build's own folders (build/, *.egg-info) never land in the checkout.
    src = tmp_path / "src"
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(".git", ".venv", ".eagle-data", "build", "*.egg-info", "__pycache__", "dist"),
    )
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src)])
    [wheel] = list(dist.glob("eagle_pipeline-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith("eagle_pipeline_tests")]
    assert "eagle_pipeline/defs/partitions.py" in names
    # The simulated servers the configuration can name ship (the demo runs from a wheel); the tests' doubles do not.
    assert "eagle_pipeline/simulation/openrouter.py" in names
    assert "eagle_pipeline/simulation/vllm_hidden_states.py" in names
    assert "eagle_pipeline/tokens/demo_words.txt" in names  # the demo tokenizer's corpus, package data
    data = [n.split(".data/data/", 1)[1] for n in names if ".data/data/" in n]
    assert "share/eagle-pipeline/pipeline.yaml" in data
    assert "share/eagle-pipeline/data/prompts/B1_coding.jsonl" in data

    # A fresh venv that sees this environment's dependencies (no downloads) but not its editable eagle_pipeline.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)])
    py = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q", str(wheel)])
    # Only after the install, so pip never sees (or touches) this environment's own eagle_pipeline.
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "EAGLE_PIPELINE_CONFIG", "EAGLE_DATA_ROOT")}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    loaded = json.loads(_run([str(py), "-c", LOAD], cwd=elsewhere, env=env).stdout.strip().splitlines()[-1])
    assert Path(loaded["module"]).is_relative_to(venv)
    from eagle_pipeline.tokens.demo import build_demo_tokenizer

    # The demo tokenizer built from the wheel's own corpus words encodes exactly as the source tree's.
    assert loaded["demo_ids"] == build_demo_tokenizer().encode_with_specials(
        "The answer, step by step: def main(): return 42"
    )
    assert loaded["datasets"] == [f"B{i}" for i in range(1, 9)]
    assert Path(loaded["prompts"]).is_relative_to(venv) and Path(loaded["prompts"]).is_file()
    # The wheel's code location holds exactly the assets of the source tree's.
    from eagle_pipeline.definitions import defs

    assert loaded["assets"] == sorted(k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys())
    assert "token_samples" in loaded["assets"] and "audit_overview" in loaded["assets"]
