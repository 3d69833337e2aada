"""The vLLM engine path against the loopback double, over real HTTP and real safetensors files: numerics equal to
the in-process path, the double's wire format and layer convention, every injected fault ending in a retry or a
clear error, and resume after kill -9."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from eagle_pipeline.hidden_states.checks.verify import verify_shard
from eagle_pipeline.hidden_states.engines.vllm.vllm_files import (
    DROPPED_FINAL_LAYER_BUG,
    EngineShardError,
    vllm_layer_ids,
)
from eagle_pipeline.hidden_states.models.layers import get_backbone
from eagle_pipeline.hidden_states.run import extract_shard
from eagle_pipeline.hidden_states.store.fingerprint import recorded_fingerprint
from eagle_pipeline.hidden_states.store.format import read_index_meta, shard_status
from eagle_pipeline.simulation.vllm_hidden_states import VLLMHiddenStatesDouble, ids_key
from eagle_pipeline_tests.hidden_states.engine_runs import vllm_shard

from ..tolerances import assert_forwards_close
from .conftest import kill_after_requests, make_rows

L = 8  # tiny models' layers
AUX = (1, 3, 4)
IDS = vllm_layer_ids(AUX, L)  # (2, 4, 5, 8)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def rows():
    return make_rows(8, seed=5, min_len=2, max_len=40)


@pytest.fixture
def merged(merged_factory, rows):
    return merged_factory(rows, [3, 5])


def _engine(merged, out, endpoints, storage, **kw):
    kw.setdefault("backoff_base_s", 0.01)
    kw.setdefault("timeout_s", 10.0)
    return vllm_shard(
        merged,
        shard_index=0,
        shard_size=8,
        out_dir=out,
        endpoints=endpoints,
        storage_path=storage,
        num_layers=L,
        aux_layers=AUX,
        hidden_size=64,
        **kw,
    )


def test_layer_ids_translate_the_project_convention():
    assert vllm_layer_ids((1, 29, 57), 61) == (2, 30, 58, 61)  # Model-Optimizer's Kimi-K2.5 recipe
    with pytest.raises(ValueError, match="final state itself"):
        vllm_layer_ids((1, 3, 7), 8)
    with pytest.raises(ValueError, match="ascending"):
        vllm_layer_ids((3, 1, 4), 8)


@pytest.mark.parametrize("family", ["deepseek_v3", "llama"])
def test_engine_path_equals_in_process_path(family, tiny_ds, tiny_llama, merged, rows, tmp_path):
    model = tiny_ds if family == "deepseek_v3" else tiny_llama
    storage = tmp_path / "storage"
    with VLLMHiddenStatesDouble(model, layer_ids=IDS, storage_path=storage) as srv:
        s = _engine(merged, tmp_path / "eng", [srv.url], storage)
        assert srv.total_requests == len(rows)
    assert shard_status(tmp_path / "eng", 0) == "done" and not s.final_state_is_post_norm
    assert all(r.passed for r in verify_shard(tmp_path / "eng", 0, merged).values())
    assert list(storage.iterdir()) == []  # per-request files (and locks) deleted once the shard is committed
    ref = extract_shard(model, merged, shard_index=0, shard_size=8, out_dir=tmp_path / "inp", final_state="pre_norm")
    eng, inp = load_file(s.path), load_file(ref.path)
    assert eng.keys() == inp.keys()
    for key, want in inp.items():
        if want.is_floating_point():
            assert_forwards_close(eng[key], want, model.config, what=key)
        else:
            assert torch.equal(eng[key], want)
    meta = read_index_meta(s.index_path)
    fp = recorded_fingerprint(meta)
    assert fp.engine == "vllm" and meta["vllm_layer_ids"] == [2, 4, 5, 8] and fp.aux_layers == (1, 3, 4)
    assert fp.final_state == "pre_norm"


def test_double_speaks_vllm_and_follows_its_layer_convention(tiny_ds, tmp_path):
    ids = [5, 9, 17, 33, 65, 129]
    all_ids = tuple(range(L + 1))
    with VLLMHiddenStatesDouble(tiny_ds, layer_ids=all_ids, storage_path=tmp_path / "s", served_model_name="m") as srv:
        models = httpx.get(f"{srv.url}/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["id"] == "m"
        assert httpx.get(f"{srv.url}/health").status_code == 200
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": ids, "max_tokens": 1, "return_token_ids": True})
        body = r.json()
        assert body["object"] == "text_completion" and body["choices"][0]["prompt_token_ids"] == ids
        assert len(body["choices"][0]["token_ids"]) == 1 and body["usage"]["prompt_tokens"] == len(ids)
        path = Path(body["kv_transfer_params"]["hidden_states_path"])
        assert path.parent == tmp_path / "s" and path.name == f"{body['id']}.safetensors"
        time.sleep(0.2)
        f = load_file(str(path))
        bad = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [10**6], "max_tokens": 1})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
    assert f["token_ids"].dtype == torch.int64 and f["token_ids"].tolist() == ids
    hs = f["hidden_states"]
    assert hs.shape == (len(ids), L + 1, 64)
    backbone = get_backbone(tiny_ds)
    with torch.no_grad():
        out = backbone(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    for k in range(L):  # id k = transformers hidden_states[k] = output of decoder layer k - 1
        assert_forwards_close(hs[:, k], out.hidden_states[k][0], tiny_ds.config, what=f"id {k}")
    # id L = the last layer's output before the final norm; transformers' last entry is after it
    assert not torch.allclose(hs[:, L], out.hidden_states[L][0], atol=1e-3)
    with torch.no_grad():
        assert_forwards_close(backbone.norm(hs[:, L]), out.hidden_states[L][0], tiny_ds.config, what="post-norm")


@pytest.fixture(scope="module")
def clean_sha(tmp_path_factory):
    """The sha256 of the shard a fault-free run writes (the faults below must end in exactly these bytes)."""
    from eagle_pipeline.hidden_states.models.model import build_tiny_model

    from .conftest import VOCAB, write_merged

    d = tmp_path_factory.mktemp("clean")
    merged = write_merged(d / "merged", make_rows(8, seed=5, min_len=2, max_len=40), [3, 5])
    model = build_tiny_model(VOCAB, family="deepseek_v3", seed=0)
    with VLLMHiddenStatesDouble(model, layer_ids=IDS, storage_path=d / "s") as srv:
        return _engine(merged, d / "out", [srv.url], d / "s").sha256


@pytest.mark.parametrize(
    "faults",
    [
        {"http_500": 1.0},
        {"http_503": 0.5, "fail_first_n_attempts": 2},
        {"timeout": 0.5, "timeout_sleep_s": 30},
        {"lock_never_released": 0.5},
        {"late_file": 1.0, "late_file_s": 0.3},
    ],
    ids=["http_500", "http_503_twice", "timeout", "lock_never_released", "late_file"],
)
def test_transient_faults_are_retried_into_the_same_bytes(faults, tiny_ds, merged, tmp_path, clean_sha):
    storage = tmp_path / "s"
    logs: list[str] = []
    timeout = 1.5 if ("timeout" in faults or "lock_never_released" in faults) else 10.0
    with VLLMHiddenStatesDouble(tiny_ds, layer_ids=IDS, storage_path=storage, faults=faults) as srv:
        s = _engine(merged, tmp_path / "out", [srv.url], storage, timeout_s=timeout, log=logs.append)
        total = srv.total_requests
    assert s.sha256 == clean_sha and shard_status(tmp_path / "out", 0) == "done"
    if "late_file" in faults:
        assert total == 8 and not logs  # waited for the file, no retry needed
    else:
        assert total > 8 and logs and all("shard 00000, merged row" in x for x in logs)
        assert read_index_meta(s.index_path)["retries"] == total - 8
    assert list(storage.iterdir()) == []


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("final_layer_missing", "the final id 8 is missing"),
        ("zero_states", "all-zero state vectors (layer ids [2])"),
        ("nan_states", "NaN/Inf"),
        ("short_states", "short by"),
        ("prompt_ids_mismatch", "prompt_token_ids returned differ"),
        ("no_kv_transfer_params", "no kv_transfer_params.hidden_states_path"),
    ],
)
def test_silent_field_failures_stop_the_shard_naming_the_sample(fault, message, tiny_ds, merged, rows, tmp_path):
    storage, out = tmp_path / "s", tmp_path / "out"
    victim = rows[4]
    faults = {"select": {fault: [ids_key(victim["input_ids"])]}}
    with VLLMHiddenStatesDouble(tiny_ds, layer_ids=IDS, storage_path=storage, faults=faults) as srv:
        with pytest.raises(EngineShardError) as err:
            _engine(merged, out, [srv.url], storage)
        assert srv.request_counts()[ids_key(victim["input_ids"])] == 1  # not retried: the server is wrong
    text = str(err.value)
    assert message in text and f"shard 00000, merged row 4 ({victim['sample_id']})" in text
    assert srv.url in text
    if fault == "final_layer_missing":
        assert DROPPED_FINAL_LAYER_BUG in text and "#46973" in text
    assert shard_status(out, 0) == "missing" and list(out.iterdir()) == []  # no shard, and nothing half-written
    time.sleep(0.2)  # writer threads of requests still in flight when the shard stopped
    assert not list(storage.glob("*.safetensors"))


def test_a_transient_fault_that_persists_ends_in_a_clear_error(tiny_ds, merged, rows, tmp_path):
    storage = tmp_path / "s"
    key = ids_key(rows[2]["input_ids"])
    faults = {"select": {"http_500": [key]}, "fail_first_n_attempts": 99}
    with VLLMHiddenStatesDouble(tiny_ds, layer_ids=IDS, storage_path=storage, faults=faults) as srv:
        with pytest.raises(EngineShardError, match=r"merged row 2 .*server_error HTTP 500.*attempt 3 of 3"):
            _engine(merged, tmp_path / "out", [srv.url], storage, max_retries=2)
        assert srv.request_counts()[key] == 3
    assert shard_status(tmp_path / "out", 0) == "missing"


def test_rows_spread_over_endpoints_within_the_concurrency_bound(tiny_ds, merged, tmp_path, clean_sha):
    storage = tmp_path / "s"
    # 0.3 s a request: one endpoint alone would need 1.2 s for the 8 rows, so both take part even on a busy machine.
    with (
        VLLMHiddenStatesDouble(tiny_ds, layer_ids=IDS, storage_path=storage, latency_s=0.3) as a,
        VLLMHiddenStatesDouble(tiny_ds, layer_ids=IDS, storage_path=storage, latency_s=0.3) as b,
    ):
        s = _engine(merged, tmp_path / "out", [a.url, b.url], storage, concurrency=2)
        assert a.total_requests > 0 and b.total_requests > 0 and a.total_requests + b.total_requests == 8
        assert 1 <= a.max_in_flight <= 2 and 1 <= b.max_in_flight <= 2
    assert s.sha256 == clean_sha


def test_a_server_that_dies_mid_shard(tiny_ds, merged, tmp_path, clean_sha):
    storage = tmp_path / "s"
    # Two endpoints: the survivor takes the dead one's rows. It is slow (0.4 s a row): a failed row waits for it
    # rather than spend its retries on the dead one, whose refusals come back within milliseconds.
    with (
        VLLMHiddenStatesDouble(tiny_ds, layer_ids=IDS, storage_path=storage, faults={"die_after_requests": 2}) as a,
        VLLMHiddenStatesDouble(tiny_ds, layer_ids=IDS, storage_path=storage, latency_s=0.4) as b,
    ):
        s = _engine(merged, tmp_path / "two", [a.url, b.url], storage, concurrency=1, max_retries=2)
        assert a.died and s.sha256 == clean_sha
        # Each row failed on the dead server at most once: no more retries than rows.
        assert 1 <= read_index_meta(s.index_path)["retries"] <= 8
    # One endpoint: a clear error after the retries; a rerun against a restarted server resumes the shard.
    with VLLMHiddenStatesDouble(tiny_ds, layer_ids=IDS, storage_path=storage, faults={"die_after_requests": 3}) as c:
        with pytest.raises(
            EngineShardError, match=r"shard 00000, merged row \d .*unreachable: cannot connect to 127\.0\.0\.1:"
        ):
            _engine(merged, tmp_path / "one", [c.url], storage, concurrency=1, max_retries=2)
    assert shard_status(tmp_path / "one", 0) == "missing"
    with VLLMHiddenStatesDouble(tiny_ds, layer_ids=IDS, storage_path=storage) as d:
        assert _engine(merged, tmp_path / "one", [d.url], storage).sha256 == clean_sha
    assert list(storage.iterdir()) == []


_CHILD = """
import sys
from eagle_pipeline_tests.hidden_states.engine_runs import vllm_shard
merged, out, url, storage = sys.argv[1:5]
vllm_shard(merged, shard_index=0, shard_size=8, out_dir=out, endpoints=[url], storage_path=storage,
                   num_layers=8, aux_layers=(1, 3, 4), hidden_size=64, concurrency=1)
"""


def test_kill_9_mid_shard_resumes_with_identical_bytes(tiny_ds, merged, tmp_path, clean_sha):
    storage, out = tmp_path / "s", tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with VLLMHiddenStatesDouble(tiny_ds, layer_ids=IDS, storage_path=storage, latency_s=0.3) as srv:
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(merged), str(out), srv.url, str(storage)], env=env)
        kill_after_requests(srv, child, 4)
        assert shard_status(out, 0) == "partial"  # the writer's temporary file is left behind
        journal = out / ".shard-00000.vllm-requests"
        orphans = [Path(x) for x in journal.read_text().split()]
        assert len(orphans) >= 3  # every connector file the killed run received is listed
        (storage / "cmpl-stray.safetensors").write_bytes(b"x")  # one its kill left behind (not yet copied)
        journal.write_text(journal.read_text() + f"{storage / 'cmpl-stray.safetensors'}\n")
        s = _engine(merged, out, [srv.url], storage)
    assert s.sha256 == clean_sha and shard_status(out, 0) == "done"
    assert not journal.exists() and list(storage.iterdir()) == []  # the killed run's files are gone too
    assert json.loads(json.dumps(read_index_meta(s.index_path)))["rows"] == 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_file_validation_finds_nan_inf_and_zero_vectors_in_every_dtype(dtype, tmp_path):
    from safetensors.torch import save_file

    from eagle_pipeline.hidden_states.engines.vllm.vllm_files import validate_states_file
    from eagle_pipeline.shared.failures import RequestFailure

    ids = list(range(3, 11))
    good = (torch.randn(8, 4, 16) * 3).to(dtype)
    path = tmp_path / "f.safetensors"

    def check(states):
        save_file({"hidden_states": states, "token_ids": torch.tensor(ids)}, str(path))
        file = validate_states_file(path, ids, IDS, hidden_size=16)
        file.close()
        return file.facts

    assert check(good).dtype == dtype and check(good).tokens == 8
    for value, message in ((float("nan"), "NaN/Inf"), (float("inf"), "NaN/Inf"), (float("-inf"), "NaN/Inf")):
        bad = good.clone()
        bad[5, 2, 7] = value
        with pytest.raises(RequestFailure, match=message):
            check(bad)
    zero = good.clone()
    zero[2, 1] = -0.0  # a negative zero is a zero too
    with pytest.raises(RequestFailure, match=r"1 all-zero state vectors \(layer ids \[4\]\)"):
        check(zero)
    tiny = good.clone()
    tiny[2, 1] = 0
    tiny[2, 1, 3] = torch.finfo(dtype).tiny  # one non-zero element: a real (if odd) state, not a zero vector
    assert check(tiny).tokens == 8


def test_rows_fetched_ahead_of_a_slow_row_are_bounded(tiny_ds, merged, rows, tmp_path, clean_sha):
    import threading

    storage = tmp_path / "s"
    faults = {"select": {"http_503": [ids_key(rows[0]["input_ids"])]}, "fail_first_n_attempts": 3}
    seen: list[int] = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(len(list(storage.glob("*.safetensors"))))
            time.sleep(0.002)

    with VLLMHiddenStatesDouble(tiny_ds, layer_ids=IDS, storage_path=storage, faults=faults) as srv:
        t = threading.Thread(target=watch)
        t.start()
        try:
            s = _engine(merged, tmp_path / "out", [srv.url], storage, concurrency=1, backoff_base_s=0.2)
        finally:
            stop.set()
            t.join()
        assert srv.request_counts()[ids_key(rows[0]["input_ids"])] == 4  # row 0 was slow: three retries
    assert s.sha256 == clean_sha
    assert 0 < max(seen) <= 2  # window = 2 x concurrency x endpoints; the other 7 rows never piled up


def test_an_in_process_shard_is_never_reused_as_an_engine_shard(tiny_ds, merged, tmp_path):
    from eagle_pipeline.hidden_states.store.shards import ShardMismatchError

    out, storage = tmp_path / "out", tmp_path / "s"
    extract_shard(tiny_ds, merged, shard_index=0, shard_size=8, out_dir=out, aux_layers=AUX)  # post-norm, in process
    with VLLMHiddenStatesDouble(tiny_ds, layer_ids=IDS, storage_path=storage) as srv:
        with pytest.raises(ShardMismatchError, match=r"engine.*in_process.*vllm|final_state"):
            _engine(merged, out, [srv.url], storage)
        assert srv.total_requests == 0
        s = _engine(merged, out, [srv.url], storage, on_mismatch="redo")  # the old files are moved aside
    assert not s.skipped and s.fingerprint["engine"] == "vllm" and s.fingerprint["final_state"] == "pre_norm"
    assert (out / "superseded").is_dir()
