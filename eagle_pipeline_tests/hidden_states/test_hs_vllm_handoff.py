"""vllm_handoff: a connector file validated and hashed in one read, then renamed (or copied once) to hs_{i}."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle_pipeline.generation.failures import RequestFailure
from eagle_pipeline.hidden_states.vllm_files import clean_journal, validate_states_file
from eagle_pipeline.hidden_states.vllm_handoff import COPIED, RENAMED, hand_off, read_validated

LAYER_IDS = (2, 4, 6, 8)
H = 16


def _connector_file(path: Path, ids: list[int], seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    g = torch.Generator().manual_seed(seed)
    hs = (torch.randn(len(ids), len(LAYER_IDS), H, generator=g) * 3).to(dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"hidden_states": hs, "token_ids": torch.tensor(ids, dtype=torch.int64)}, str(path))
    Path(f"{path}.lock").touch()  # the connector's lock file, released
    return path


def _inode_count(root: Path) -> dict[tuple[int, int], list[Path]]:
    seen: dict[tuple[int, int], list[Path]] = {}
    for p in root.rglob("*"):
        if p.is_file():
            st = p.stat()
            seen.setdefault((st.st_dev, st.st_ino), []).append(p)
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_one_read_gives_the_same_verdicts_and_the_file_hash(dtype, tmp_path):
    ids = list(range(5, 17))
    src = _connector_file(tmp_path / "req.safetensors", ids, dtype=dtype)
    handed, buf = read_validated(src, ids, LAYER_IDS, hidden_size=H)
    assert handed.facts == validate_states_file(src, ids, LAYER_IDS, hidden_size=H)
    assert handed.size == src.stat().st_size == len(buf)
    buf.close()  # no tensor still views it
    assert handed.sha256 == hashlib.sha256(src.read_bytes()).hexdigest()

    states = load_file(str(src))["hidden_states"]
    cases = {
        "NaN/Inf": states.clone().index_put_(
            (torch.tensor(3), torch.tensor(1), torch.tensor(2)), torch.tensor(float("nan"), dtype=dtype)
        ),
        "all-zero": states.clone().index_fill_(0, torch.tensor([4]), 0.0),
    }
    for message, bad in cases.items():
        save_file({"hidden_states": bad, "token_ids": torch.tensor(ids)}, str(src))
        with pytest.raises(RequestFailure, match=message):
            read_validated(src, ids, LAYER_IDS, hidden_size=H)
    save_file({"hidden_states": states, "token_ids": torch.tensor(ids)}, str(src))
    with pytest.raises(RequestFailure, match="token_ids in the file differ"):
        read_validated(src, [*ids[:-1], 99], LAYER_IDS, hidden_size=H)
    with pytest.raises(RequestFailure, match="hidden size 16, expected 32"):
        read_validated(src, ids, LAYER_IDS, hidden_size=32)
    with pytest.raises(RequestFailure, match="final id 8 is missing"):
        read_validated(src, ids, (*LAYER_IDS[:3], 7, 8), hidden_size=H)
    save_file({"hidden_states": states, "token_ids": torch.tensor(ids, dtype=torch.int32)}, str(src))
    with pytest.raises(RequestFailure, match="int32, speculators reads int64"):
        read_validated(src, ids, LAYER_IDS, hidden_size=H)
    src.write_bytes(src.read_bytes()[:-40])  # truncated: offsets run past the end
    with pytest.raises(RequestFailure, match=f"{src}: not a safetensors file"):
        read_validated(src, ids, LAYER_IDS, hidden_size=H)


def test_on_one_filesystem_the_file_is_renamed_not_copied(tmp_path):
    ids = list(range(3, 40))
    src = _connector_file(tmp_path / "connector" / "req-a.safetensors", ids)
    st = src.stat()
    before = src.read_bytes()
    dst = tmp_path / "exports" / "speculators" / "hidden_states" / "hs_0.safetensors"
    handed = hand_off(src, dst, ids, LAYER_IDS, hidden_size=H)
    assert handed.how == RENAMED
    assert (dst.stat().st_ino, dst.stat().st_dev) == (st.st_ino, st.st_dev)  # the same inode: no second copy
    assert not src.exists() and not Path(f"{src}.lock").exists()
    assert dst.read_bytes() == before and handed.sha256 == hashlib.sha256(before).hexdigest()
    assert all(len(paths) == 1 for paths in _inode_count(tmp_path).values())
    # read back as speculators' loader reads hs_{i}: hidden_states [T, 4, H] and token_ids [T]
    t = load_file(str(dst))
    assert t["hidden_states"].shape == (len(ids), 4, H) and t["token_ids"].tolist() == ids


def test_an_invalid_file_is_never_placed(tmp_path):
    ids = list(range(3, 12))
    src = _connector_file(tmp_path / "c" / "req.safetensors", ids)
    dst = tmp_path / "e" / "hs_0.safetensors"
    with pytest.raises(RequestFailure, match="differ from the ids sent"):
        hand_off(src, dst, [*ids[:-1], 1], LAYER_IDS, hidden_size=H)
    assert src.exists() and not dst.exists()


def test_across_filesystems_one_copy_then_the_connector_file_goes(tmp_path):
    other = Path("/dev/shm")
    if not other.is_dir() or other.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second filesystem (/dev/shm) here")
    ids = list(range(3, 30))
    src = _connector_file(tmp_path / "req.safetensors", ids)
    before = src.read_bytes()
    out = other / f"eagle-handoff-{os.getpid()}"
    try:
        dst = out / "hidden_states" / "hs_3.safetensors"
        handed = hand_off(src, dst, ids, LAYER_IDS, hidden_size=H)
        assert handed.how == COPIED and dst.read_bytes() == before and not src.exists()
        assert [p.name for p in dst.parent.iterdir()] == ["hs_3.safetensors"]  # no temporary left
    finally:
        import shutil

        shutil.rmtree(out, ignore_errors=True)


_CHILD = """
import os, signal, sys
from pathlib import Path
from eagle_pipeline.hidden_states.vllm_handoff import hand_off, place_file, read_validated
src, dst, ids = Path(sys.argv[1]), Path(sys.argv[2]), list(range(3, 40))
layer_ids = (2, 4, 6, 8)
if sys.argv[3] == "after-validation":
    read_validated(src, ids, layer_ids, hidden_size=16)
    os.kill(os.getpid(), signal.SIGKILL)  # the process dies between the validation and the rename
hand_off(src, dst, ids, layer_ids, hidden_size=16)
if sys.argv[3] == "after-rename":
    os.kill(os.getpid(), signal.SIGKILL)  # dies before any shard index vouches for hs_i
"""


@pytest.mark.parametrize("when", ["after-validation", "after-rename"])
def test_kill_9_around_the_rename_leaves_a_state_the_rerun_completes_with_identical_bytes(when, tmp_path):
    ids = list(range(3, 40))
    conn, dst = tmp_path / "connector", tmp_path / "exports" / "hidden_states" / "hs_0.safetensors"
    src = _connector_file(conn / "req-0.safetensors", ids, seed=7)
    expected = src.read_bytes()
    journal = tmp_path / ".shard-00000.vllm-requests"
    journal.write_text(f"{src}\n")
    child = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(dst), when], capture_output=True, text=True)
    assert child.returncode == -signal.SIGKILL, child.stderr
    if when == "after-validation":  # nothing placed; the connector file is still there for the journal to clean
        assert src.exists() and not dst.exists()
    else:  # the whole file is in place, never a partial one
        assert dst.read_bytes() == expected and not src.exists()
    # the rerun: the shard's request journal (which listed the file before the kill) is cleaned, then the server
    # answers the same request again
    clean_journal(journal)
    src = _connector_file(conn / "req-0-retry.safetensors", ids, seed=7)
    handed = hand_off(src, dst, ids, LAYER_IDS, hidden_size=H)
    assert dst.read_bytes() == expected and handed.sha256 == hashlib.sha256(expected).hexdigest()
    assert sorted(p.name for p in dst.parent.iterdir()) == ["hs_0.safetensors"]
    assert list(conn.iterdir()) == []
