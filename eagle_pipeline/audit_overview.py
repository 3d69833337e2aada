"""Moved to `eagle_pipeline.audit.overview` (docs/architecture.md, "Moved modules"); this path still imports its names."""

from eagle_pipeline.audit.overview import *  # noqa: F403
