"""engine: torchrun: a real 2-process torchrun world (gloo, CPU) with transformers' DistributedConfig(tp_size=2),
and with tp_size=2, ep_size=2, writes the same shard as one process, within 1e-5 in fp32, on a tiny DeepSeek-V3
(MLA + MoE) and a tiny llama. Each rank holds half of the routed-expert parameters, whatever the installed
transformers' TP plan splits (EP where it would replicate them), and exactly what `world_split` plans for it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle_pipeline.hidden_states.checks.verify import verify_shard
from eagle_pipeline.hidden_states.engines.engine_torchrun import TorchrunShard, rank_device, torchrun_argv
from eagle_pipeline.hidden_states.models.world_split import (
    EP_SETTING,
    ExpertsReplicated,
    is_routed_expert,
    rank_share,
    world_ep_size,
)
from eagle_pipeline.hidden_states.run import extract_shard
from eagle_pipeline.hidden_states.store.format import shard_status

from ..tolerances import assert_forwards_close
from .conftest import make_rows
from .engine_runs import torchrun_shard

pytest.importorskip("accelerate")  # transformers' tensor parallelism needs it (a dev dependency)
pytestmark = pytest.mark.slow


def _world(model, merged, tmp_path, **dist):
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    logs: list[str] = []
    s = torchrun_shard(
        model_dir, merged, shard_size=6, out_dir=tmp_path / "tp", final_state="post_norm", log=logs.append, **dist
    )
    assert "--nproc-per-node 2" in logs[0] and not s.skipped
    report = json.loads(logs[-1].split("world done: ", 1)[1])
    assert report["sha256"] == s.sha256 and report["tp_size"] == 2
    holds = report["holds"]
    ep_size = world_ep_size(model.config, 2, dist.get("ep_size"))
    assert report.get("ep_size") == ep_size
    assert holds == rank_share(model.config, 2, ep_size).as_dict()  # the plan's per-rank figures are what it holds
    assert holds["params"] == sum(p.numel() for p in model.parameters())
    return s, model_dir, holds


def _assert_half_the_routed_experts_per_rank(holds, model):
    routed = sum(p.numel() for name, p in model.named_parameters() if is_routed_expert(name))
    assert routed > 0 and holds["routed_expert_params"] == routed
    assert holds["routed_expert_params_per_rank"] * 2 == routed  # split, by TP or EP, never replicated


def test_the_world_gets_exactly_the_shard_run_s_parameters(tmp_path):
    from eagle_pipeline.hidden_states.store.fingerprint import ExtractionFingerprint

    wanted = ExtractionFingerprint(
        model={"kind": "dir", "sha256": "ab"},
        aux_layers=(1, 3, 4),
        final_state="pre_norm",
        shard_size=6,
        dtype="float32",
        merged_version="m",
        engine="torchrun",
    )
    shard = TorchrunShard(
        tmp_path / "model",
        str(tmp_path / "merged"),
        shard_index=3,
        out_dir=tmp_path / "out",
        tp_size=4,
        fingerprint=wanted.to_dict(),
        ep_size=4,
        max_tokens_per_batch=1024,
        device="cpu",
    )
    argv = torchrun_argv(shard, port=29511)
    assert argv[argv.index("--nproc-per-node") + 1] == "4" and argv[argv.index("--master-port") + 1] == "29511"
    assert argv[-2:] == ["--shard", shard.to_json()]
    back = TorchrunShard.from_json(argv[-1])  # what every rank parses
    assert back == shard and back.merged_dir == tmp_path / "merged" and back.wanted == wanted


def test_the_ranks_store_the_dtype_the_shard_run_decided_with(tiny_ds, merged_factory, tmp_path, monkeypatch):
    """Defect: the ranks chose their device and dtype from `cuda.is_available()` while the fingerprint followed
    `hidden_states.device`, so with `device: cpu` on a GPU host every rerun found the shard stale. Now the world
    is handed the fingerprint (its dtype) and the setting, and a rank on a GPU host with `device: cpu` stays on the
    CPU; the ranks record exactly the fingerprint the shard run decided with."""
    import torch

    from eagle_pipeline.hidden_states.store.format import read_index_meta, shard_paths

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host, as the rank sees it
    assert rank_device("cpu", 1) == "cpu" and rank_device("auto", 1) == "cuda:1" and rank_device("cuda", 0) == "cuda:0"
    monkeypatch.undo()
    merged = merged_factory(make_rows(4, seed=6, min_len=2, max_len=20), [4])
    tiny_ds.save_pretrained(tmp_path / "model")
    logs: list[str] = []
    s = torchrun_shard(tmp_path / "model", merged, shard_size=4, out_dir=tmp_path / "o", device="cpu", log=logs.append)
    world = TorchrunShard.from_json(logs[0].rsplit("--shard ", 1)[1])
    assert world.device == "cpu" and world.wanted.dtype == "float32" == s.dtype
    assert read_index_meta(shard_paths(tmp_path / "o", 0)[1])["fingerprint"] == world.fingerprint
    assert torchrun_shard(tmp_path / "model", merged, shard_size=4, out_dir=tmp_path / "o", device="cpu").skipped


def _assert_same_shard(path, ref_path, config):
    tp, one = load_file(path), load_file(ref_path)
    assert tp.keys() == one.keys()
    for key, want in one.items():
        if want.is_floating_point():
            assert_forwards_close(tp[key], want, config, what=key)
        else:
            assert torch.equal(tp[key], want)


def test_tp2_world_equals_one_process(tiny_ds, merged_factory, tmp_path):
    rows = make_rows(6, seed=9, min_len=2, max_len=40)
    merged = merged_factory(rows, [6])
    s, model_dir, holds = _world(tiny_ds, merged, tmp_path, tp_size=2)
    _assert_half_the_routed_experts_per_rank(holds, tiny_ds)
    assert shard_status(tmp_path / "tp", 0) == "done"
    assert all(r.passed for r in verify_shard(tmp_path / "tp", 0, merged).values())
    ref = extract_shard(tiny_ds, merged, shard_index=0, shard_size=6, out_dir=tmp_path / "one", final_state="post_norm")
    _assert_same_shard(s.path, ref.path, tiny_ds.config)
    again = torchrun_shard(model_dir, merged, shard_size=6, out_dir=tmp_path / "tp", final_state="post_norm")
    assert again.skipped and again.sha256 == s.sha256  # a done shard starts no world


def test_tp2_ep2_world_equals_one_process(tiny_ds, merged_factory, tmp_path):
    merged = merged_factory(make_rows(6, seed=4, min_len=2, max_len=40), [6])
    s, _, holds = _world(tiny_ds, merged, tmp_path, tp_size=2, ep_size=2)
    _assert_half_the_routed_experts_per_rank(holds, tiny_ds)
    ref = extract_shard(tiny_ds, merged, shard_index=0, shard_size=6, out_dir=tmp_path / "one", final_state="post_norm")
    _assert_same_shard(s.path, ref.path, tiny_ds.config)


def test_tp2_world_equals_one_process_on_llama(tiny_llama, merged_factory, tmp_path):
    merged = merged_factory(make_rows(6, seed=2, min_len=2, max_len=40), [6])
    s, _, holds = _world(tiny_llama, merged, tmp_path, tp_size=2)
    assert holds["routed_expert_params"] == 0 and holds["params_per_rank"] < holds["params"]  # dense, split by TP
    ref = extract_shard(
        tiny_llama, merged, shard_index=0, shard_size=6, out_dir=tmp_path / "one", final_state="post_norm"
    )
    _assert_same_shard(s.path, ref.path, tiny_llama.config)


def _tp_plan_without_routed_experts(monkeypatch, config):
    """The installed transformers' DeepSeek-V3 TP plan as 5.25 ships it: the routed experts only in the EP plan."""
    plan = {k: v for k, v in type(config).base_model_tp_plan.items() if not is_routed_expert(k)}
    monkeypatch.setattr(type(config), "base_model_tp_plan", plan)


def test_a_world_that_would_replicate_the_routed_experts_is_refused_naming_the_setting(
    tiny_ds, merged_factory, tmp_path, monkeypatch
):
    """Refused before any process starts (this process's transformers decides, as the ranks' does); unset, ep_size
    becomes tp_size. Under a transformers whose TP plan splits the experts, ep_size 1 is TP inside each expert."""
    from eagle_pipeline.hidden_states.plan.estimate import Workload
    from eagle_pipeline.hidden_states.plan.run_plan import PlanRefused, plan_for_run
    from eagle_pipeline.hidden_states.settings import HiddenStatesConfig, TorchrunConfig

    merged = merged_factory(make_rows(2, seed=1), [2])
    tiny_ds.save_pretrained(tmp_path / "model")
    if rank_share(tiny_ds.config, 2, None).routed_experts_replicated == 0:
        assert world_ep_size(tiny_ds.config, 2, 1) == 1 and world_ep_size(tiny_ds.config, 2, None) is None
        _tp_plan_without_routed_experts(monkeypatch, tiny_ds.config)
    assert rank_share(tiny_ds.config, 2, 1).routed_experts_per_rank == rank_share(tiny_ds.config, 2, 1).routed_experts
    assert world_ep_size(tiny_ds.config, 2, None) == 2 and world_ep_size(tiny_ds.config, 2, 2) == 2
    with pytest.raises(ExpertsReplicated, match=rf"{EP_SETTING}: 1 with tp_size 2 would hold .* on each of the 2"):
        torchrun_shard(tmp_path / "model", merged, shard_size=2, out_dir=tmp_path / "o", ep_size=1)
    assert shard_status(tmp_path / "o", 0) == "missing" and not list((tmp_path / "o").glob("shard-*"))

    def plan(ep_size: int | None) -> dict:
        torchrun = TorchrunConfig(tp_size=2, ep_size=ep_size)
        h = HiddenStatesConfig(model=str(tmp_path / "model"), shard_size=2, engine="torchrun", torchrun=torchrun)
        return plan_for_run(h, Workload(100, 2), target_model_config=None, vocab_size=0)

    with pytest.raises(PlanRefused, match=EP_SETTING):
        plan(1)
    this_run = plan(None)["this_run"]  # unset: EP, half per rank
    share = rank_share(tiny_ds.config, 2, 2)
    assert share.routed_experts_per_rank * 2 == share.routed_experts
    assert this_run.assumptions["weights"].startswith(f"{share.params:.4g} params")
    assert f"{share.replicated:.4g} of them held whole" in this_run.assumptions["weights"]


def test_a_failed_world_names_the_shard(tiny_ds, merged_factory, tmp_path):
    merged = merged_factory(make_rows(2, seed=1), [2])
    tiny_ds.config.save_pretrained(tmp_path / "model")  # a config without weights: every rank fails to load
    with pytest.raises(RuntimeError, match=r"shard 00000: torchrun world of 2 exited"):
        torchrun_shard(tmp_path / "model", merged, shard_size=2, out_dir=tmp_path / "o")
    assert shard_status(tmp_path / "o", 0) == "missing"


_CHILD = """
import sys
from eagle_pipeline_tests.hidden_states.engine_runs import torchrun_shard
model, merged, out = sys.argv[1:4]
torchrun_shard(model, merged, shard_size=6, out_dir=out)
"""


def _world_pids(marker: str) -> list[int]:
    """Processes whose command line names `marker` (the killed run's output directory): the agent and its ranks."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:  # gone meanwhile
            pass
    return pids


def _kill_the_run_and_its_world(child: subprocess.Popen, out: Path) -> None:
    """SIGKILL the shard run `child` (still running) and wait for its world (named by `out`) to follow it."""
    assert child.poll() is None, "the shard run finished before it could be killed"
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while _world_pids(str(out)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _world_pids(str(out)) == []  # no orphaned world goes on holding devices and writing the shard


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the world follows its shard run via PR_SET_PDEATHSIG")
def test_kill_9_of_the_shard_run_ends_its_world_and_the_rerun_writes_identical_bytes(tiny_ds, merged_factory, tmp_path):
    merged = merged_factory(make_rows(6, seed=3, min_len=2, max_len=40), [6])
    model_dir = tmp_path / "model"
    tiny_ds.save_pretrained(model_dir)
    clean = torchrun_shard(model_dir, merged, shard_size=6, out_dir=tmp_path / "c")
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(model_dir), str(merged), str(out)], env=env)
    deadline = time.monotonic() + 120
    while len(_world_pids(str(out))) < 3 and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.05)  # the agent and both ranks are up (loading the model)
    _kill_the_run_and_its_world(child, out)
    assert shard_status(out, 0) != "done"
    again = torchrun_shard(model_dir, merged, shard_size=6, out_dir=out)
    assert not again.skipped and again.sha256 == clean.sha256 and shard_status(out, 0) == "done"


_LAYOUT_CHILD = """
import sys
from eagle_pipeline.hidden_states.layouts.trainer_layouts import plan_layout_target
from eagle_pipeline_tests.hidden_states.engine_runs import torchrun_shard
model, merged, out, layout, exports = sys.argv[1:6]
torchrun_shard(model, merged, shard_size=24, out_dir=out, max_tokens_per_batch=48,
               layout_target=plan_layout_target(layout, f"{exports}/{layout}", merged))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the world follows its shard run via PR_SET_PDEATHSIG")
@pytest.mark.parametrize("layout", ["speculators", "specforge"])
def test_kill_9_mid_shard_in_a_trainer_layout_and_the_rerun_writes_identical_files(
    layout, tiny_ds, merged_factory, tmp_path
):
    """A real kill -9 of a torchrun shard run once rank 0 has written some of the trainer's files: the shard is not
    done, the rerun completes it, and the trainer's folder holds exactly the bytes of an uninterrupted world's, with
    no stray temporary and no state file twice on disk (inode walk)."""
    from eagle_pipeline.hidden_states.layouts.trainer_layouts import plan_layout_target

    merged = merged_factory(make_rows(24, seed=8, min_len=2, max_len=40), [24])
    model_dir = tmp_path / "model"
    tiny_ds.save_pretrained(model_dir)
    files = "hidden_states/hs_*.safetensors" if layout == "speculators" else "*/*.ckpt"

    def shard(out, exports):  # `exports`: the exports root; rank 0 writes under exports / layout
        target = plan_layout_target(layout, exports / layout, merged)
        return torchrun_shard(
            model_dir, merged, shard_size=24, out_dir=out, max_tokens_per_batch=48, layout_target=target
        )

    def contents(exports):
        return {str(p.relative_to(exports)): p.read_bytes() for p in exports.rglob("*") if p.is_file()}

    shard(tmp_path / "c", tmp_path / "c-exports")
    want = contents(tmp_path / "c-exports" / layout)
    assert len(want) == 24
    out, exports = tmp_path / "killed", tmp_path / "exports" / layout
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    argv = [sys.executable, "-c", _LAYOUT_CHILD, str(model_dir), str(merged), str(out), layout, str(exports.parent)]
    child = subprocess.Popen(argv, env=env)
    deadline = time.monotonic() + 180
    while not list(exports.glob(files)) and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.01)  # rank 0 has written its first trainer file
    _kill_the_run_and_its_world(child, out)
    placed = list(exports.glob(files))
    assert 1 <= len(placed) < 24 and shard_status(out, 0) != "done"  # killed mid-shard
    again = shard(out, exports.parent)
    assert not again.skipped and shard_status(out, 0, check_hash=True) == "done"
    assert contents(exports) == want  # identical bytes, no stray temporary
    inodes = [(p.stat().st_dev, p.stat().st_ino) for p in tmp_path.rglob("*") if p.is_file()]
    assert len(inodes) == len(set(inodes))
