"""`eagle-pipeline`: the pipeline's core steps from the command line, with the same code the Dagster assets run.

    eagle-pipeline reconstruct --tokenizer DIR [--profile kimi-k2.5] --in responses.jsonl --out tokens.parquet
    eagle-pipeline audit --tokenizer DIR [--profile kimi-k2.5] --in tokens.parquet --report report.json
                         [--set GATE[@ORIGIN]=ACTION ...] [--set SETTING=VALUE ...] [--kept-out kept.parquet]
    eagle-pipeline vllm-command [--config pipeline.yaml] [--served-model M] [--served-model-config PATH]
                                [--tensor-parallel-size 8]
    eagle-pipeline vllm-smoke [--config pipeline.yaml] [--endpoint URL] [--ids 1,2,3] [--served-model-config PATH]
    eagle-pipeline plan [--config pipeline.yaml] [--tokens N --samples N]
    eagle-pipeline retire-responses --dataset B3 [--backend NAME] [--provider NAME] [--config pipeline.yaml]
    eagle-pipeline check-drafter --export DIR --draft-config FILE

One argument parser; each command's handler lives with its group (cli/tokens.py: reconstruct, audit;
cli/extraction.py: plan, vllm-command, vllm-smoke; cli/data.py: retire-responses, check-drafter) and only parses,
calls the core and prints (the logic is in the core packages). Heavy imports stay inside the handlers, so `--help`
starts fast and imports no torch.

Exit status: 0 success (audit: no blocking gate failed), 1 a blocking audit gate failed (vllm-smoke: the server or
its file is wrong; check-drafter: the draft config does not match the captured layers; plan: over the disk budget or
the engine cannot hold the weights, or the disk's free space is short), 2 usage or input error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from eagle_pipeline.cli.common import EXIT_BLOCKED, EXIT_OK, EXIT_USAGE, PROG, CliError
from eagle_pipeline.cli.data import add_data_commands, cmd_check_drafter, cmd_retire_responses
from eagle_pipeline.cli.extraction import add_extraction_commands, cmd_plan, cmd_vllm_command, cmd_vllm_smoke
from eagle_pipeline.cli.tokens import add_token_commands, cmd_audit, cmd_reconstruct, parse_set_options

__all__ = [
    "EXIT_BLOCKED",
    "EXIT_OK",
    "EXIT_USAGE",
    "PROG",
    "CliError",
    "build_parser",
    "cmd_audit",
    "cmd_check_drafter",
    "cmd_plan",
    "cmd_reconstruct",
    "cmd_retire_responses",
    "cmd_vllm_command",
    "cmd_vllm_smoke",
    "main",
    "parse_set_options",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Audited EAGLE-3 drafter training data: command-line steps."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_token_commands(sub)
    add_extraction_commands(sub)
    add_data_commands(sub)
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
