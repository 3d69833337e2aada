"""Contract test "a plain server asked for states": a vLLM started without the extract_hidden_states speculative
config and the connector (`vllm serve MODEL`, e.g. the generation server named in hidden_states.vllm.endpoints by
mistake) and the hidden-states double configured as plain (`no_kv_transfer_params`) answer the extraction request
alike (200, `kv_transfer_params: null`), and the project's client turns either answer into the same error, which
names the server, the shard, the row and what to do, before any state is written."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from eagle_pipeline.cli import main
from eagle_pipeline.config import load_config
from eagle_pipeline.hidden_states.engines.engine import ExtractionPaths
from eagle_pipeline.hidden_states.engines.vllm.vllm_files import EngineShardError
from eagle_pipeline.hidden_states.run import run_shard
from eagle_pipeline.hidden_states.store.format import shard_status
from eagle_pipeline.simulation.vllm_hidden_states import VLLMHiddenStatesDouble
from eagle_pipeline_tests.hidden_states.conftest import make_rows, write_merged

from .conftest import MAX_MODEL_LEN
from .server import VOCAB
from .test_real_vllm_contract import IDS, json_shape, not_in_real

pytestmark = pytest.mark.real_vllm

NOT_AN_EXTRACTION_SERVER = "no kv_transfer_params.hidden_states_path in the response"


@pytest.fixture(scope="module")
def plain_double(real_vllm_plain, tmp_path_factory) -> Iterator[VLLMHiddenStatesDouble]:
    """The hidden-states double serving the same checkpoint under the same name, configured as a plain server."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(real_vllm_plain.model_dir, dtype=torch.float32).eval()
    with VLLMHiddenStatesDouble(
        model,
        layer_ids=(2, 4, 5, 8),
        storage_path=tmp_path_factory.mktemp("plain_double_storage"),
        served_model_name=str(real_vllm_plain.model_dir),
        max_model_len=MAX_MODEL_LEN,
        faults={"no_kv_transfer_params": 1.0},
    ) as srv:
        yield srv


def test_plain_server_answers_the_states_request_like_the_plain_double(real_vllm_plain, plain_double):
    body = {"prompt": IDS, "max_tokens": 1, "return_token_ids": True}  # what ShardRequests sends for a row
    real = httpx.post(f"{real_vllm_plain.url}/v1/completions", json=body, timeout=120.0)
    double = httpx.post(f"{plain_double.url}/v1/completions", json=body, timeout=120.0)
    assert real.status_code == double.status_code == 200  # no refusal: the failure is a field that is null
    r, d = real.json(), double.json()
    assert "kv_transfer_params" in r and r["kv_transfer_params"] is None
    assert "kv_transfer_params" in d and d["kv_transfer_params"] is None
    assert r["choices"][0]["prompt_token_ids"] == d["choices"][0]["prompt_token_ids"] == IDS
    assert not_in_real(json_shape(d), json_shape(r)) == []
    assert not list(real_vllm_plain.storage.glob("*"))  # the plain server writes no states anywhere


def _shard_error(config: Path, endpoint: str, tmp_path: Path) -> tuple[str, Path]:
    """Run a one-row shard through `engine: vllm` at `endpoint` (one row: which row fails first is then not a race);
    return its error and the shard directory."""
    rows = make_rows(1, seed=5, min_len=4, max_len=40)
    merged = write_merged(tmp_path / "merged", rows, [1])
    h = load_config(config).hidden_states
    h = dataclasses.replace(h, shard_size=len(rows), vllm=dataclasses.replace(h.vllm, endpoints=[endpoint]))
    out = tmp_path / "shards"
    with pytest.raises(EngineShardError) as err:
        run_shard(h, ExtractionPaths(merged, out, tmp_path / "exports"), 0, vocab_size=VOCAB)
    return str(err.value), out


def test_a_shard_against_a_plain_server_fails_alike_naming_server_shard_and_row(
    real_vllm_plain, plain_double, tmp_path
):
    real_msg, real_out = _shard_error(real_vllm_plain.config, real_vllm_plain.url, tmp_path / "real")
    double_msg, double_out = _shard_error(real_vllm_plain.config, plain_double.url, tmp_path / "double")
    for msg, url, out in ((real_msg, real_vllm_plain.url, real_out), (double_msg, plain_double.url, double_out)):
        assert f"(endpoint {url}, attempt 1 of " in msg  # the server; failed at once, retrying cannot help
        assert msg.startswith("shard 00000, merged row 0 (B1-5-0000): ")  # the shard, the row and its sample
        assert NOT_AN_EXTRACTION_SERVER in msg and "eagle-pipeline vllm-command" in msg  # why, and what to do
        assert shard_status(out, 0) != "done" and not list(out.glob("*.safetensors"))  # nothing kept
    assert real_msg.replace(real_vllm_plain.url, "URL") == double_msg.replace(plain_double.url, "URL")


def test_vllm_smoke_against_a_plain_server_fails_naming_it(real_vllm_plain, capsys):
    assert main(["vllm-smoke", "--config", str(real_vllm_plain.config)]) != 0
    err = capsys.readouterr().err
    assert f"FAILED against {real_vllm_plain.url}" in err and NOT_AN_EXTRACTION_SERVER in err
