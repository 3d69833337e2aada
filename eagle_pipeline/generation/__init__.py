"""Response generation: backends (OpenRouter, vLLM, SGLang, import, simulated), the exactly-once runner. The simulated
OpenRouter server lives in `eagle_pipeline.simulation`. See docs/generation.md (module map in docs/architecture.md)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eagle_pipeline.generation.budget import pipeline_budget
    from eagle_pipeline.generation.options import RunOptions
    from eagle_pipeline.generation.rows import ERRORS_SCHEMA, RESPONSES_SCHEMA
    from eagle_pipeline.generation.runner import agenerate_dataset, generate_dataset
    from eagle_pipeline.generation.spec import BackendKind, BackendSpec, SamplingSpec
    from eagle_pipeline.generation.store import read_errors, read_responses
    from eagle_pipeline.generation.summary import GenerationSummary, ProgressEvent, committed_totals
    from eagle_pipeline.shared.failures import RequestFailure

# Imported on first use: a stream worker process (`stream_workers`) imports only the modules it runs, not the
# runner's Parquet and configuration stack (~0.3 s and 35 MiB per process instead of ~1.4 s and 104 MiB).
_EXPORTS = {
    "BackendKind": "eagle_pipeline.generation.spec",
    "BackendSpec": "eagle_pipeline.generation.spec",
    "ERRORS_SCHEMA": "eagle_pipeline.generation.rows",
    "GenerationSummary": "eagle_pipeline.generation.summary",
    "ProgressEvent": "eagle_pipeline.generation.summary",
    "RESPONSES_SCHEMA": "eagle_pipeline.generation.rows",
    "RequestFailure": "eagle_pipeline.shared.failures",
    "RunOptions": "eagle_pipeline.generation.options",
    "SamplingSpec": "eagle_pipeline.generation.spec",
    "agenerate_dataset": "eagle_pipeline.generation.runner",
    "committed_totals": "eagle_pipeline.generation.summary",
    "generate_dataset": "eagle_pipeline.generation.runner",
    "pipeline_budget": "eagle_pipeline.generation.budget",
    "read_errors": "eagle_pipeline.generation.store",
    "read_responses": "eagle_pipeline.generation.store",
}


__all__ = [
    "ERRORS_SCHEMA",
    "RESPONSES_SCHEMA",
    "BackendKind",
    "BackendSpec",
    "GenerationSummary",
    "ProgressEvent",
    "RequestFailure",
    "RunOptions",
    "SamplingSpec",
    "agenerate_dataset",
    "committed_totals",
    "generate_dataset",
    "pipeline_budget",
    "read_errors",
    "read_responses",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
