"""`eagle-pipeline reconstruct` and `eagle-pipeline audit`: token samples from responses, and the audit gates.

`reconstruct` writes the full token-samples schema, including `output_text_hash` (the hash of the text each
reconstructed row's ids must decode to); `audit` checks it in the `text_agreement` gate.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle_pipeline.cli.common import EXIT_BLOCKED, EXIT_OK, CliError
from eagle_pipeline.generation.importing.response_lines import ResponseLinesError, read_response_lines, responses_table


def _read_responses(path: Path, dataset: str, skip_unusable: bool) -> tuple[list[dict[str, Any]], list[int], int]:
    try:
        return read_response_lines(path, dataset, skip_unusable)
    except ResponseLinesError as exc:
        raise CliError(str(exc)) from None


def cmd_reconstruct(args: argparse.Namespace) -> int:
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from eagle_pipeline.shared.storage import write_parquet_atomic
    from eagle_pipeline.tokens import reconstruct_table

    tok, profile = _load_target(args.tokenizer, args.profile)
    src = Path(args.input)
    rows, lines, skipped = _read_responses(src, args.dataset, args.skip_unusable)
    if not rows:
        raise CliError(f"{src}: no usable responses" + (f" ({skipped} skipped)" if skipped else ""))
    # dataset_has_tools is a dataset property: a dataset declares tools when any of its lines does.
    datasets: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        datasets.setdefault(r["dataset"], []).append(i)
    parts, order = [], []
    for idx in datasets.values():
        has_tools = any(rows[i]["has_tools"] for i in idx)
        part_rows = [rows[i] for i in idx]
        try:
            parts.append(reconstruct_table(responses_table(part_rows), tok, profile, dataset_has_tools=has_tools))
        except ValueError as exc:
            raise CliError(
                _locate_failure(src, part_rows, [lines[i] for i in idx], tok, profile, has_tools, exc)
            ) from None
        order.extend(idx)
    table = pa.concat_tables(parts).take(pa.array(np.argsort(np.asarray(order), kind="stable")))
    # Without a prompt the prompt-based dedup key would merge every such row into one: key them by sample instead.
    no_prompt = [not r["has_prompt"] for r in rows]
    if any(no_prompt):
        keys = pc.if_else(
            pa.array(no_prompt),
            pc.binary_join_element_wise("sample:", table.column("sample_id"), ""),
            table.column("prompt_key"),
        )
        table = table.set_column(table.schema.get_field_index("prompt_key"), "prompt_key", keys.cast(pa.string()))
    write_parquet_atomic(table, args.output)
    origin = table.column("ids_origin").to_pylist()
    print(
        f"wrote {table.num_rows} token samples ({origin.count('reconstructed')} reconstructed, "
        f"{origin.count('returned')} returned ids) to {args.output}"
        + (f"; skipped {skipped} unusable lines" if skipped else "")
    )
    return EXIT_OK


def _locate_failure(
    src: Path, rows: list[dict[str, Any]], lines: list[int], tok: Any, profile: Any, has_tools: bool, exc: Exception
) -> str:
    """Reconstruct rows one by one to name the line of the first that fails (only on the error path)."""
    from eagle_pipeline.tokens import reconstruct_table

    for row, line in zip(rows, lines):
        try:
            reconstruct_table(responses_table([row]), tok, profile, dataset_has_tools=has_tools)
        except ValueError as one:
            return f"{src}:{line}: cannot reconstruct: {one}"
    return f"{src}: cannot reconstruct: {exc}"


def parse_set_options(items: Sequence[str]) -> dict[str, Any]:
    """`--set` values -> AuditSettings.from_dict data: GATE[@ORIGIN]=ACTION, or SETTING=VALUE for numeric settings."""
    import dataclasses

    from eagle_pipeline.audit import AuditSettings

    fields = {f.name for f in dataclasses.fields(AuditSettings)} - {"actions"}
    data: dict[str, Any] = {"actions": {}}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise CliError(f"--set {item!r}: expected KEY=VALUE, e.g. round_trip=warn or billing_aggregate_bound=0.01")
        if key in fields:
            try:
                data[key] = json.loads(value)
            except json.JSONDecodeError:
                raise CliError(f"--set {item!r}: {key} needs a number") from None
        else:
            data["actions"][key] = value
    return data


def cmd_audit(args: argparse.Namespace) -> int:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle_pipeline.audit import AuditSettings, run_audit
    from eagle_pipeline.shared.storage import write_json_atomic, write_parquet_atomic

    settings = AuditSettings.from_dict(parse_set_options(args.set or []))
    gates = [g.strip() for g in args.gates.split(",") if g.strip()] if args.gates else None
    tok, profile = _load_target(args.tokenizer, args.profile)
    src = Path(args.input)
    if not src.is_file():
        raise CliError(f"{src}: token-samples file not found")
    try:
        table = pq.read_table(src)
    except (pa.ArrowInvalid, OSError) as exc:
        raise CliError(f"{src}: not a readable Parquet file ({exc})") from None
    report = run_audit(table, tok, profile.resolve(tok), settings, gates=gates)
    if (gates is None or "text_agreement" in gates) and "output_text_hash" not in table.column_names:
        print(
            f"note: {src} has no output_text_hash column (written before text hashes existed), so "
            "text_agreement checked no row; run `reconstruct` again to check the ids against the text",
            file=sys.stderr,
        )
    write_json_atomic({"input": str(src), **report.to_dict()}, args.report)
    if args.kept_out:
        write_parquet_atomic(table.filter(pa.array(np.asarray(report.filter_mask))), args.kept_out)
    print(report.summary())
    print(f"report: {args.report}")
    return EXIT_OK if report.passed else EXIT_BLOCKED


def _load_target(tokenizer: str, profile_name: str) -> tuple[Any, Any]:
    from eagle_pipeline.tokens import TokenizerLoadError, get_profile, resolve_tokenizer

    try:
        profile = get_profile(profile_name)
    except KeyError as exc:
        raise CliError(str(exc.args[0]) if exc.args else str(exc)) from None
    try:
        tok = resolve_tokenizer(tokenizer)
    except TokenizerLoadError as exc:
        raise CliError(str(exc)) from None
    try:
        profile.resolve(tok)
    except KeyError as exc:
        raise CliError(str(exc.args[0]) if exc.args else str(exc)) from None
    return tok, profile


def _target_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tokenizer",
        required=True,
        metavar="DIR",
        help="target tokenizer: a directory (Kimi tiktoken.model, or a transformers tokenizer) or 'demo'",
    )
    p.add_argument("--profile", default="kimi-k2.5", help="model profile (default: kimi-k2.5; also: qwen3)")


def add_token_commands(sub: Any) -> None:
    """`reconstruct` and `audit`."""
    rec = sub.add_parser(
        "reconstruct",
        help="rebuild exact output ids from chat-completion responses (JSONL)",
        description="Each input line: {sample_id, response (the chat-completion body as returned, or the line is the "
        "body itself), dataset?, tools? (list or true), thinking? (default true), messages?}.",
    )
    _target_options(rec)
    rec.add_argument("--in", dest="input", required=True, metavar="JSONL")
    rec.add_argument("--out", dest="output", required=True, metavar="PARQUET")
    rec.add_argument("--dataset", default="imported", help="dataset of lines that name none (default: imported)")
    rec.add_argument(
        "--skip-unusable",
        action="store_true",
        help="skip (and count) error bodies or bodies without choices instead of failing",
    )
    rec.set_defaults(func=cmd_reconstruct)

    aud = sub.add_parser(
        "audit",
        help="run the audit gates over a token-samples Parquet file",
        description="Exit status 1 when a blocking gate fails, 2 on usage or input errors.",
    )
    _target_options(aud)
    aud.add_argument("--in", dest="input", required=True, metavar="PARQUET")
    aud.add_argument("--report", required=True, metavar="JSON", help="where to write the JSON report")
    aud.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="GATE=ACTION or GATE@ORIGIN=ACTION (block|filter|warn; origin reconstructed|returned), "
        "or a numeric setting such as billing_aggregate_bound=0.01; repeatable",
    )
    aud.add_argument("--gates", help="comma-separated subset of gates (default: all)")
    aud.add_argument("--kept-out", metavar="PARQUET", help="also write the rows that pass the filter")
    aud.set_defaults(func=cmd_audit)
