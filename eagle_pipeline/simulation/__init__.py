"""Simulated servers the configuration can name, for the offline demo and for tests: loopback stand-ins that speak the
real servers' wire formats.

* `SimulatedOpenRouterServer` (`openrouter`): a backend of kind `simulated` (`backends.<name>.kind: simulated`);
  the generation runner starts one for a run when the backend names no endpoint
  (`generation.run.runner.backend_endpoint`).
* `VLLMHiddenStatesDouble` (`vllm_hidden_states`): `hidden_states.vllm.endpoints: [simulated]`; the vLLM engine
  starts one per shard run serving the `tiny-random` model (`hidden_states.vllm_command.resolved_endpoints`). Not
  imported here (it needs torch): import it from its module.

The product reaches this package only through those two call-time imports (docs/architecture.md, "The simulation
seam"); the doubles used only by tests and benchmarks (vLLM and SGLang chat servers, synthetic merged tables) live in
`eagle_pipeline_tests/doubles/` and build on `answers`, `faults`, `server` and `streaming` here.
All listen on 127.0.0.1 only, on an aiohttp app in a background thread, and are context managers:

    with SimulatedOpenRouterServer(latency_s=0.01, faults={"http_429": 0.2}) as srv:
        ... BackendSpec(kind="simulated", endpoint=srv.url, ...)

Answers are a pure function of the request (hash of messages + seed): reasoning that quotes the prompt, an
answer, and, for ~60% of prompts that offer tools, tool calls whose arguments follow the tool's JSON schema (after a
tool result only while the conversation holds fewer than `tool_rounds` results: an agent loop). A tool result that
answers no open call of the latest assistant message is refused with a 400, as chat APIs do.

Faults (the `faults` dict): a fault name maps to a rate in [0, 1] (chosen per request key by hash, so the same
prompts are affected on every run), and `select` maps a fault name to explicit request keys (`request_key()`).
Transient faults hit only the first `fail_first_n_attempts` attempts of a key (default 1), so retries clear them;
status faults 401/402 and answer-quality faults hit every attempt. `after_requests: {fault: N}` applies a fault
to every request once the server has seen more than N (a key revoked or credits exhausted mid-run).

  transient: http_429 (Retry-After: retry_after_s), http_500, http_502, http_503, timeout (sleeps
             timeout_sleep_s, beyond the client's timeout), error_200 (HTTP 200 with an error body), no_choices,
             cut_body (connection closed mid-body), bad_json (complete HTTP response, truncated JSON)
  stream:    (streamed requests only; transient) stream_error (error chunk with finish_reason 'error' after partial
             content), stream_finish_error, stream_cut (no [DONE]), stream_no_finish, stream_idle (a gap of
             timeout_sleep_s mid-stream), stream_trickle (keep-alives forever)
  status:    http_401, http_402
  quality:   length (finish 'length', text cut), empty_content, empty_reasoning, billing_mismatch
             (usage.completion_tokens +15%), bad_tool_args (malformed JSON arguments), prompt_mismatch
             (usage.prompt_tokens counts a system prompt the provider injected: +PROMPT_INJECTED_TOKENS)

Modules: `answers` (request keys, token counters, the deterministic answer), `faults` (the fault plan and the HTTP
response of each fault), `server` (the request log, on the loopback harness `eagle_pipeline.shared.loopback_http`),
`streaming` (a completion body as SSE chunks, paced by a `StreamStyle`, with the stream faults), `openrouter` (the
OpenRouter wire format) and `vllm_hidden_states` (vLLM's extract_hidden_states server, with its own faults).
"""

from eagle_pipeline.simulation.answers import (
    Answer,
    AnswerLengths,
    CountCompletion,
    CountPrompt,
    crude_completion_tokens,
    crude_prompt_tokens,
    crude_token_count,
    ids_key,
    request_key,
    synthesize,
    truncate_answer,
)
from eagle_pipeline.simulation.faults import (
    ALL_FAULTS,
    PROMPT_INJECTED_TOKENS,
    QUALITY_FAULTS,
    STATUS_FAULTS,
    TRANSIENT_FAULTS,
    FaultPlan,
)
from eagle_pipeline.simulation.openrouter import SimulatedOpenRouterServer
from eagle_pipeline.simulation.server import LoopbackServer, RequestRecord
from eagle_pipeline.simulation.streaming import STREAM_FAULTS, StreamStyle

__all__ = [
    "ALL_FAULTS",
    "PROMPT_INJECTED_TOKENS",
    "QUALITY_FAULTS",
    "STATUS_FAULTS",
    "STREAM_FAULTS",
    "TRANSIENT_FAULTS",
    "Answer",
    "AnswerLengths",
    "CountCompletion",
    "CountPrompt",
    "FaultPlan",
    "LoopbackServer",
    "RequestRecord",
    "SimulatedOpenRouterServer",
    "StreamStyle",
    "crude_completion_tokens",
    "crude_prompt_tokens",
    "crude_token_count",
    "ids_key",
    "request_key",
    "synthesize",
    "truncate_answer",
]
