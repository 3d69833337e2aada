"""The Dagster code location: `dagster dev -w workspace.yaml`, `dagster definitions validate` or `dg check defs`.

Everything is found by Dagster's defs-folder autoloading: each module of `eagle_pipeline/defs/` declares its assets,
checks, jobs, schedules and sensors at module level (the resource in `defs/resources.py`), and nothing is listed
twice. A new asset is a new object in a module of that folder.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg


def build_defs() -> dg.Definitions:
    """The location's definitions, loaded from the defs folder (eagle_pipeline/dg.toml names it)."""
    return dg.load_from_defs_folder(path_within_project=Path(__file__).parent)


defs = build_defs()
