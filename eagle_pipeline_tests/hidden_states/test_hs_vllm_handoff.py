"""vllm_handoff: a connector file validated and hashed in one read (`vllm_files.validate_states_file`, the one
validator), then renamed (or copied once) to hs_{i}."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file, save_file

from eagle_pipeline.hidden_states.engines.vllm.vllm_files import clean_journal, validate_states_file
from eagle_pipeline.hidden_states.engines.vllm.vllm_handoff import COPIED, RENAMED, hand_off
from eagle_pipeline.hidden_states.store import fp8
from eagle_pipeline.shared.failures import RequestFailure

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
    handed = validate_states_file(src, ids, LAYER_IDS, hidden_size=H, digest=True)
    plain = validate_states_file(src, ids, LAYER_IDS, hidden_size=H)
    assert handed.facts == plain.facts and plain.digest is None
    assert handed.size == src.stat().st_size == len(handed.buf)
    assert torch.equal(handed.states, load_file(str(src))["hidden_states"])  # views of the one mapping
    # the checks' reduction is each state vector's amax, exactly: FP8 quantization takes its scales from it
    assert torch.equal(handed.amax, handed.states.abs().amax(-1).float())
    assert torch.equal(fp8.scales_from_amax(handed.amax.unsqueeze(-1)), fp8.scales_for(handed.states))
    handed.close()  # no tensor still views it
    plain.close()
    assert handed.digest == xxhash.xxh3_128_hexdigest(src.read_bytes())

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
            validate_states_file(src, ids, LAYER_IDS, hidden_size=H)
    save_file({"hidden_states": states, "token_ids": torch.tensor(ids)}, str(src))
    with pytest.raises(RequestFailure, match="token_ids in the file differ"):
        validate_states_file(src, [*ids[:-1], 99], LAYER_IDS, hidden_size=H)
    with pytest.raises(RequestFailure, match="hidden size 16, expected 32"):
        validate_states_file(src, ids, LAYER_IDS, hidden_size=32)
    with pytest.raises(RequestFailure, match="final id 8 is missing"):
        validate_states_file(src, ids, (*LAYER_IDS[:3], 7, 8), hidden_size=H)
    save_file({"hidden_states": states, "token_ids": torch.tensor(ids, dtype=torch.int32)}, str(src))
    with pytest.raises(RequestFailure, match="int32, speculators reads int64"):
        validate_states_file(src, ids, LAYER_IDS, hidden_size=H)
    src.write_bytes(src.read_bytes()[:-40])  # truncated: offsets run past the end
    with pytest.raises(RequestFailure, match=f"{src}: not a safetensors file") as short:
        validate_states_file(src, ids, LAYER_IDS, hidden_size=H)
    assert short.value.retryable  # a file still being written (or torn) is asked for again
    src.write_bytes(b"\x10" + bytes(7) + b'{"x": 1}' + bytes(8))  # a header that is no safetensors header
    with pytest.raises(RequestFailure, match=f"{src}: not a safetensors file") as malformed:
        validate_states_file(src, ids, LAYER_IDS, hidden_size=H)
    assert not malformed.value.retryable
    # what speculators' FP8HiddenStatesConnector writes (e4m3 states, per-token scales [T, 1, 1]) is refused, naming
    # the connector this client quantizes after
    q = fp8.quantize(states.float(), fp8.PER_TOKEN)
    save_file({**q.tensors(), "token_ids": torch.tensor(ids)}, str(src))
    with pytest.raises(RequestFailure, match="float8_e4m3fn: the server runs speculators' FP8HiddenStatesConnector"):
        validate_states_file(src, ids, LAYER_IDS, hidden_size=H)


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
    assert dst.read_bytes() == before and handed.digest == xxhash.xxh3_128_hexdigest(before)
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
from eagle_pipeline.hidden_states.engines.vllm.vllm_files import validate_states_file
from eagle_pipeline.hidden_states.engines.vllm.vllm_handoff import hand_off
src, dst, ids = Path(sys.argv[1]), Path(sys.argv[2]), list(range(3, 40))
layer_ids = (2, 4, 6, 8)
if sys.argv[3] == "after-validation":
    validate_states_file(src, ids, layer_ids, hidden_size=16)
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
    assert dst.read_bytes() == expected and handed.digest == xxhash.xxh3_128_hexdigest(expected)
    assert sorted(p.name for p in dst.parent.iterdir()) == ["hs_0.safetensors"]
    assert list(conn.iterdir()) == []


@pytest.mark.parametrize("layout", ["speculators", "specforge"])
def test_a_vllm_shard_run_writes_the_trainer_files_once(layout, normed_model, merged_factory, tmp_path):
    """The request workers validate with the layout's own reader and the writer places each row: the trainer's files
    hold what an in-process extraction into that layout holds (read back as the trainers read them), the connector
    storage ends empty, and no file of the states exists twice (inode walk)."""
    import io

    from eagle_pipeline.generation.run.runner import run_coroutine
    from eagle_pipeline.hidden_states.engines.vllm.vllm_files import vllm_layer_ids
    from eagle_pipeline.hidden_states.engines.vllm.vllm_layouts import VllmLayoutRows
    from eagle_pipeline.hidden_states.engines.vllm.vllm_requests import ShardRequests
    from eagle_pipeline.hidden_states.layouts.trainer_layouts import layout_of, plan_layout_target
    from eagle_pipeline.hidden_states.models.layers import default_aux_layers
    from eagle_pipeline.hidden_states.run import extract_shard
    from eagle_pipeline.hidden_states.store.head import TargetHead
    from eagle_pipeline.hidden_states.store.merged import read_rows
    from eagle_pipeline.simulation.vllm_hidden_states import VLLMHiddenStatesDouble

    from ..tolerances import assert_forwards_close
    from .conftest import make_rows

    cfg = normed_model.config
    n_layers = cfg.num_hidden_layers
    aux = default_aux_layers(n_layers)
    merged = merged_factory(make_rows(6, seed=3, min_len=3, max_len=30))
    rows = read_rows(merged, 0, 6)
    ref_root = tmp_path / "ref-exports" / layout
    extract_shard(
        normed_model,
        merged,
        shard_index=0,
        shard_size=6,
        out_dir=tmp_path / "ref-hs",
        aux_layers=aux,
        final_state=layout_of(layout).final_state,
        layout_target=plan_layout_target(layout, ref_root, merged),
    )
    data = tmp_path / "data"
    (data / "hidden_states").mkdir(parents=True)  # the shards' folder, where the engine runs from
    target = plan_layout_target(layout, data / "exports" / layout, merged)
    norm = normed_model.model.norm
    head = TargetHead(norm.weight.detach().clone(), float(norm.variance_epsilon), torch.empty(0), {})
    placed = VllmLayoutRows(
        target, data / "hidden_states", dict(zip(rows.sample_ids, rows.loss_mask)), len(aux), final_norm=head.final_norm
    )
    storage = data / "connector"
    layer_ids = vllm_layer_ids(aux, n_layers)
    with VLLMHiddenStatesDouble(normed_model, layer_ids=layer_ids, storage_path=storage) as srv:
        run = ShardRequests(
            rows,
            shard_index=0,
            endpoints=[srv.url],
            storage_path=storage,
            layer_ids=layer_ids,
            hidden_size=cfg.hidden_size,
            concurrency=2,
            timeout_s=10.0,
            max_retries=0,
            backoff_base_s=0.01,
            journal=io.StringIO(),
            write_row=lambda i, file: placed.place(
                rows.sample_ids[i], file, torch.from_numpy(rows.input_ids[i]).to(torch.int64)
            ),
            log=None,
            progress=None,
            validate=placed.validate,
        )
        run_coroutine(run.run)
    placed.close()
    assert sorted(p.name for p in storage.iterdir()) == []  # every connector file renamed, copied or deleted
    assert sorted(f["sample_id"] for f in placed.files) == sorted(rows.sample_ids)
    for f in placed.files:  # the integrity record is the file's
        p = data / "hidden_states" / f["path"]
        assert (p.stat().st_size, xxhash.xxh3_128_hexdigest(p.read_bytes())) == (f["size"], f["xxh3_128"])
    assert all(len(paths) == 1 for paths in _inode_count(tmp_path).values())
    for sid, rel in target.file_of.items():
        got_path, want_path = target.root / rel, ref_root / rel
        if layout == "speculators":  # speculators reads hidden_states [T, 4, H] and token_ids [T] int64
            got, want = load_file(str(got_path)), load_file(str(want_path))
            assert got["token_ids"].dtype == torch.int64 and torch.equal(got["token_ids"], want["token_ids"])
            assert got["hidden_states"].shape == want["hidden_states"].shape
            assert_forwards_close(got["hidden_states"], want["hidden_states"], cfg, what=f"{sid} hidden_states")
        else:  # SpecForge's torch.load record: aux [1, T, 3H], hidden_state post-norm [1, T, H], ids and mask int64
            got, want = (torch.load(p, weights_only=True) for p in (got_path, want_path))
            assert got.keys() == want.keys()
            for key in ("input_ids", "loss_mask"):
                assert got[key].dtype == torch.int64 and torch.equal(got[key], want[key])
            for key in ("aux_hidden_state", "hidden_state"):
                assert got[key].shape == want[key].shape
                assert_forwards_close(got[key], want[key], cfg, what=f"{sid} {key}")


@pytest.mark.parametrize("layout", ["speculators", "specforge"])
def test_the_vllm_engine_writes_a_trainer_layout_and_every_check_reads_it(
    layout, normed_model, merged_factory, tmp_path
):
    """A vLLM shard run with a layout target: the shard is done with ids and masks only, shard_status checks the
    trainer files' sizes and digests, verify_shard reads them (open_shard), and the states equal in-process
    extraction's; a rerun reuses the shard; no state file exists twice."""
    from eagle_pipeline.hidden_states.checks.verify import verify_shard
    from eagle_pipeline.hidden_states.engines.vllm.vllm_files import vllm_layer_ids
    from eagle_pipeline.hidden_states.layouts.trainer_layouts import layout_of, load_sample, plan_layout_target
    from eagle_pipeline.hidden_states.models.layers import default_aux_layers
    from eagle_pipeline.hidden_states.run import extract_shard
    from eagle_pipeline.hidden_states.store.format import shard_status
    from eagle_pipeline.simulation.vllm_hidden_states import VLLMHiddenStatesDouble

    from ..tolerances import assert_forwards_close
    from .conftest import make_rows

    cfg = normed_model.config
    n_layers, aux = cfg.num_hidden_layers, default_aux_layers(cfg.num_hidden_layers)
    merged = merged_factory(make_rows(6, seed=4, min_len=3, max_len=30))
    ref = tmp_path / "ref-hs"
    extract_shard(
        normed_model,
        merged,
        shard_index=0,
        shard_size=6,
        out_dir=ref,
        aux_layers=aux,
        final_state=layout_of(layout).final_state,
        layout_target=plan_layout_target(layout, tmp_path / "ref-exports" / layout, merged),
    )
    ckpt = tmp_path / "ckpt"
    normed_model.save_pretrained(ckpt)
    hs, storage = tmp_path / "data" / "hidden_states", tmp_path / "data" / "connector"
    target = plan_layout_target(layout, tmp_path / "data" / "exports" / layout, merged)

    def run(url):
        return _vllm_shard(merged, hs, storage, url, target, n_layers, aux, cfg.hidden_size, head_checkpoint=ckpt)

    with VLLMHiddenStatesDouble(normed_model, layer_ids=vllm_layer_ids(aux, n_layers), storage_path=storage) as srv:
        s = run(srv.url)
        assert srv.total_requests == 6
        again = run(srv.url)  # done under the same fingerprint: reused, no request
        assert srv.total_requests == 6 and again.sha256 == s.sha256
    assert s.fingerprint["layout"] == layout and s.fingerprint["final_state"] == layout_of(layout).final_state
    assert shard_status(hs, 0, check_hash=True) == "done"
    assert all(r.passed for r in verify_shard(hs, 0, merged).values())
    assert list(storage.iterdir()) == []
    assert sum(p.stat().st_size for p in hs.glob("shard-*.safetensors")) < 6 * 30 * 5 + 4096  # ids and masks only
    assert all(len(paths) == 1 for paths in _inode_count(tmp_path).values())
    for sid in target.file_of:
        got, want = load_sample(hs, sid), load_sample(ref, sid)
        for key, w in want.items():
            if w.is_floating_point():
                assert_forwards_close(got[key], w, cfg, what=f"{sid} {key}")
            else:
                assert torch.equal(got[key], w), key
    victim = target.root / target.file_of[next(iter(target.file_of))]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte changed, its size kept: only the recorded digest disagrees
    victim.write_bytes(bytes(data))
    assert shard_status(hs, 0, check_hash=True) == "partial"


def _vllm_shard(merged, out, storage, url, target, n_layers, aux, hidden, **kw):
    """Shard 0 (all rows) of `merged` through the vLLM engine at `url`, its states in `target`'s layout."""
    from eagle_pipeline_tests.hidden_states.engine_runs import vllm_shard

    return vllm_shard(
        merged,
        shard_index=0,
        shard_size=8,
        out_dir=out,
        endpoints=[url],
        storage_path=storage,
        num_layers=n_layers,
        aux_layers=aux,
        hidden_size=hidden,
        timeout_s=30.0,
        backoff_base_s=0.01,
        layout_target=target,
        **kw,
    )


_ENGINE_CHILD = """
import sys
from eagle_pipeline_tests.hidden_states.engine_runs import vllm_shard
from eagle_pipeline.hidden_states.layouts.trainer_layouts import plan_layout_target
merged, out, url, storage, exports, layout, ckpt, quantize = sys.argv[1:9]
vllm_shard(merged, shard_index=0, shard_size=8, out_dir=out, endpoints=[url], storage_path=storage,
           num_layers=8, aux_layers=(1, 3, 4), hidden_size=64, concurrency=1, head_checkpoint=ckpt,
           layout_target=plan_layout_target(layout, exports, merged, quantize=quantize))
"""


@pytest.mark.parametrize("layout, quantize", [("speculators", "none"), ("speculators", "fp8"), ("specforge", "none")])
def test_kill_9_mid_shard_in_a_trainer_layout_resumes_with_identical_bytes(
    layout, quantize, tiny_ds, merged_factory, tmp_path
):
    """A real kill -9 of a vLLM shard run after some rows were placed in the trainer's layout (speculators: renamed
    connector files, or with `quantize: fp8` the FP8 hs_{i} the client wrote; SpecForge: `.ckpt` files written):
    the shard is partial, the rerun completes it, and the trainer's folder then holds exactly the bytes of an
    uninterrupted run, with no stray file and no state file twice on disk."""
    from eagle_pipeline.hidden_states.engines.vllm.vllm_files import vllm_layer_ids
    from eagle_pipeline.hidden_states.layouts.trainer_layouts import plan_layout_target
    from eagle_pipeline.hidden_states.store.format import shard_status
    from eagle_pipeline.simulation.vllm_hidden_states import VLLMHiddenStatesDouble

    from .conftest import kill_after_requests, make_rows

    merged = merged_factory(make_rows(8, seed=5, min_len=2, max_len=40), [3, 5])
    ids = vllm_layer_ids((1, 3, 4), 8)
    ckpt = tmp_path / "ckpt"  # the checkpoint the servers load: its final norm makes SpecForge's post-norm state
    tiny_ds.save_pretrained(ckpt)
    files = "hidden_states/hs_*.safetensors" if layout == "speculators" else "*/*.ckpt"

    def engine(out, storage, exports, url):
        target = plan_layout_target(layout, exports, merged, quantize=quantize)
        return _vllm_shard(merged, out, storage, url, target, 8, (1, 3, 4), 64, head_checkpoint=ckpt)

    def contents(exports):
        return {str(p.relative_to(exports)): p.read_bytes() for p in exports.rglob("*") if p.is_file()}

    clean = tmp_path / "clean"
    with VLLMHiddenStatesDouble(tiny_ds, layer_ids=ids, storage_path=clean / "s") as srv:
        engine(clean / "hs", clean / "s", clean / "exports" / layout, srv.url)
    want = contents(clean / "exports" / layout)
    assert len(want) == 8
    # with fp8 the hs_{i} are the client's FP8 files (their headers name the scales), not the connector's
    assert all((b"hidden_states_scales" in data[:512]) == (quantize == "fp8") for data in want.values())

    storage, out, exports = tmp_path / "s", tmp_path / "hs", tmp_path / "exports" / layout
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with VLLMHiddenStatesDouble(tiny_ds, layer_ids=ids, storage_path=storage, latency_s=0.3) as srv:
        argv = [sys.executable, "-c", _ENGINE_CHILD, str(merged), str(out), srv.url, str(storage), str(exports)]
        child = subprocess.Popen([*argv, layout, str(ckpt), quantize], env=env)
        kill_after_requests(srv, child, 4)
        assert shard_status(out, 0) == "partial"
        placed_before = sorted(p.name for p in exports.glob(files))
        assert 1 <= len(placed_before) < 8  # some rows were placed, no index vouches for them
        engine(out, storage, exports, srv.url)
    assert shard_status(out, 0, check_hash=True) == "done"
    assert contents(exports) == want  # identical bytes, no temporary or stray file
    assert list(storage.iterdir()) == [] and not (out / ".shard-00000.vllm-requests").exists()
    assert all(len(paths) == 1 for paths in _inode_count(tmp_path).values())


def test_the_sweep_takes_only_this_shard_s_finished_orphans(tmp_path):
    """`sweep_orphans`: a finished connector file holding one of the shard's rows goes (a request its killed run
    never heard back from); another shard's file, and one of ours whose lock the server still holds, stay."""
    import fcntl

    from eagle_pipeline.hidden_states.engines.vllm.vllm_files import sweep_orphans

    storage = tmp_path / "s"
    ours, other = list(range(3, 20)), list(range(50, 67))
    orphan = _connector_file(storage / "cmpl-a-0.safetensors", ours)
    foreign = _connector_file(storage / "cmpl-b-0.safetensors", other)
    busy = _connector_file(storage / "cmpl-c-0.safetensors", ours)
    with open(f"{busy}.lock", "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # the server is still writing it
        assert sweep_orphans(storage, [ours, list(range(5))]) == [orphan]
    assert not orphan.exists() and not Path(f"{orphan}.lock").exists()
    assert foreign.exists() and busy.exists()
