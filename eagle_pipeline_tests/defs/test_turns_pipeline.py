"""`regenerate: all_turns` through the real Dagster assets: configuration -> responses (one row per turn, from the
simulated server on loopback) -> token samples with every audit check passing -> the schedule sees the dataset
complete -> the merge keeps each conversation in one split and `loss_on: all_turns` folds verbatim turns."""

from __future__ import annotations

import dagster as dg
import pyarrow.parquet as pq
import pytest
import yaml

from eagle_pipeline.definitions import build_defs
from eagle_pipeline.generation.plan.turns import END_REASONS
from eagle_pipeline.generation.store.shards import read_responses
from eagle_pipeline.merge import MergeManifest
from eagle_pipeline.merge.reader import read_merged
from eagle_pipeline.shared.storage import DataRoot

from .test_current_inputs import _schedule

pytestmark = pytest.mark.slow


def test_all_turns_end_to_end(pipeline_config, instance, tmp_path):
    path = pipeline_config(datasets=("B5",), limit=12, simulated={"tool_call_rate": 1.0, "tool_rounds": 3})
    raw = yaml.safe_load(path.read_text())
    raw["datasets"][0]["regenerate"] = "all_turns"
    raw["merge"].update(loss_on="all_turns", eval_fraction=0.5, dedup=False)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    defs = build_defs()
    root = DataRoot(tmp_path / "data")

    result = defs.resolve_job_def("EAGLE_dataset").execute_in_process(
        instance=instance, partition_key="B5", raise_on_error=False
    )
    assert result.success
    checks = {e.asset_check_key.name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks and all(checks.values()), checks

    prompts = pq.read_table(root.prompts("B5")).column("sample_id").to_pylist()
    responses = read_responses(root.responses_dir("B5")).to_pylist()
    assert {r["conversation_id"] for r in responses} == set(prompts)
    assert len(responses) > len(prompts)  # the conversations with earlier assistant turns gave several rows
    for conv in prompts:
        turns = sorted(r["turn_index"] for r in responses if r["conversation_id"] == conv)
        assert turns == list(range(len(turns)))
        ends = [r["conversation_end"] for r in responses if r["conversation_id"] == conv]
        assert sum(e is not None for e in ends) == 1 and {e for e in ends if e} <= set(END_REASONS)
    meta = instance.fetch_materializations(dg.AssetKey("responses"), limit=1).records[0].asset_materialization.metadata
    ends = [r["conversation_end"] for r in responses if r["conversation_end"]]
    assert meta["conversation_ends"].value == {e: ends.count(e) for e in set(ends)} and len(ends) == len(prompts)
    # The live report's last figures are the final metadata's: conversations and turn rows, each under its key.
    observed = instance.fetch_observations(dg.AssetKey("responses"), limit=1).records[0].asset_observation.metadata
    for key, want in [
        ("current_prompts", len(prompts)),
        ("current_prompts_answered", len(prompts)),
        ("already_done", 0),
        ("response_rows", len(responses)),
        ("completed_this_run", len(responses)),
        ("failed_this_run", 0),
    ]:
        assert observed[key].value == meta[key].value == want, key
    assert meta["dagster/row_count"].value == len(responses)
    tokens = pq.read_table(root.tokens("B5"))
    assert sorted(tokens.column("sample_id").to_pylist()) == sorted(r["sample_id"] for r in responses)
    assert "every dataset is complete" in _schedule(instance)

    merged = defs.resolve_job_def("EAGLE_merge").execute_in_process(instance=instance, raise_on_error=False)
    assert merged.success
    rows = read_merged(root.merged_dir).to_pylist()
    manifest = MergeManifest.read(root.merged_dir)
    split_of: dict[str, set[str]] = {}
    for r in rows:
        split_of.setdefault(r["sample_id"].rsplit("-t", 1)[0], set()).add(r["split"])
    assert all(len(s) == 1 for s in split_of.values())
    assert manifest.excluded["B5"]["folded"] > 0 and len(rows) == len(responses) - manifest.excluded["B5"]["folded"]
    assert manifest.supervised_tokens_total == sum(
        len(ids) for ids in tokens.column("output_ids").to_pylist()
    )  # every turn supervised exactly once, folded or not
