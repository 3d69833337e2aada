"""`eagle-pipeline`: the pipeline's core steps from the command line, with the same code the Dagster assets run.

    eagle-pipeline reconstruct --tokenizer DIR [--profile kimi-k2.5] --in responses.jsonl --out tokens.parquet
    eagle-pipeline audit --tokenizer DIR [--profile kimi-k2.5] --in tokens.parquet --report report.json
                         [--set GATE[@ORIGIN]=ACTION ...] [--set SETTING=VALUE ...] [--kept-out kept.parquet]
    eagle-pipeline plan [--config pipeline.yaml]
    eagle-pipeline vllm-command [--config pipeline.yaml] [--served-model M] [--served-model-config PATH]
                                [--tensor-parallel-size 8]
    eagle-pipeline vllm-smoke [--config pipeline.yaml] [--endpoint URL] [--ids 1,2,3] [--served-model-config PATH]
    eagle-pipeline plan [--config pipeline.yaml] [--tokens N --samples N]
    eagle-pipeline retire-responses --dataset B3 [--backend NAME] [--provider NAME] [--config pipeline.yaml]
    eagle-pipeline check-drafter --export DIR --draft-config FILE

Why this module is long: it is the one argument parser and the thin handler of each of the seven commands above; each
handler only parses, calls the core and prints (the logic is in the core packages).

`reconstruct` writes the full token-samples schema, including `output_text_hash` (the hash of the text each
reconstructed row's ids must decode to); `audit` checks it in the `text_agreement` gate.

Exit status: 0 success (audit: no blocking gate failed), 1 a blocking audit gate failed (vllm-smoke: the server or
its file is wrong; check-drafter: the draft config does not match the captured layers; plan: over the disk budget or
the engine cannot hold the weights, or the disk's free space is short), 2 usage or input error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle_pipeline.generation.response_lines import ResponseLinesError, read_response_lines, responses_table

EXIT_OK, EXIT_BLOCKED, EXIT_USAGE = 0, 1, 2
PROG = "eagle-pipeline"


class CliError(Exception):
    """A usage or input problem: printed as one message, exit status 2."""


# ---- reconstruct ---------------------------------------------------------------------------------------------------


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


# ---- audit ---------------------------------------------------------------------------------------------------------


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


# ---- retire-responses ----------------------------------------------------------------------------------------------


def cmd_retire_responses(args: argparse.Namespace) -> int:
    from eagle_pipeline.config import ConfigError, load_config
    from eagle_pipeline.generation import read_responses
    from eagle_pipeline.generation.retire import retire_responses
    from eagle_pipeline.shared.storage import DataRoot

    if args.data_root:
        root = DataRoot(Path(args.data_root))
    else:
        try:
            root = DataRoot(load_config(args.config).data_root)
        except ConfigError as exc:
            raise CliError(str(exc)) from None
    directory = root.responses_dir(args.dataset)
    if not directory.is_dir():
        raise CliError(f"{directory}: no committed responses for dataset {args.dataset!r}")
    try:
        summary = retire_responses(directory, dataset=args.dataset, backend=args.backend, provider=args.provider)
    except RuntimeError as exc:  # another run holds the dataset's lock, or a shard is unreadable
        raise CliError(str(exc)) from None
    if summary.archive is None:
        on_disk = read_responses(directory)
        pairs = sorted(
            {
                f"backend={b} provider={p}"
                for b, p in zip(on_disk["backend"].to_pylist(), on_disk["provider"].to_pylist())
            }
        )
        raise CliError(
            f"{args.dataset}: no committed row matches backend={args.backend} provider={args.provider}; "
            f"on disk: {', '.join(pairs) or 'no rows'}"
        )
    print(summary.describe())
    for source, n in summary.by_backend_provider.items():
        print(f"  {source}: {n} rows")
    print(f"rerun the dataset (EAGLE_dataset, partition {args.dataset}) to request the retired prompts again")
    return EXIT_OK


# ---- shared --------------------------------------------------------------------------------------------------------


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


# ---- vLLM extraction servers ---------------------------------------------------------------------------------------


def _hidden_states_config(args: argparse.Namespace):
    from eagle_pipeline.config import ConfigError, load_config

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    vocab = 0
    if cfg.hidden_states.model == "tiny-random":  # only the tiny model's shape depends on the tokenizer
        from eagle_pipeline.tokens import resolve_tokenizer

        vocab = resolve_tokenizer(cfg.target.tokenizer).vocab_size
    return cfg, vocab


def cmd_vllm_command(args: argparse.Namespace) -> int:
    from eagle_pipeline.hidden_states.vllm_command import serve_command_from_config

    cfg, vocab = _hidden_states_config(args)
    try:
        command = serve_command_from_config(
            cfg.hidden_states,
            served_model=args.served_model,
            vocab_size=vocab,
            tensor_parallel_size=args.tensor_parallel_size or cfg.hidden_states.vllm.gpus_per_server,
            port=args.port,
            served_config=args.served_model_config,
        )
    except (ValueError, FileNotFoundError) as exc:
        raise CliError(str(exc)) from None
    print(command.shell())
    return EXIT_OK


def cmd_vllm_smoke(args: argparse.Namespace) -> int:
    from eagle_pipeline.hidden_states.engine_vllm import smoke_request
    from eagle_pipeline.hidden_states.layers import resolve_aux_layers
    from eagle_pipeline.hidden_states.vllm_command import PINNED_VLLM_VERSION, describe_engine_model, resolved_endpoints
    from eagle_pipeline.hidden_states.vllm_files import SIMULATED, vllm_layer_ids
    from eagle_pipeline.hidden_states.vllm_served import (
        check_same_model,
        fetch_max_model_len,
        fetch_server_version,
        served_model,
    )
    from eagle_pipeline.shared.failures import RequestFailure

    cfg, vocab = _hidden_states_config(args)
    h = cfg.hidden_states
    endpoint = args.endpoint or (h.vllm.endpoints[0] if h.vllm.endpoints else None)
    if endpoint is None:
        raise CliError("no endpoint: pass --endpoint or set hidden_states.vllm.endpoints")
    try:  # the file is checked against the served model's config.json, which must be the extraction model's
        served = served_model(
            h,
            served_model=None,
            served_config=args.served_model_config,
            vocab_size=vocab,
            simulated=endpoint == SIMULATED,
        )
        check_same_model(h, served, describe_engine_model(h.model, family=h.family, vocab_size=vocab))
        n_layers = int(served.description["num_layers"])
        layer_ids = vllm_layer_ids(resolve_aux_layers(h.aux_layers, n_layers), n_layers)
    except (ValueError, FileNotFoundError) as exc:
        raise CliError(str(exc)) from None
    ids = [int(x) for x in args.ids.split(",")] if args.ids else list(range(100, 164))
    with resolved_endpoints(
        [endpoint],
        storage_path=h.vllm.storage_path,
        model=h.model,
        family=h.family,
        seed=h.seed,
        vocab_size=vocab,
        layer_ids=layer_ids,
        max_model_len=h.vllm.max_model_len,
    ) as (url,):
        try:
            version = fetch_server_version(url, timeout_s=h.vllm.timeout_s)
            max_len = fetch_max_model_len(url, timeout_s=h.vllm.timeout_s)
            facts = smoke_request(
                url,
                storage_path=h.vllm.storage_path,
                ids=ids,
                layer_ids=layer_ids,
                hidden_size=int(served.description["hidden_size"]),
                timeout_s=h.vllm.timeout_s,
            )
        except (RequestFailure, OSError, ValueError) as exc:
            print(f"{PROG} vllm-smoke: FAILED against {endpoint}: {exc}", file=sys.stderr)
            return EXIT_BLOCKED
    if version.split("+")[0] != PINNED_VLLM_VERSION:
        print(
            f"warning: the server runs vLLM {version}; the command is written for {PINNED_VLLM_VERSION}",
            file=sys.stderr,
        )
    print(
        f"OK {endpoint}: hidden_states [{facts.tokens}, {len(layer_ids)}, {facts.hidden_size}] {facts.dtype} for "
        f"{len(ids)} ids, vLLM layer ids {list(layer_ids)} (aux + final pre-norm) of {served.label} "
        f"({served.shape()}); finite, no all-zero state, token ids equal; file read from {h.vllm.storage_path} and "
        f"deleted; vLLM {version}, max_model_len {max_len} (rows up to {max_len - 1} tokens)"
    )
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    """The extraction plan. Over the merged table: written to plan.json as `hidden_state_plan` writes it, then the
    disk check every shard run makes before its first request (budget and free space). Over `--tokens`/`--samples`:
    a scale sized before its data exists (budget only). Exit 1 when extraction would be refused."""
    from eagle_pipeline.hidden_states.runtime import PlanRefused, plan_for_config

    cfg, vocab = _hidden_states_config(args)
    h = cfg.hidden_states
    if (args.tokens is None) != (args.samples is None):
        raise CliError("--tokens and --samples go together (a scale to plan), or neither (the merged table's)")
    if args.tokens is None:
        return _plan_merged(cfg)
    try:
        plans = plan_for_config(
            h,
            target_model_config=cfg.target.model_config,
            n_tokens=args.tokens,
            n_samples=args.samples,
            vocab_size=vocab,
        )
    except PlanRefused as exc:
        print(f"{PROG} plan: refused: {exc}", file=sys.stderr)
        return EXIT_BLOCKED
    except (ValueError, FileNotFoundError) as exc:
        raise CliError(str(exc)) from None
    plan = plans["this_run"]
    _print_plan_header(cfg, args.tokens, args.samples)
    print(plan.to_markdown())
    return EXIT_BLOCKED if plan.exceeds_budget else EXIT_OK


def _print_plan_header(cfg: Any, tokens: int, samples: int) -> None:
    h = cfg.hidden_states
    print(f"extraction plan: {h.model} ({h.engine} engine, layout {h.layout}) over {tokens:,} tokens, {samples:,} rows")


def _plan_merged(cfg: Any) -> int:
    """`plan` over the merged table: plan.json written, then the shard runs' disk check (`run.check_disk_for_run`)."""
    from eagle_pipeline.hidden_states.engine import ExtractionPaths
    from eagle_pipeline.hidden_states.plan import DiskBudgetExceeded
    from eagle_pipeline.hidden_states.run import check_disk_for_run, plan_run
    from eagle_pipeline.hidden_states.runtime import PlanRefused
    from eagle_pipeline.merge.manifest import MergeManifest
    from eagle_pipeline.shared.storage import DataRoot
    from eagle_pipeline.tokens import resolve_tokenizer

    paths = ExtractionPaths.of(DataRoot(cfg.data_root))
    try:
        manifest = MergeManifest.read(paths.merged_dir)
    except FileNotFoundError:
        raise CliError(f"{paths.merged_dir}: nothing merged yet; pass --tokens and --samples to plan a scale") from None
    try:
        plans = plan_run(
            cfg.hidden_states,
            paths,
            target_model_config=cfg.target.model_config,
            vocab_size=resolve_tokenizer(cfg.target.tokenizer).vocab_size,
            shard_runs=cfg.pools.gpu,
        )
    except PlanRefused as exc:
        print(f"{PROG} plan: refused: {exc}", file=sys.stderr)
        return EXIT_BLOCKED
    except (ValueError, FileNotFoundError) as exc:
        raise CliError(str(exc)) from None
    _print_plan_header(cfg, manifest.tokens_total, manifest.rows_total)
    print(plans["this_run"].to_markdown())
    try:
        needs = check_disk_for_run(cfg.hidden_states, paths)
    except DiskBudgetExceeded as exc:
        print(f"{PROG} plan: {exc}", file=sys.stderr)
        return EXIT_BLOCKED
    for n in needs:
        print(f"free space: {n.path} ({', '.join(n.places)}): {n.needed:,} bytes still to write, {n.free:,} free")
    return EXIT_OK


def cmd_check_drafter(args: argparse.Namespace) -> int:
    from eagle_pipeline.hidden_states.drafter_check import check_drafter

    if not Path(args.draft_config).is_file():
        raise CliError(f"{args.draft_config}: no such file")
    try:
        result = check_drafter(args.export, args.draft_config)
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from None
    print(result.describe(), file=sys.stdout if result.passed else sys.stderr)
    return EXIT_OK if result.passed else EXIT_BLOCKED


def _target_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tokenizer",
        required=True,
        metavar="DIR",
        help="target tokenizer: a directory (Kimi tiktoken.model, or a transformers tokenizer) or 'demo'",
    )
    p.add_argument("--profile", default="kimi-k2.5", help="model profile (default: kimi-k2.5; also: qwen3)")


def _config_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="pipeline YAML (default: $EAGLE_PIPELINE_CONFIG, pipeline.yaml)")


def _add_token_commands(sub: Any) -> None:
    """`reconstruct` and `audit`."""
    rec = sub.add_parser(
        "reconstruct",
        help="rebuild exact output ids from chat-completion responses (JSONL)",
        description="Each input line: {sample_id, response (the chat-completion body as returned), "
        "dataset?, tools? (list or true), thinking? (default true), messages?}.",
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


def _add_vllm_commands(sub: Any) -> None:
    """`vllm-command`, `vllm-smoke` and `plan`."""
    vc = sub.add_parser(
        "vllm-command",
        help="print the `vllm serve` command for extraction with this configuration",
        description="The extract_hidden_states server for the configured model, aux layers and storage path.",
    )
    _config_option(vc)
    vc.add_argument("--served-model", help="what `vllm serve` loads (default: hidden_states.model)")
    served_config_help = (
        "config.json (or local snapshot) of the model the server loads (default: hidden_states.vllm."
        "served_model_config, the served model's directory, or hidden_states.model)"
    )
    vc.add_argument("--served-model-config", metavar="PATH", help=served_config_help)
    vc.add_argument(
        "--tensor-parallel-size", type=int, help="GPUs per server (default: hidden_states.vllm.gpus_per_server, 8)"
    )
    vc.add_argument("--port", type=int, default=8000)
    vc.set_defaults(func=cmd_vllm_command)

    vs = sub.add_parser(
        "vllm-smoke",
        help="send one row to a running extraction server and validate the file it returns",
        description="Exit status 0 when the file is valid, 1 when the server or its file is wrong.",
    )
    _config_option(vs)
    vs.add_argument("--endpoint", help="base URL (default: the first of hidden_states.vllm.endpoints)")
    vs.add_argument("--ids", help="comma-separated token ids to send (default: 100..163)")
    vs.add_argument("--served-model-config", metavar="PATH", help=served_config_help)
    vs.set_defaults(func=cmd_vllm_smoke)

    pl = sub.add_parser(
        "plan",
        help="print the extraction plan (disk item by item, GPU-hours, shards) and check the disk before any shard",
        description="The plan the hidden_state_plan asset writes, over the merged table (then the disk check every "
        "shard run makes: the budget and the free space), or over --tokens and --samples to size a run before its "
        "data exists. Exit status 1 when a shard run would refuse to start (the message names the bytes needed and "
        "the limit) or the engine cannot hold the weights.",
    )
    _config_option(pl)
    pl.add_argument("--tokens", type=int, help="tokens to plan for (default: the merged table's)")
    pl.add_argument("--samples", type=int, help="rows to plan for (default: the merged table's)")
    pl.set_defaults(func=cmd_plan)


def _add_data_commands(sub: Any) -> None:
    """`retire-responses` and `check-drafter`."""
    ret = sub.add_parser(
        "retire-responses",
        help="archive a dataset's committed responses (all, or one backend's / provider's)",
        description="Moves the matching rows to responses/<dataset>/retired/<stamp>/ (never deletes them); the "
        "budgets keep counting their spend. The next run of the dataset requests their prompts again.",
    )
    ret.add_argument("--dataset", required=True, help="the dataset (partition) name, e.g. B3")
    ret.add_argument("--backend", help="retire only the rows of this backend (its name in the configuration)")
    ret.add_argument("--provider", help="retire only the rows this provider answered (the responses' provider column)")
    _config_option(ret)
    ret.add_argument("--data-root", metavar="DIR", help="the data root, instead of the configuration's")
    ret.set_defaults(func=cmd_retire_responses)

    chk = sub.add_parser(
        "check-drafter",
        help="refuse a draft config or flag file whose layer ids, layer count or width differ from the capture",
        description="Exit status 0 when the draft config reads exactly the captured layers at the captured width, "
        "1 when not (each mismatch named with both values), 2 on usage or input errors. docs/drafters.md.",
    )
    chk.add_argument("--export", required=True, metavar="DIR", help="a trainer export (exports/specforge, ...)")
    chk.add_argument(
        "--draft-config",
        required=True,
        metavar="FILE",
        help="a draft JSON (SpecForge's, or a speculators config.json) or a file of speculators train.py flags",
    )
    chk.set_defaults(func=cmd_check_drafter)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Audited EAGLE-3 drafter training data: command-line steps."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_token_commands(sub)
    _add_vllm_commands(sub)
    _add_data_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from eagle_pipeline.audit import AuditInputError, AuditSettingsError

    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on usage errors
    try:
        return int(args.func(args))
    except (CliError, AuditSettingsError, AuditInputError) as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
