"""What every `eagle-pipeline` command shares: the exit statuses, the usage error, the `--config` option."""

from __future__ import annotations

import argparse

EXIT_OK, EXIT_BLOCKED, EXIT_USAGE = 0, 1, 2
PROG = "eagle-pipeline"


class CliError(Exception):
    """A usage or input problem: printed as one message, exit status 2."""


def config_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="pipeline YAML (default: $EAGLE_PIPELINE_CONFIG, pipeline.yaml)")
