"""verify_shard catches injected NaN, wrong shapes, missing tensors and id/mask mismatches."""

from __future__ import annotations

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle_pipeline.hidden_states.checks.verify import verify_shard
from eagle_pipeline.hidden_states.run import extract_shard

from .conftest import make_rows, write_merged


@pytest.fixture
def shard(tiny_ds, tmp_path):
    rows = make_rows(9, seed=21)
    merged = write_merged(tmp_path / "merged", rows, [4, 5])
    out = tmp_path / "hs"
    s = extract_shard(tiny_ds, merged, shard_index=0, shard_size=9, out_dir=out, max_tokens_per_batch=96)
    return rows, merged, out, s


def _rewrite(path, edit):
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata=meta)


def test_clean_shard_passes(shard):
    rows, merged, out, _ = shard
    checks = verify_shard(out, 0, merged)
    assert set(checks) == {"shapes", "finite", "ids_match"}
    assert all(c.passed and c.checked == len(rows) and c.failing == 0 for c in checks.values())


def test_injected_nan_and_inf_fail_finite(shard):
    rows, merged, out, s = shard
    a, b = rows[1]["sample_id"], rows[6]["sample_id"]

    def edit(t):
        t[f"{a}/aux_hidden_states"][0, 5] = float("nan")
        t[f"{b}/final_hidden_state"][-1, 0] = float("inf")

    _rewrite(s.path, edit)
    checks = verify_shard(out, 0, merged)
    assert not checks["finite"].passed and checks["finite"].failing == 2
    assert sorted(checks["finite"].failing_sample_ids) == sorted([a, b])
    assert checks["shapes"].passed and checks["ids_match"].passed


def test_wrong_shape_and_missing_tensor_fail_shapes(shard):
    rows, merged, out, s = shard
    a, b = rows[0]["sample_id"], rows[3]["sample_id"]

    def edit(t):
        t[f"{a}/final_hidden_state"] = t[f"{a}/final_hidden_state"][:-1].clone()
        del t[f"{b}/aux_hidden_states"]

    _rewrite(s.path, edit)
    checks = verify_shard(out, 0, merged)
    assert not checks["shapes"].passed and checks["shapes"].failing == 2
    assert sorted(checks["shapes"].failing_sample_ids) == sorted([a, b])
    assert "final_hidden_state" in checks["shapes"].detail


def test_ids_and_mask_mismatch_against_merged(shard, tmp_path):
    rows, merged, out, _ = shard
    a, b = rows[2]["sample_id"], rows[7]["sample_id"]
    rows[2]["input_ids"][0] = rows[2]["input_ids"][0] % 200 + 1  # always a different id
    rows[7]["loss_mask"][0] = 1 - rows[7]["loss_mask"][0]
    write_merged(merged, rows, [4, 5])
    checks = verify_shard(out, 0, merged)
    assert not checks["ids_match"].passed and checks["ids_match"].failing == 2
    assert sorted(checks["ids_match"].failing_sample_ids) == sorted([a, b])
    assert "input_ids differ" in checks["ids_match"].detail and "loss_mask differs" in checks["ids_match"].detail
    assert checks["shapes"].passed and checks["finite"].passed


def test_merged_row_replaced_is_reported(shard):
    rows, merged, out, _ = shard
    old = rows[4]["sample_id"]
    rows[4]["sample_id"] = "someone-else"
    write_merged(merged, rows, [4, 5])
    checks = verify_shard(out, 0, merged)
    assert not checks["ids_match"].passed
    assert set(checks["ids_match"].failing_sample_ids) == {old, "someone-else"}


def test_the_check_registry_names_every_result_once(shard):
    """Each of the seven checks the UI shows reads one result that verify_shard or the semantic audit produces."""
    from eagle_pipeline.hidden_states.checks.audit import AUDIT_CHECKS
    from eagle_pipeline.hidden_states.checks.registry import SHARD_CHECKS, ShardCheckContext
    from eagle_pipeline.hidden_states.engines.engine import ExtractionPaths

    _, merged, out, _ = shard
    structure = verify_shard(out, 0, merged)
    assert sorted(c.result for c in SHARD_CHECKS) == sorted([*structure, *AUDIT_CHECKS])
    assert len({c.name for c in SHARD_CHECKS}) == len(SHARD_CHECKS) == 7
    # A structural entry runs verify_shard and reads its own result (the semantic ones need a target head).
    context = ShardCheckContext(None, ExtractionPaths(merged, out, out.parent / "exports"), 0)  # type: ignore[arg-type]
    for c in SHARD_CHECKS:
        if c.result in structure:
            assert c.run(context) == structure[c.result]
