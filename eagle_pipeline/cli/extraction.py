"""`eagle-pipeline plan`, `vllm-command` and `vllm-smoke`: the extraction plan and the vLLM extraction servers."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from eagle_pipeline.cli.common import EXIT_BLOCKED, EXIT_OK, PROG, CliError, config_option


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
    from eagle_pipeline.hidden_states.engines.vllm.vllm_command import serve_command_from_config

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
    from eagle_pipeline.hidden_states.engines.vllm.engine_vllm import smoke_request
    from eagle_pipeline.hidden_states.engines.vllm.vllm_command import (
        PINNED_VLLM_VERSION,
        describe_engine_model,
        resolved_endpoints,
    )
    from eagle_pipeline.hidden_states.engines.vllm.vllm_files import SIMULATED, vllm_layer_ids
    from eagle_pipeline.hidden_states.engines.vllm.vllm_served import (
        check_same_model,
        fetch_max_model_len,
        fetch_server_version,
        served_model,
    )
    from eagle_pipeline.hidden_states.models.layers import resolve_aux_layers
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
    from eagle_pipeline.hidden_states.plan.estimate import Workload
    from eagle_pipeline.hidden_states.plan.run_plan import PlanRefused, plan_for_run

    cfg, vocab = _hidden_states_config(args)
    h = cfg.hidden_states
    if (args.tokens is None) != (args.samples is None):
        raise CliError("--tokens and --samples go together (a scale to plan), or neither (the merged table's)")
    merged = args.tokens is None
    try:
        if merged:
            plans, tokens, samples = _plan_merged(cfg)
        else:
            tokens, samples = args.tokens, args.samples
            work = Workload(tokens, samples)
            plans = plan_for_run(h, work, target_model_config=cfg.target.model_config, vocab_size=vocab)
    except PlanRefused as exc:
        print(f"{PROG} plan: refused: {exc}", file=sys.stderr)
        return EXIT_BLOCKED
    except (ValueError, FileNotFoundError) as exc:
        raise CliError(str(exc)) from None
    plan = plans["this_run"]
    print(f"extraction plan: {h.model} ({h.engine} engine, layout {h.layout}) over {tokens:,} tokens, {samples:,} rows")
    print(plan.to_markdown())
    if not merged:
        return EXIT_BLOCKED if plan.exceeds_budget else EXIT_OK
    return _check_disk(cfg)


def _plan_merged(cfg: Any) -> tuple[dict[str, Any], int, int]:
    """The plan over the merged table (plan.json written, as the `hidden_state_plan` asset writes it), its tokens
    and rows."""
    from eagle_pipeline.hidden_states.engines.engine import ExtractionPaths
    from eagle_pipeline.hidden_states.run import plan_run
    from eagle_pipeline.merge.manifest import MergeManifest
    from eagle_pipeline.shared.storage import DataRoot
    from eagle_pipeline.tokens import resolve_tokenizer

    paths = ExtractionPaths.of(DataRoot(cfg.data_root))
    try:
        manifest = MergeManifest.read(paths.merged_dir)
    except FileNotFoundError:
        raise CliError(f"{paths.merged_dir}: nothing merged yet; pass --tokens and --samples to plan a scale") from None
    plans = plan_run(
        cfg.hidden_states,
        paths,
        target_model_config=cfg.target.model_config,
        vocab_size=resolve_tokenizer(cfg.target.tokenizer).vocab_size,
        shard_runs=cfg.pools.gpu,
    )
    return plans, manifest.tokens_total, manifest.rows_total


def _check_disk(cfg: Any) -> int:
    """The disk check every shard run makes before its first request (`disk_plan.check_disk_for_run`), with its figures."""
    from eagle_pipeline.hidden_states.engines.engine import ExtractionPaths
    from eagle_pipeline.hidden_states.plan.disk_plan import DiskBudgetExceeded, check_disk_for_run
    from eagle_pipeline.shared.storage import DataRoot

    try:
        needs = check_disk_for_run(cfg.hidden_states, ExtractionPaths.of(DataRoot(cfg.data_root)))
    except DiskBudgetExceeded as exc:
        print(f"{PROG} plan: {exc}", file=sys.stderr)
        return EXIT_BLOCKED
    for n in needs:
        print(f"free space: {n.path} ({', '.join(n.places)}): {n.needed:,} bytes still to write, {n.free:,} free")
    return EXIT_OK


def add_extraction_commands(sub: Any) -> None:
    """`vllm-command`, `vllm-smoke` and `plan`."""
    vc = sub.add_parser(
        "vllm-command",
        help="print the `vllm serve` command for extraction with this configuration",
        description="The extract_hidden_states server for the configured model, aux layers and storage path.",
    )
    config_option(vc)
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
    config_option(vs)
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
    config_option(pl)
    pl.add_argument("--tokens", type=int, help="tokens to plan for (default: the merged table's)")
    pl.add_argument("--samples", type=int, help="rows to plan for (default: the merged table's)")
    pl.set_defaults(func=cmd_plan)
