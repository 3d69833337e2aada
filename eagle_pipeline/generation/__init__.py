"""Response generation: backends (OpenRouter, vLLM, SGLang, import, simulated), the exactly-once runner. The simulated
OpenRouter server lives in `eagle_pipeline.simulation`. See docs/generation.md (module map in docs/architecture.md).

Nothing is imported here: callers import from the module that defines a name, and a stream worker process
(`stream_workers`) loads only the modules it runs, not the runner's Parquet and configuration stack."""
