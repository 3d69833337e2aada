"""The `eagle-pipeline` CLI, run as a subprocess: reconstruct JSONL responses, audit the result, exit statuses."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle_pipeline.cli import main
from eagle_pipeline.tokens import TOKEN_SAMPLES_SCHEMA, get_profile, load_tokenizer, reconstruct_output
from eagle_pipeline.tokens.text_hash import text_hash_int64

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "eagle_pipeline.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def body(reasoning, content, *, tool_calls=None, finish="stop", usage=None, provider="Moonshot", field="reasoning"):
    msg = {"role": "assistant", "content": content, field: reasoning}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    out = {
        "id": "gen-1",
        "provider": provider,
        "model": "moonshotai/kimi-k2.5",
        "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
    }
    if usage is not None:
        out["usage"] = {"prompt_tokens": 10, "completion_tokens": usage, "total_tokens": 10 + usage}
    return out


CALL = [
    {
        "id": "functions.get_weather:0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
]


@pytest.fixture(scope="module")
def kimi(kimi_dir):
    tok = load_tokenizer(kimi_dir)
    return kimi_dir, tok, get_profile("kimi-k2.5").resolve(tok)


def _lines(tok, ids, *, bad_usage: bool = False):
    """Responses whose usage equals the reconstructed length (or is 30% high with bad_usage)."""
    specs = [
        ("s1", "Let me think.", "Hello!", None, "stop", "reasoning", "B1", None),
        (
            "s2",
            "需要查天气。",
            "",
            CALL,
            "tool_calls",
            "reasoning_content",
            "B2",
            [{"type": "function", "function": {"name": "get_weather"}}],
        ),
        ("s3", "Quick check 🚀", "Literal <|im_end|> in text.", None, "stop", "reasoning", "B1", None),
        ("s4", "Long", "cut mid-sent", None, "length", "reasoning", "B1", None),
    ]
    lines = []
    for sid, r, c, calls, finish, field, ds, tools in specs:
        n = len(reconstruct_output(tok, ids, reasoning=r, content=c, tool_calls=calls).ids)
        usage = round(n * 1.3) if bad_usage else n
        line = {
            "sample_id": sid,
            "dataset": ds,
            "response": body(r, c, tool_calls=calls, finish=finish, usage=usage, field=field),
        }
        if tools:
            line["tools"] = tools
        lines.append(line)
    # One body given as the raw text the API returned.
    lines[0]["response"] = json.dumps(lines[0]["response"])
    return lines


def _write(path: Path, lines) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x, ensure_ascii=False)) + "\n" for x in lines))
    return path


def test_reconstruct_then_audit(kimi, tmp_path):
    kdir, tok, ids = kimi
    src = _write(tmp_path / "responses.jsonl", _lines(tok, ids))
    out = tmp_path / "tokens.parquet"
    res = run_cli("reconstruct", "--tokenizer", str(kdir), "--in", str(src), "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "wrote 4 token samples (4 reconstructed, 0 returned ids)" in res.stdout
    table = pq.read_table(out)
    assert table.schema.equals(TOKEN_SAMPLES_SCHEMA)
    rows = {r["sample_id"]: r for r in table.to_pylist()}
    assert list(rows) == ["s1", "s2", "s3", "s4"]
    assert rows["s1"]["output_ids"] == [9413, 1019, 2704, 13, 163607, 19180, 0, 163586]  # FACTS.md pin
    assert rows["s1"]["prompt_ids"] == [] and rows["s1"]["provider"] == "Moonshot"
    assert (
        rows["s2"]["output_ids"]
        == reconstruct_output(tok, ids, reasoning="需要查天气。", content="", tool_calls=CALL).ids
    )
    assert rows["s2"]["n_tool_calls"] == 1 and rows["s2"]["dataset_has_tools"] and not rows["s1"]["dataset_has_tools"]
    assert rows["s3"]["literal_special"] and rows["s4"]["finish_reason"] == "length"
    assert len({r["prompt_key"] for r in rows.values()}) == 4  # no prompt given: keys must not collide
    # The digest of the text the ids must decode to, computed from the response text.
    assert rows["s1"]["output_text_hash"] == text_hash_int64("Let me think.</think>Hello!<|im_end|>")
    for r in rows.values():
        assert r["output_text_hash"] == text_hash_int64(tok.decode_bytes(r["output_ids"]))

    report_path = tmp_path / "report.json"
    kept = tmp_path / "kept.parquet"
    res = run_cli(
        "audit", "--tokenizer", str(kdir), "--in", str(out), "--report", str(report_path), "--kept-out", str(kept)
    )
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(report_path.read_text())
    assert report["passed"] is True and report["blocking_failed"] == []
    gates = report["gates"]
    assert gates["not_truncated"]["failing"] == 1 and gates["not_truncated"]["failing_sample_ids"] == ["s4"]
    assert gates["not_truncated"]["action"] == "filter" and report["excluded_counts"] == {"not_truncated": 1}
    assert all(g["failing"] == 0 for name, g in gates.items() if name != "not_truncated")
    assert {"checked", "failing", "failing_sample_ids", "action", "passed"} <= set(gates["round_trip"])
    assert gates["text_agreement"]["checked"] == 4 and gates["text_agreement"]["action"] == "block"
    assert pq.read_table(kept).column("sample_id").to_pylist() == ["s1", "s2", "s3"]
    assert "not_truncated" in res.stdout and "PASSED" in res.stdout


def test_audit_blocks_on_billing_and_set_overrides(kimi, tmp_path):
    kdir, tok, ids = kimi
    src = _write(tmp_path / "responses.jsonl", _lines(tok, ids, bad_usage=True))
    out = tmp_path / "tokens.parquet"
    assert run_cli("reconstruct", "--tokenizer", str(kdir), "--in", str(src), "--out", str(out)).returncode == 0
    report_path = tmp_path / "report.json"
    res = run_cli("audit", "--tokenizer", str(kdir), "--in", str(out), "--report", str(report_path))
    assert res.returncode == 1, res.stdout + res.stderr
    report = json.loads(report_path.read_text())
    assert report["blocking_failed"] == ["billing_agreement"]
    assert report["gates"]["billing_agreement"]["details"]["aggregate_relative_error"] > 0.2
    assert "import/Moonshot" in report["gates"]["billing_agreement"]["by_source"]

    res = run_cli(
        "audit",
        "--tokenizer",
        str(kdir),
        "--in",
        str(out),
        "--report",
        str(report_path),
        "--set",
        "billing_agreement=warn",
        "--set",
        "not_truncated@reconstructed=block",
    )
    assert res.returncode == 1
    assert json.loads(report_path.read_text())["blocking_failed"] == ["not_truncated"]
    res = run_cli(
        "audit",
        "--tokenizer",
        str(kdir),
        "--in",
        str(out),
        "--report",
        str(report_path),
        "--set",
        "billing_aggregate_bound=0.5",
        "--set",
        "billing_row_rel_tolerance=0.5",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(report_path.read_text())["settings"]["billing_aggregate_bound"] == 0.5


def _reconstruct(kdir, tok, ids, tmp_path) -> Path:
    src = _write(tmp_path / "responses.jsonl", _lines(tok, ids))
    out = tmp_path / "tokens.parquet"
    res = run_cli("reconstruct", "--tokenizer", str(kdir), "--in", str(src), "--out", str(out))
    assert res.returncode == 0, res.stderr
    return out


def test_audit_blocks_an_id_off_by_one(kimi, tmp_path):
    """One ordinary id moved by one ("me" -> "un") is still canonical BPE, so round_trip passes it; the text digest
    recorded at reconstruction does not match, and text_agreement blocks."""
    kdir, tok, ids = kimi
    out = _reconstruct(kdir, tok, ids, tmp_path)
    table = pq.read_table(out)
    outputs = table.column("output_ids").to_pylist()
    outputs[0][1] += 1
    tampered = tmp_path / "tampered.parquet"
    pq.write_table(
        table.set_column(
            table.schema.get_field_index("output_ids"), "output_ids", pa.array(outputs, pa.list_(pa.int32()))
        ),
        tampered,
    )
    report_path = tmp_path / "report.json"
    res = run_cli("audit", "--tokenizer", str(kdir), "--in", str(tampered), "--report", str(report_path))
    assert res.returncode == 1, res.stdout + res.stderr
    report = json.loads(report_path.read_text())
    assert report["blocking_failed"] == ["text_agreement"]
    gate = report["gates"]["text_agreement"]
    assert gate["failing_sample_ids"] == ["s1"] and gate["details"]["problems"] == {"digest_mismatch": 1}
    assert report["gates"]["round_trip"]["failing"] == 0
    assert "text_agreement" in res.stdout and "BLOCKED by text_agreement" in res.stdout
    res = run_cli(
        "audit",
        "--tokenizer",
        str(kdir),
        "--in",
        str(tampered),
        "--report",
        str(report_path),
        "--set",
        "text_agreement=warn",
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_audit_of_a_file_without_digests(kimi, tmp_path):
    """Token samples written before output_text_hash existed still audit; text_agreement then checks nothing."""
    kdir, tok, ids = kimi
    out = _reconstruct(kdir, tok, ids, tmp_path)
    old = tmp_path / "old.parquet"
    pq.write_table(pq.read_table(out).drop_columns(["output_text_hash"]), old)
    report_path = tmp_path / "report.json"
    res = run_cli("audit", "--tokenizer", str(kdir), "--in", str(old), "--report", str(report_path))
    assert res.returncode == 0, res.stdout + res.stderr
    gate = json.loads(report_path.read_text())["gates"]["text_agreement"]
    assert gate["checked"] == 0 and gate["details"]["digest_column"] == "absent"
    assert "no output_text_hash column" in res.stderr


def test_returned_ids_are_kept(tmp_path):
    """A vLLM body with token ids keeps them (ids_origin 'returned'); the demo tokenizer needs no files."""
    b = body("r", "c", usage=3)
    b["prompt_token_ids"] = [1, 2, 3]
    b["choices"][0]["token_ids"] = [100, 2327, 101, 2306]
    src = _write(
        tmp_path / "r.jsonl", [{"sample_id": "v1", "response": b, "messages": [{"role": "user", "content": "hi"}]}]
    )
    out = tmp_path / "t.parquet"
    res = run_cli("reconstruct", "--tokenizer", "demo", "--in", str(src), "--out", str(out), "--dataset", "B7")
    assert res.returncode == 0, res.stderr
    row = pq.read_table(out).to_pylist()[0]
    assert row["ids_origin"] == "returned" and row["output_ids"] == [100, 2327, 101, 2306]
    assert row["prompt_ids"] == [1, 2, 3] and row["dataset"] == "B7"
    assert row["output_text_hash"] is None  # the server's text is not the exact decoding of its ids
    assert not row["prompt_key"].startswith("sample:")


def test_prompt_rendered_from_messages(tmp_path):
    from eagle_pipeline.tokens import build_demo_tokenizer

    msgs = [{"role": "user", "content": "Hi"}]
    src = _write(tmp_path / "r.jsonl", [{"sample_id": "m1", "response": body("r", "c", usage=None), "messages": msgs}])
    out = tmp_path / "t.parquet"
    assert run_cli("reconstruct", "--tokenizer", "demo", "--in", str(src), "--out", str(out)).returncode == 0
    tok = build_demo_tokenizer()
    prompt = tok.decode(pq.read_table(out).column("prompt_ids")[0].as_py())
    assert prompt == "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>"


@pytest.mark.parametrize(
    "lines, fragment",
    [
        ([json.dumps({"sample_id": "a", "response": body("r", "c")}), "not json"], "r.jsonl:2: invalid JSON"),
        (['{"response": {}}'], "r.jsonl:1: 'sample_id' must be a non-empty string"),
        (['{"sample_id": "a", "response": 5}'], "r.jsonl:1: 'response' must be the chat-completion body"),
        (
            ['{"sample_id": "a", "response": {"error": {"code": 502, "message": "upstream"}}}'],
            "r.jsonl:1: unusable response",
        ),
        (['{"sample_id": "a", "response": {"choices": []}}'], "r.jsonl:1: unusable response"),
        (
            [
                json.dumps({"sample_id": "a", "response": body("r", "c")}),
                json.dumps({"sample_id": "a", "response": body("r", "c")}),
            ],
            "r.jsonl:2: duplicate sample_id 'a' (first on line 1)",
        ),
        (
            [
                json.dumps(
                    {"sample_id": "a", "response": body("r", "c", tool_calls=[{"function": {"arguments": "{}"}}])}
                )
            ],
            "r.jsonl:1: cannot reconstruct",
        ),
        ([json.dumps({"sample_id": "a", "response": body("r", "c"), "tools": "yes"})], "r.jsonl:1: 'tools' must be"),
    ],
)
def test_reconstruct_input_errors(tmp_path, lines, fragment):
    src = _write(tmp_path / "r.jsonl", lines)
    res = run_cli("reconstruct", "--tokenizer", "demo", "--in", str(src), "--out", str(tmp_path / "o.parquet"))
    assert res.returncode == 2, res.stdout + res.stderr
    assert fragment in res.stderr
    assert not (tmp_path / "o.parquet").exists()


def test_skip_unusable(tmp_path):
    src = _write(
        tmp_path / "r.jsonl",
        [
            {"sample_id": "a", "response": {"error": {"code": 502, "message": "upstream"}}},
            {"sample_id": "b", "response": body("r", "c")},
        ],
    )
    res = run_cli(
        "reconstruct", "--tokenizer", "demo", "--in", str(src), "--out", str(tmp_path / "o.parquet"), "--skip-unusable"
    )
    assert res.returncode == 0, res.stderr
    assert "skipped 1 unusable lines" in res.stdout
    assert pq.read_table(tmp_path / "o.parquet").column("sample_id").to_pylist() == ["b"]


def test_audit_usage_errors(tmp_path, capsys):
    src = _write(tmp_path / "r.jsonl", [{"sample_id": "b", "response": body("r", "c")}])
    tokens = tmp_path / "t.parquet"
    assert run_cli("reconstruct", "--tokenizer", "demo", "--in", str(src), "--out", str(tokens)).returncode == 0
    rep = str(tmp_path / "rep.json")
    cases = [
        (["--set", "no_such_gate=block"], "unknown gate 'no_such_gate'"),
        (["--set", "round_trip=explode"], "action 'explode'"),
        (["--set", "round_trip"], "expected KEY=VALUE"),
        (["--set", "max_examples=lots"], "max_examples needs a number"),
        (["--gates", "round_trip,bogus"], "unknown gate(s) ['bogus']"),
        (["--profile", "gpt-9"], "unknown model profile 'gpt-9'"),
    ]
    # The option matrix runs in-process (same main()); the exit paths below run as real subprocesses.
    for extra, fragment in cases:
        assert main(["audit", "--tokenizer", "demo", "--in", str(tokens), "--report", rep, *extra]) == 2, extra
        assert fragment in capsys.readouterr().err, extra
    assert not Path(rep).exists()
    res = run_cli("audit", "--tokenizer", "demo", "--in", str(tmp_path / "missing.parquet"), "--report", rep)
    assert res.returncode == 2 and "token-samples file not found" in res.stderr
    (tmp_path / "junk.parquet").write_text("not parquet")
    res = run_cli("audit", "--tokenizer", "demo", "--in", str(tmp_path / "junk.parquet"), "--report", rep)
    assert res.returncode == 2 and "not a readable Parquet file" in res.stderr
    res = run_cli("audit", "--tokenizer", str(tmp_path / "nowhere"), "--in", str(tokens), "--report", rep)
    assert res.returncode == 2 and "not found" in res.stderr
    res = run_cli("audit", "--in", str(tokens))
    assert res.returncode == 2 and "required" in res.stderr
    res = run_cli("audit", "--tokenizer", "demo", "--in", str(src), "--report", rep)  # JSONL given as parquet
    assert res.returncode == 2
    pq.write_table(pq.read_table(tokens).drop_columns(["thinking"]), tmp_path / "partial.parquet")
    res = run_cli("audit", "--tokenizer", "demo", "--in", str(tmp_path / "partial.parquet"), "--report", rep)
    assert res.returncode == 2 and "no column 'thinking'" in res.stderr


def test_retire_responses_refuses_a_dataset_without_responses_naming_the_directory(tmp_path):
    result = run_cli("retire-responses", "--dataset", "B9", "--data-root", str(tmp_path))
    assert result.returncode == 2
    assert f"{tmp_path.resolve() / 'responses' / 'B9'}: no committed responses for dataset 'B9'" in result.stderr
    assert "retire-responses" in run_cli("--help").stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_ui_with_a_configuration_typo_ends_on_the_config_error(tmp_path):
    """`make ui` stops at the first failing step; before, `export DAGSTER_HOME=$(...)` hid it and the last line on
    screen was Dagster's advice to export DAGSTER_HOME."""
    (tmp_path / "data").symlink_to(ROOT / "data")  # the file's relative prompt paths resolve beside it
    text = (ROOT / "pipeline.yaml").read_text()
    line_no = text[: text.index("\ndata_root:")].count("\n") + 2
    (tmp_path / "pipeline.yaml").write_text(text.replace("\ndata_root:", "\ndata_rooot:", 1))
    venv = Path(sys.prefix)  # this interpreter's environment; `-o venv`: not rebuilt by the test
    done = subprocess.run(
        ["make", "-s", "-o", "venv", "ui", f"VENV={venv}"],
        cwd=ROOT,
        env={**os.environ, "EAGLE_PIPELINE_CONFIG": str(tmp_path / "pipeline.yaml")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    # make's own last word: 'make: ***', or 'make[2]: ***' when the suite itself runs under `make test`.
    lines = [
        line
        for line in (done.stdout + done.stderr).splitlines()
        if line and not re.match(r"make(\[\d+\])?: \*\*\*", line)
    ]
    assert "DAGSTER_HOME" not in done.stdout + done.stderr and "Traceback" not in done.stderr
    assert lines[-2].startswith("ConfigError: ") and "1 problem(s)" in lines[-2]
    assert lines[-1].startswith("  - data_rooot: unknown key") and lines[-1].endswith(f"(line {line_no})")


def test_the_demo_summary_lists_blocking_gates_apart_from_findings_that_only_warn():
    from eagle_pipeline.demo import _audit_findings

    def gate(failing, action, blocking=False):
        return {"failing": failing, "checked": 24, "action": action, "blocking": blocking}

    report = {
        "passed": False,
        "gates": {
            "billing_agreement": gate(24, "block", blocking=True),
            "single_eot": gate(0, "block"),
            "not_truncated": gate(2, "filter"),
            "prompt_agreement": gate(3, "warn"),
        },
    }
    assert _audit_findings(report) == (
        "FAIL",
        "blocked by billing_agreement 24 of 24; not_truncated 2 (filter); prompt_agreement 3 (warn)",
    )
    assert _audit_findings({"passed": True, "gates": {"prompt_agreement": gate(3, "warn")}}) == (
        "pass",
        "prompt_agreement 3 (warn)",
    )
