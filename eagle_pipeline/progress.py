"""Moved to `eagle_pipeline.shared.progress` (docs/architecture.md, "Moved modules"); this path still imports its names."""

from eagle_pipeline.shared.progress import *  # noqa: F403
