"""The length pre-flight of the vLLM engine (the servers' max_model_len from GET /v1/models; rows over it refused
before any request, or dropped and recorded), and the double answering as vLLM 0.32's OpenAI server does: the
model card, the two length errors and 404 for a model it does not serve (shapes from vLLM 0.32.0's
entrypoints/serve: ModelCard, ErrorResponse, get_max_tokens, TokenizeParams._token_len_check)."""

from __future__ import annotations

import httpx
import pytest

from eagle_pipeline.hidden_states.checks.verify import verify_shard
from eagle_pipeline.hidden_states.engines.vllm.vllm_files import EngineShardError, vllm_layer_ids
from eagle_pipeline.hidden_states.layouts.trainer_exports import StatesExport
from eagle_pipeline.hidden_states.store.format import read_index, read_index_meta, shard_paths, shard_status
from eagle_pipeline.hidden_states.store.shards import ShardMismatchError
from eagle_pipeline.simulation.vllm_hidden_states import VLLMHiddenStatesDouble
from eagle_pipeline_tests.hidden_states.engine_runs import vllm_shard

from .conftest import make_rows

L, AUX = 8, (1, 3, 4)
IDS = vllm_layer_ids(AUX, L)
LIMIT = 30  # the servers' max_model_len in these tests


@pytest.fixture
def rows():
    rows = make_rows(8, seed=5, min_len=2, max_len=20)
    for i, n in ((2, LIMIT), (5, LIMIT + 7), (6, LIMIT - 1)):  # exactly the limit, over it, the longest that fits
        rows[i]["input_ids"] = (rows[i]["input_ids"] * 40)[:n]
        rows[i]["loss_mask"] = [0] + [1] * (n - 1)
        rows[i]["n_tokens"], rows[i]["n_prompt_tokens"] = n, 1
    return rows


def _engine(merged, out, srv, storage, *, shard_index=0, shard_size=8, **kw):
    return vllm_shard(
        merged,
        shard_index=shard_index,
        shard_size=shard_size,
        out_dir=out,
        endpoints=[srv.url],
        storage_path=storage,
        num_layers=L,
        aux_layers=AUX,
        hidden_size=64,
        backoff_base_s=0.01,
        timeout_s=10.0,
        **kw,
    )


def test_double_answers_like_vllm(tiny_ds, tmp_path):
    with VLLMHiddenStatesDouble(
        tiny_ds, layer_ids=IDS, storage_path=tmp_path / "s", served_model_name="m", max_model_len=LIMIT
    ) as srv:
        (card,) = httpx.get(f"{srv.url}/v1/models", timeout=60).json()["data"]
        assert set(card) == {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"}
        assert (card["id"], card["object"], card["owned_by"], card["max_model_len"]) == ("m", "model", "vllm", LIMIT)
        (perm,) = card["permission"]
        assert perm["object"] == "model_permission" and perm["id"].startswith("modelperm-")

        def post(n: int, **body):
            body = {"prompt": [7] * n, "max_tokens": 1, **body}
            return httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)

        assert post(LIMIT - 1).status_code == 200
        at, over = post(LIMIT), post(LIMIT + 1)
        assert at.status_code == over.status_code == 400
        assert at.json() == {
            "error": {
                "message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
                "type": "BadRequestError",
                "param": "max_tokens",
                "code": 400,
            }
        }
        err = over.json()["error"]
        assert err["message"].startswith(
            f"This model's maximum context length is {LIMIT} tokens. However, your prompt contains {LIMIT + 1} input "
            "tokens, which exceeds this limit even without any output tokens."
        )
        assert (err["type"], err["param"], err["code"]) == ("BadRequestError", "input_tokens", 400)
        assert post(3, model="m").status_code == 200
        unknown = post(3, model="/models/Kimi-K2.5")  # a local directory served without --served-model-name
        assert unknown.status_code == 404
        assert unknown.json() == {
            "error": {
                "message": "The model `/models/Kimi-K2.5` does not exist. Valid aliases: m.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
        }
        assert srv.total_requests == 2  # the refused requests computed nothing and are not counted


def test_rows_the_servers_cannot_take_are_refused_before_any_request(tiny_ds, merged_factory, rows, tmp_path):
    merged = merged_factory(rows, [3, 5])
    with VLLMHiddenStatesDouble(tiny_ds, layer_ids=IDS, storage_path=tmp_path / "s", max_model_len=LIMIT) as srv:
        with pytest.raises(EngineShardError) as err:
            _engine(merged, tmp_path / "out", srv, tmp_path / "s")
        assert srv.total_requests == 0
    msg = str(err.value)
    assert "2 merged rows" in msg and f"max_model_len {LIMIT}" in msg and "too_long_rows: drop" in msg
    assert f"2 ({rows[2]['sample_id']}, {LIMIT} tokens)" in msg and f"5 ({rows[5]['sample_id']}, {LIMIT + 7}" in msg
    assert rows[6]["sample_id"] not in msg  # LIMIT - 1 tokens fit: one output token is asked for
    assert shard_status(tmp_path / "out", 0) == "missing"


def test_dropped_rows_are_recorded_and_never_silent(tiny_ds, merged_factory, rows, tmp_path):
    merged = merged_factory(rows, [3, 5])
    out, storage = tmp_path / "out", tmp_path / "s"
    logs: list[str] = []
    with VLLMHiddenStatesDouble(tiny_ds, layer_ids=IDS, storage_path=storage, max_model_len=LIMIT) as srv:
        s = _engine(merged, out, srv, storage, too_long_rows="drop", log=logs.append)
        assert srv.total_requests == 6 and s.rows == 6
        meta = read_index_meta(shard_paths(out, 0)[1])
        want = [
            {"row": 2, "sample_id": rows[2]["sample_id"], "n_tokens": LIMIT},
            {"row": 5, "sample_id": rows[5]["sample_id"], "n_tokens": LIMIT + 7},
        ]
        assert (
            meta["vllm_max_model_len"] == LIMIT and [{k: d[k] for k in want[0]} for d in meta["dropped_rows"]] == want
        )
        assert all("max_model_len" in d["reason"] for d in meta["dropped_rows"])
        index = read_index(shard_paths(out, 0)[1])
        assert index.column("row_index").to_pylist() == [0, 1, 3, 4, 6, 7]
        checks = verify_shard(out, 0, merged)
        assert all(c.passed for c in checks.values()) and rows[5]["sample_id"] in checks["ids_match"].detail
        assert any(rows[2]["sample_id"] in line for line in logs)
        # Reused under drop; under refuse the shard that lacks rows is not taken as done: the one decision
        # (run.run_shard) finds the rows it left out differ from none, before any request.
        _engine(merged, out, srv, storage, too_long_rows="drop")
        assert srv.total_requests == 6
        with pytest.raises(ShardMismatchError, match=r"left_out: \["):
            _engine(merged, out, srv, storage)
        assert srv.total_requests == 6


def test_a_server_limit_that_changes_the_rows_left_out_makes_the_shard_stale(tiny_ds, merged_factory, rows, tmp_path):
    """The servers' max_model_len changes what a shard holds only through the rows it leaves out: restarted with a
    larger limit, a shard that lost rows it could now take is stale, and one that lost none is reused."""
    merged = merged_factory(rows, [3, 5])
    out, storage = tmp_path / "out", tmp_path / "s"
    with VLLMHiddenStatesDouble(tiny_ds, layer_ids=IDS, storage_path=storage, max_model_len=LIMIT) as srv:
        for shard in (0, 1):
            _engine(merged, out, srv, storage, shard_index=shard, shard_size=4, too_long_rows="drop")
    assert [len(read_index_meta(shard_paths(out, i)[1])["dropped_rows"]) for i in (0, 1)] == [1, 1]
    with VLLMHiddenStatesDouble(tiny_ds, layer_ids=IDS, storage_path=storage, max_model_len=LIMIT + 1) as srv:
        with pytest.raises(ShardMismatchError, match=r"left_out: \[.*\] \(on disk\) -> \[\] \(now\)"):
            _engine(merged, out, srv, storage, shard_size=4, too_long_rows="drop")  # row 2 (LIMIT tokens) fits now
        again = _engine(merged, out, srv, storage, shard_index=1, shard_size=4, too_long_rows="drop")
        assert again.skipped and srv.total_requests == 0  # row 5 (LIMIT + 7) is still over: the same rows left out


def test_dropped_rows_leave_no_gap_in_the_speculators_numbering(tiny_ds, merged_factory, rows, tmp_path):
    """speculators reads row i of its Arrow dataset from hs_{i} (`ArrowDataset._get_raw_data`: file index = row
    index), so a dropped row must leave neither a missing hs_{i} nor a row without states. Two shards in the
    speculators layout under `too_long_rows: drop`, the later one extracted first: the files are hs_0..hs_5 with no
    gap, the export's dataset holds the 6 rows with states, row i's token_ids equal its input_ids, and export.json
    names the 2 dropped rows."""
    import datasets
    from safetensors.torch import load_file

    from eagle_pipeline.drafter_types import SPECULATORS
    from eagle_pipeline.hidden_states.layouts.trainer_layouts import LAYOUTS, plan_layout_target
    from eagle_pipeline.shared.storage import read_json

    merged = merged_factory(rows, [3, 5])
    out, storage, exports = tmp_path / "hs", tmp_path / "s", tmp_path / "exports" / "speculators"
    target = plan_layout_target("speculators", exports, merged)
    with VLLMHiddenStatesDouble(tiny_ds, layer_ids=IDS, storage_path=storage, max_model_len=LIMIT) as srv:
        for shard in (1, 0):  # row 5 (shard 1) and row 2 (shard 0) are dropped; shard 1 runs before shard 0 drops
            _engine(
                merged, out, srv, storage, shard_index=shard, shard_size=4, too_long_rows="drop", layout_target=target
            )
    assert sorted(p.name for p in (exports / "hidden_states").iterdir()) == [f"hs_{i}.safetensors" for i in range(6)]
    summary = LAYOUTS[SPECULATORS].export(StatesExport(out, merged, exports))
    ds = datasets.load_from_disk(str(exports)).with_format("torch")
    dropped = {rows[2]["sample_id"], rows[5]["sample_id"]}
    assert len(ds) == 6 and dropped.isdisjoint(ds["sample_id"])
    kept = [r for r in rows if r["sample_id"] not in dropped]
    train_then_eval = [r for split in ("train", "eval") for r in kept if r["split"] == split]
    assert list(ds["sample_id"]) == [r["sample_id"] for r in train_then_eval]
    for i in range(len(ds)):  # as speculators reads it: row i from hs_{i}, its token ids equal to the row's
        t = load_file(str(exports / "hidden_states" / f"hs_{i}.safetensors"))
        assert t["token_ids"].tolist() == ds[i]["input_ids"].tolist() == train_then_eval[i]["input_ids"]
    n_train = sum(r["split"] == "train" for r in kept)
    assert summary.rows == {"train": n_train, "eval": 6 - n_train}
    recorded = read_json(exports / "export.json")["extra"]["dropped_rows"]
    assert {d["sample_id"] for d in recorded} == dropped
