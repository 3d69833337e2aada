"""Doubles used only by tests and benchmarks (the wheel leaves them out; no module of eagle_pipeline imports them, which
test_architecture.py checks): the vLLM and SGLang chat servers that return token ids (`vllm_chat`, `sglang_chat`, over
`id_server`), built on the simulated servers' answers, faults and streaming in `eagle_pipeline.simulation`, and
synthetic merged tables (`synthetic`). The servers the configuration can name are in `eagle_pipeline.simulation`."""

from eagle_pipeline_tests.doubles.sglang_chat import SimulatedSGLangServer
from eagle_pipeline_tests.doubles.vllm_chat import SimulatedVLLMServer

__all__ = ["SimulatedSGLangServer", "SimulatedVLLMServer"]
