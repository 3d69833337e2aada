"""`engine: vllm` with `quantize: fp8` (layout speculators): the client quantizes each bf16 connector file while it
validates it, in the one read of the file. Read back through a reader written from speculators' FP8 contract,
within e4m3's bound of the bf16 states the same servers give; the project's readers and checks; a changed
`quantize` refused or redone; and every layout's shard run opens each connector file once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from safetensors.torch import load_file

from eagle_pipeline.hidden_states.checks.verify import verify_shard
from eagle_pipeline.hidden_states.engines.vllm.vllm_files import vllm_layer_ids
from eagle_pipeline.hidden_states.layouts.trainer_layouts import load_sample, plan_layout_target
from eagle_pipeline.hidden_states.models.layers import default_aux_layers
from eagle_pipeline.hidden_states.store import fp8
from eagle_pipeline.hidden_states.store.format import shard_status
from eagle_pipeline.hidden_states.store.shards import ShardMismatchError
from eagle_pipeline.simulation.vllm_hidden_states import VLLMHiddenStatesDouble
from eagle_pipeline_tests.doubles.speculators_fp8 import load_fp8_sample, trainer_inputs
from eagle_pipeline_tests.hidden_states.engine_runs import vllm_shard

from .conftest import make_rows

BF16 = torch.bfloat16


def _run(model, merged: Path, root: Path, url: str, storage: Path, layout: str, quantize: str, **kw):
    """Shard 0 (all rows) through the vLLM engine into `root`/exports/`layout`, the shards in `root`/hs."""
    cfg = model.config
    target = plan_layout_target(layout, root / "exports" / layout, merged, quantize=quantize)
    return vllm_shard(
        merged,
        shard_index=0,
        shard_size=8,
        out_dir=root / "hs",
        endpoints=[url],
        storage_path=storage,
        num_layers=cfg.num_hidden_layers,
        aux_layers=default_aux_layers(cfg.num_hidden_layers),
        hidden_size=cfg.hidden_size,
        timeout_s=30.0,
        backoff_base_s=0.01,
        layout_target=target,
        quantize=quantize,
        **kw,
    )


def _server(model, storage: Path) -> VLLMHiddenStatesDouble:
    n = model.config.num_hidden_layers
    return VLLMHiddenStatesDouble(model, layer_ids=vllm_layer_ids(default_aux_layers(n), n), storage_path=storage)


@pytest.fixture(scope="module")
def both(normed_model, tmp_path_factory):
    """The same rows through the same server double, in layout speculators, bf16 (the connector's files as they are)
    and fp8 (quantized by the client). The double serves the model in bf16, as a vLLM server of Kimi does."""
    import copy

    from .conftest import write_merged

    normed_model = copy.deepcopy(normed_model).to(BF16)
    tmp = tmp_path_factory.mktemp("vllm_fp8")
    merged = write_merged(tmp / "merged", make_rows(8, seed=23, min_len=3, max_len=40), [6, 2])
    storage = tmp / "connector"
    with _server(normed_model, storage) as srv:
        _run(normed_model, merged, tmp / "bf16", srv.url, storage, "speculators", "none")
        s = _run(normed_model, merged, tmp / "fp8", srv.url, storage, "speculators", "fp8")
    assert list(storage.iterdir()) == []  # every bf16 connector file deleted once quantized
    return merged, tmp / "bf16", tmp / "fp8", s


def test_vllm_fp8_hs_files_read_through_speculators_contract_within_e4m3_bound(both):
    _merged, ref, got, summary = both
    assert summary.fingerprint["quantize"] == "fp8" and summary.fingerprint["layout"] == "speculators"
    files = sorted((got / "exports" / "speculators" / "hidden_states").glob("hs_*.safetensors"))
    assert len(files) == 8
    fp8_bytes = bf16_bytes = 0
    for path in files:
        want = load_file(ref / "exports" / "speculators" / "hidden_states" / path.name)
        raw = load_file(path)
        assert set(raw) == {"hidden_states", "hidden_states_scales", "token_ids"}
        assert tuple(raw["hidden_states_scales"].shape) == (*raw["hidden_states"].shape[:2], 1)  # per token per layer
        sample = load_fp8_sample(path)
        assert raw["token_ids"].dtype == torch.int64 and torch.equal(sample["token_ids"], want["token_ids"])
        assert want["hidden_states"].dtype == BF16  # what the server's connector wrote
        for layer in range(want["hidden_states"].shape[1]):
            x = want["hidden_states"][:, layer]
            err = (sample["hidden_states"][:, layer].float() - x.float()).abs()
            bound = fp8.error_bound(x, raw["hidden_states_scales"][:, layer], BF16)
            assert bool((err <= bound).all()), (path.name, layer, float((err - bound).max()))
            assert float(err.max()) > 0  # really quantized, not a bf16 copy
        assert trainer_inputs(sample)["hidden_states"].shape[1] == 3 * want["hidden_states"].shape[2]
        fp8_bytes += path.stat().st_size
        bf16_bytes += (ref / "exports" / "speculators" / "hidden_states" / path.name).stat().st_size
    assert fp8_bytes < 0.6 * bf16_bytes


def test_vllm_fp8_through_the_project_readers_and_checks(both):
    merged, ref, got, _summary = both
    assert shard_status(got / "hs", 0, check_hash=True) == "done"
    assert all(r.passed for r in verify_shard(got / "hs", 0, merged).values())
    for sid in plan_layout_target("speculators", got / "exports" / "speculators", merged).file_of:
        a, b = load_sample(got / "hs", sid), load_sample(ref / "hs", sid)
        assert a["aux_hidden_states"].dtype == torch.float32  # dequantized by the project's reader
        x = b["final_hidden_state"].float()
        assert float((a["final_hidden_state"] - x).abs().max()) <= 2**-4 * float(x.abs().max()) + 1e-6


def test_vllm_fp8_in_the_shards_layout_is_read_back_within_e4m3_bound(normed_model, merged_factory, tmp_path):
    """`layout: shards` with `quantize: fp8` through the vLLM engine: the one shard writer quantizes the served
    states; the project's readers dequantize them within e4m3's bound of the same servers' bf16 shard."""
    merged = merged_factory(make_rows(4, seed=6, min_len=3, max_len=20))
    storage = tmp_path / "connector"
    with _server(normed_model, storage) as srv:
        summaries = {
            q: _run(normed_model, merged, tmp_path / q, srv.url, storage, "shards", q) for q in ("none", "fp8")
        }
    assert summaries["fp8"].fingerprint["quantize"] == "fp8"
    assert summaries["fp8"].size_bytes < 0.6 * summaries["none"].size_bytes
    got, ref = tmp_path / "fp8" / "hs", tmp_path / "none" / "hs"
    assert shard_status(got, 0, check_hash=True) == "done"
    assert all(r.passed for r in verify_shard(got, 0, merged).values())
    for row in make_rows(4, seed=6, min_len=3, max_len=20):
        a, b = load_sample(got, row["sample_id"]), load_sample(ref, row["sample_id"])
        for key in ("aux_hidden_states", "final_hidden_state"):
            x = b[key].float()
            assert a[key].dtype == torch.float32 and bool((a[key] != x).any())  # dequantized, really quantized
            assert bool(((a[key] - x).abs() <= fp8.E4M3_RELATIVE_ERROR * x.abs() + 1e-3).all()), key


def test_changing_quantize_makes_done_vllm_shards_stale_naming_the_setting(normed_model, merged_factory, tmp_path):
    merged = merged_factory(make_rows(4, seed=9, min_len=3, max_len=20))
    storage = tmp_path / "connector"
    with _server(normed_model, storage) as srv:
        _run(normed_model, merged, tmp_path, srv.url, storage, "speculators", "fp8")
        with pytest.raises(ShardMismatchError, match="quantize"):
            _run(normed_model, merged, tmp_path, srv.url, storage, "speculators", "none")
        s = _run(normed_model, merged, tmp_path, srv.url, storage, "speculators", "none", on_mismatch="redo")
    assert s.fingerprint["quantize"] == "none" and shard_status(tmp_path / "hs", 0) == "done"
    hs0 = tmp_path / "exports" / "speculators" / "hidden_states" / "hs_0.safetensors"
    assert load_file(hs0)["hidden_states"].dtype == torch.float32  # the served dtype again, not e4m3
    assert (tmp_path / "hs" / "superseded").is_dir()


_OPENED: list[str] | None = None  # files opened through Python while a test records them


def _record(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], str | Path):
        _OPENED.append(str(args[0]))


sys.addaudithook(_record)  # an audit hook cannot be removed: it records only while _OPENED is a list


@pytest.mark.parametrize(
    "layout, quantize",
    [("shards", "none"), ("shards", "fp8"), ("speculators", "none"), ("speculators", "fp8"), ("specforge", "none")],
)
def test_every_layout_reads_each_connector_file_once(
    layout, quantize, normed_model, merged_factory, monkeypatch, tmp_path
):
    """Each connector file is opened once in a whole shard run: through Python (the audit hook sees the one mapping)
    and never through safetensors' own reader (`safe_open`, `load_file` count separately: Rust opens no Python
    file)."""
    global _OPENED
    merged = merged_factory(make_rows(6, seed=4, min_len=3, max_len=30))
    storage = tmp_path / "connector"
    rust_reads: list[str] = []
    for module in (safetensors, safetensors.torch):
        real = module.safe_open

        def counted(path, *a, _real=real, **kw):
            rust_reads.append(str(path))
            return _real(path, *a, **kw)

        monkeypatch.setattr(module, "safe_open", counted)
    ckpt = tmp_path / "ckpt"  # SpecForge's post-norm state needs the checkpoint's final norm
    normed_model.save_pretrained(ckpt)
    with _server(normed_model, storage) as srv:
        _OPENED = []
        try:
            _run(normed_model, merged, tmp_path, srv.url, storage, layout, quantize, head_checkpoint=ckpt)
            opened = list(_OPENED)
        finally:
            _OPENED = None
        assert srv.total_requests == 6
    connector = [p for p in opened if p.startswith(str(storage)) and p.endswith(".safetensors")]
    assert len(connector) == 6 and len(set(connector)) == 6, connector  # six rows, six files, each opened once
    assert [p for p in rust_reads if p.startswith(str(storage))] == []
    assert shard_status(tmp_path / "hs", 0, check_hash=True) == "done" and list(storage.iterdir()) == []


def test_with_fp8_the_connector_s_bf16_files_count_at_their_peak(merged_factory, tmp_path):
    """With `quantize: fp8` no connector file is renamed into hs_{i} (the client writes the FP8 file beside it), so
    the disk plan counts the connector's peak even on the exports' filesystem, at the servers' 2 B a value."""
    from eagle_pipeline.hidden_states.engines.engine import ExtractionPaths
    from eagle_pipeline.hidden_states.plan.disk_plan import FP8_SCALE_BYTES, StateShape, connector_file_bytes
    from eagle_pipeline.hidden_states.run import disk_inputs
    from eagle_pipeline.hidden_states.settings import HiddenStatesConfig

    merged = merged_factory(make_rows(4, seed=2, min_len=3, max_len=20))
    paths = ExtractionPaths(merged, tmp_path / "hs", tmp_path / "exports")
    vllm = {"endpoints": ["http://gpu-node-0:8000"], "storage_path": str(tmp_path / "connector")}
    for quantize, counted in (("none", False), ("fp8", True)):
        settings = HiddenStatesConfig(engine="vllm", layout="speculators", quantize=quantize, vllm=vllm)
        assert disk_inputs(settings, paths).scratch_counted is counted, quantize
    bf16, fp8_shape = StateShape(4, 7168, 2), StateShape(4, 7168, 1, FP8_SCALE_BYTES)
    assert connector_file_bytes(fp8_shape, 1000) == connector_file_bytes(bf16, 1000)


def test_the_settings_take_fp8_with_vllm_and_refuse_what_is_not_built_naming_the_setting():
    from eagle_pipeline.hidden_states.settings import HiddenStatesConfig

    vllm = {"endpoints": ["http://gpu-node-0:8000"]}

    def problems(**data):
        return HiddenStatesConfig.rule_problems({"engine": "vllm", "vllm": vllm, "quantize": "fp8", **data})

    assert problems(layout="speculators") == [] and problems(layout="shards") == []
    ((where, why),) = problems(layout="specforge")
    assert where == ("quantize",) and "specforge has no fp8 reader" in why
    ((where, why),) = problems(layout="speculators", trainer_layouts=["specforge"])
    assert where == ("trainer_layouts",) and "specforge has no fp8 reader" in why
