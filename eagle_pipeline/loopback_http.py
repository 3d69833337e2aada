"""Moved to `eagle_pipeline.shared.loopback_http` (docs/architecture.md, "Moved modules"); this path still imports its names."""

from eagle_pipeline.shared.loopback_http import *  # noqa: F403
