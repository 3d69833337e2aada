"""Moved to `eagle_pipeline.audit.records` (docs/architecture.md, "Moved modules"); this path still imports its names."""

from eagle_pipeline.audit.records import *  # noqa: F403
