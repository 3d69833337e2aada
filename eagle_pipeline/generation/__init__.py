"""Response generation: backends (OpenRouter, vLLM, SGLang, import, simulated), the exactly-once runner, and the
loopback servers that stand in for the real endpoints. See docs/generation.md (module map in docs/architecture.md)."""

from eagle_pipeline.generation.budget import SpendTracker, pipeline_budget
from eagle_pipeline.generation.failures import RequestFailure
from eagle_pipeline.generation.rows import ERRORS_SCHEMA, RESPONSES_SCHEMA
from eagle_pipeline.generation.runner import agenerate_dataset, generate_dataset
from eagle_pipeline.generation.simulated import (
    SimulatedOpenRouterServer,
    SimulatedSGLangServer,
    SimulatedVLLMServer,
    ids_key,
    request_key,
)
from eagle_pipeline.generation.spec import BackendKind, BackendSpec, SamplingSpec
from eagle_pipeline.generation.store import read_errors, read_responses
from eagle_pipeline.generation.summary import GenerationSummary, ProgressEvent, committed_totals

__all__ = [
    "ERRORS_SCHEMA",
    "RESPONSES_SCHEMA",
    "BackendKind",
    "BackendSpec",
    "GenerationSummary",
    "ProgressEvent",
    "RequestFailure",
    "SamplingSpec",
    "SimulatedOpenRouterServer",
    "SimulatedSGLangServer",
    "SimulatedVLLMServer",
    "SpendTracker",
    "agenerate_dataset",
    "committed_totals",
    "generate_dataset",
    "ids_key",
    "pipeline_budget",
    "read_errors",
    "read_responses",
    "request_key",
]
