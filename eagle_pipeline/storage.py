"""Moved to `eagle_pipeline.shared.storage` (docs/architecture.md, "Moved modules"); this path still imports its names."""

from eagle_pipeline.shared.storage import *  # noqa: F403
