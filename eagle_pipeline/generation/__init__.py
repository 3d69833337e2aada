"""Response generation: backends (OpenRouter, vLLM, SGLang, import, simulated), the exactly-once runner, and the
loopback servers that stand in for the real endpoints. See docs/generation.md."""

from eagle_pipeline.generation.failures import RequestFailure
from eagle_pipeline.generation.runner import (
    GenerationSummary,
    ProgressEvent,
    SpendTracker,
    agenerate_dataset,
    generate_dataset,
)
from eagle_pipeline.generation.schema import ERRORS_SCHEMA, RESPONSES_SCHEMA
from eagle_pipeline.generation.simulated import (
    SimulatedOpenRouterServer,
    SimulatedSGLangServer,
    SimulatedVLLMServer,
    ids_key,
    request_key,
)
from eagle_pipeline.generation.spec import BackendKind, BackendSpec, SamplingSpec
from eagle_pipeline.generation.store import read_errors, read_responses

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
    "generate_dataset",
    "ids_key",
    "read_errors",
    "read_responses",
    "request_key",
]
