"""prompt_agreement on rows whose prompt ids came from the server (issue 25, gap 1): the server's ids against the
project's render of the same messages. Comparing them with the server's own token count could never fail."""

from __future__ import annotations

import copy
import json

import numpy as np
import pyarrow as pa
import pytest

from eagle_pipeline.audit import AuditSettings, run_audit, run_gate
from eagle_pipeline.generation.run.runner import generate_dataset
from eagle_pipeline.generation.spec import BackendSpec, SamplingSpec
from eagle_pipeline.generation.store.shards import read_responses
from eagle_pipeline.prompts import Prompt, prompts_table
from eagle_pipeline.tokens import render_prompt_ids
from eagle_pipeline.tokens.samples import TOKEN_SAMPLES_SCHEMA, reconstruct_table
from eagle_pipeline_tests.doubles import SimulatedVLLMServer

SAMPLING = SamplingSpec(seed=3, max_tokens=1024)
IM_SYSTEM, IM_USER = 163594, 163587
# Kimi-K2-Thinking's template opens with a default system prompt when the conversation has none; K2.5's does not
# (FACTS.md). A server started with the older template renders those prompts differently from the project.
K2_DEFAULT_SYSTEM = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "{%- endif -%}"
)


def _prompts() -> pa.Table:
    prompts = []
    for i in range(8):
        msgs = [{"role": "user", "content": f"Question {i}: how do tides work?"}]
        if i % 2:
            msgs.insert(0, {"role": "system", "content": "Answer briefly."})
        prompts.append(Prompt(source_id=f"p{i}", messages=msgs, tools=None))
    return prompts_table("B1", prompts, SAMPLING.to_dict())


def _generate(tmp_path, tok, **server) -> pa.Table:
    prompts = _prompts()
    with SimulatedVLLMServer(tokenizer=tok, **server) as srv:
        backend = BackendSpec(name="vllm-local", kind="vllm", endpoint=srv.url, model="m", concurrency=4)
        out = tmp_path / "responses"
        s = generate_dataset(
            dataset="B1", prompts=prompts, backend=backend, sampling=SAMPLING, out_dir=out, errors_dir=out / "errors"
        )
    assert s.completed == 8
    return read_responses(out)


def test_a_server_rendering_with_another_template_fails_the_gate_naming_row_and_position(tmp_path, kimi_tok, kimi_ids):
    template = K2_DEFAULT_SYSTEM + kimi_tok.chat_template
    responses = _generate(tmp_path, kimi_tok, chat_template=template)
    samples = reconstruct_table(responses, kimi_tok, "kimi-k2.5", dataset_has_tools=False)
    rows = samples.to_pylist()
    without_system = {
        r["sample_id"] for r in responses.to_pylist() if json.loads(r["messages_json"])[0]["role"] != "system"
    }
    assert len(without_system) == 4
    # The server's own count of its own ids agrees, as on a real vLLM: only the render comparison can tell.
    assert all(r["usage_prompt_tokens"] == len(r["prompt_ids"]) for r in rows)

    report = run_audit(samples, kimi_tok, kimi_ids)
    res = report.result("prompt_agreement")
    assert res.checked == 8 and res.failing == 4 and not res.passed
    assert set(res.failing_sample_ids) == without_system
    assert res.details["render_compared_rows"] == 8 and res.details["render_differing_rows"] == 4
    assert not res.blocking and res.excluded == 0 and report.passed  # warn by default
    for ex in res.examples:
        assert ex["sample_id"] in without_system and ex["position"] == 0
        assert ex["problem"] == (
            f"prompt_ids differ from the project's render at position 0: the server has '<|im_system|>' "
            f"(id {IM_SYSTEM}), the project '<|im_user|>' (id {IM_USER}) "
            f"({len(rows[ex['row']]['prompt_ids'])} vs {len(rows[ex['row']]['rendered_prompt_ids'])} ids)"
        )
        assert (
            ex["excerpt"].startswith("server: ⟦<|im_system|>⟧system")
            and "| project: ⟦<|im_user|>⟧user" in ex["excerpt"]
        )
    # A stricter setting turns the warning into a block for rows whose ids came from the server.
    strict = run_audit(samples, kimi_tok, kimi_ids, AuditSettings(actions={"prompt_agreement@returned": "block"}))
    assert strict.blocking_failed == ["prompt_agreement"]


def test_a_server_rendering_as_the_project_does_passes_every_row(tmp_path, kimi_tok, kimi_ids):
    samples = reconstruct_table(_generate(tmp_path, kimi_tok), kimi_tok, "kimi-k2.5", dataset_has_tools=False)
    assert samples.column("prompt_render_diff").to_pylist() == [-1] * 8
    assert samples.column("rendered_prompt_ids").to_pylist() == [None] * 8  # stored only where they differ
    res = run_gate("prompt_agreement", samples, kimi_tok, kimi_ids)
    assert (res.checked, res.failing, res.details["render_differing_rows"]) == (8, 0, 0)


def test_a_prompt_the_project_cannot_render_is_reported_not_fatal(tmp_path, kimi_tok, kimi_ids, caplog):
    """The server's ids stand; a project template that cannot render the messages (here: none at all) is a
    difference the gate names per row, and the reconstruction logs why, rather than a refused dataset."""
    responses = _generate(tmp_path, kimi_tok)
    no_template = copy.copy(kimi_tok)
    no_template.chat_template = None
    samples = reconstruct_table(responses, no_template, "kimi-k2.5", dataset_has_tools=False)
    assert samples.column("prompt_ids").to_pylist() == responses.column("prompt_token_ids").to_pylist()
    assert samples.column("prompt_render_diff").to_pylist() == [0] * 8
    assert samples.column("rendered_prompt_ids").to_pylist() == [[]] * 8
    assert "cannot render messages_json/tools_json" in caplog.text
    res = run_gate("prompt_agreement", samples, kimi_tok, kimi_ids)
    assert res.failing == 8 and "cannot render this row's messages" in res.examples[0]["problem"]
    assert res.examples[0]["excerpt"].startswith("server: ⟦<|im_")


@pytest.mark.parametrize("edit", ["replace", "insert", "truncate"])
def test_a_row_whose_prompt_ids_were_changed_is_named_at_the_first_changed_position(tmp_path, kimi_tok, kimi_ids, edit):
    responses = _generate(tmp_path, kimi_tok)
    ids = responses.column("prompt_token_ids").to_pylist()
    target = 5
    original = list(ids[target])
    at = len(original) - 3  # inside the generation prompt, after the user's text
    changed = {
        "replace": original[:at] + [original[at] + 1] + original[at + 1 :],
        "insert": original[:at] + [198] + original[at:],
        "truncate": original[:at],
    }[edit]
    ids[target] = changed
    column = responses.schema.get_field_index("prompt_token_ids")
    bad = responses.set_column(column, "prompt_token_ids", pa.array(ids, pa.list_(pa.int32())))
    samples = reconstruct_table(bad, kimi_tok, "kimi-k2.5", dataset_has_tools=False)
    assert samples.column("prompt_render_diff").to_pylist() == [at if i == target else -1 for i in range(8)]
    res = run_gate("prompt_agreement", samples, kimi_tok, kimi_ids)
    assert res.failing == 1 and res.failing_sample_ids == [responses.column("sample_id")[target].as_py()]
    (ex,) = res.examples
    assert ex["row"] == target and ex["position"] == at
    ours = f"the project {kimi_tok.decode([original[at]])!r} (id {original[at]})"
    served = "the end of the prompt" if edit == "truncate" else f"id {changed[at]})"
    assert ours in ex["problem"] and served in ex["problem"]
    assert f"({len(changed)} vs {len(original)} ids)" in ex["problem"]


def test_rows_without_server_prompt_ids_keep_the_plain_schema_and_old_files_check_counts_only(kimi_tok, kimi_ids):
    """Reconstructed rows carry the project's render (nothing to compare, no extra columns); a token-samples file
    written before the render columns existed is still audited on the prompt count alone."""
    msgs = [{"role": "user", "content": "hi"}]
    responses = pa.table(
        {
            "sample_id": ["a"],
            "dataset": ["B1"],
            "source": ["openrouter"],
            "backend": ["or"],
            "messages_json": [json.dumps(msgs)],
            "content": ["Hello!"],
            "reasoning": ["Greeting."],
            "finish_reason": ["stop"],
        }
    )
    plain = reconstruct_table(responses, kimi_tok, "kimi-k2.5", dataset_has_tools=False)
    assert plain.schema.equals(TOKEN_SAMPLES_SCHEMA)
    assert {"prompt_render_diff", "rendered_prompt_ids"}.isdisjoint(plain.column_names)
    res = run_gate("prompt_agreement", plain, kimi_tok, kimi_ids)
    assert res.details["render_compared_rows"] == 0 and res.checked == 0
    assert plain.column("prompt_ids")[0].as_py() == render_prompt_ids(kimi_tok, msgs, None, thinking=True)
    assert np.all(np.asarray(plain.column("prompt_ids")[0].as_py()) >= 0)
