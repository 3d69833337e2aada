"""`eagle-pipeline retire-responses` and `check-drafter`: archiving a dataset's responses, the drafter layer guard."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from eagle_pipeline.cli.common import EXIT_BLOCKED, EXIT_OK, CliError, config_option


def cmd_retire_responses(args: argparse.Namespace) -> int:
    from eagle_pipeline.config import ConfigError, load_config
    from eagle_pipeline.generation.store.retire import retire_responses
    from eagle_pipeline.generation.store.shards import read_responses
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


def cmd_check_drafter(args: argparse.Namespace) -> int:
    from eagle_pipeline.hidden_states.checks.drafter_check import check_drafter

    if not Path(args.draft_config).is_file():
        raise CliError(f"{args.draft_config}: no such file")
    try:
        result = check_drafter(args.export, args.draft_config)
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from None
    print(result.describe(), file=sys.stdout if result.passed else sys.stderr)
    return EXIT_OK if result.passed else EXIT_BLOCKED


def add_data_commands(sub: Any) -> None:
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
    config_option(ret)
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
