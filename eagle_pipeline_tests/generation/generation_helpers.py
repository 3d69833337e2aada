"""Helpers for the generation tests: prompt tables, backend specs against loopback servers, a run wrapper."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

from eagle_pipeline.generation import BackendSpec, SamplingSpec, generate_dataset
from eagle_pipeline.prompts import Prompt, prompts_table

SAMPLING = SamplingSpec(temperature=1.0, top_p=0.95, seed=7, max_tokens=2048, thinking=True)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}, "exact": {"type": "boolean"}},
            "required": ["query"],
        },
    },
}

_TOPICS = [
    "photosynthesis",
    "binary search",
    "glacier formation",
    "compound interest",
    "the French revolution",
    "TCP congestion control",
    "protein folding",
    "tidal forces",
    "Bayesian inference",
    "sourdough fermentation",
]


def make_prompts(
    n: int, *, dataset: str = "B1", sampling: SamplingSpec = SAMPLING, tools_every: int = 0, start: int = 0
) -> pa.Table:
    """n distinct prompts; every `tools_every`-th offers tools."""
    prompts = []
    for i in range(start, start + n):
        topic = _TOPICS[i % len(_TOPICS)]
        tools = [WEATHER_TOOL, SEARCH_TOOL] if tools_every and i % tools_every == 0 else None
        msgs = [
            {"role": "system", "content": "You are concise."},
            {"role": "user", "content": f"Question {i}: explain {topic} with an example."},
        ]
        prompts.append(Prompt(source_id=f"{dataset.lower()}-{i:04d}", messages=msgs, tools=tools))
    return prompts_table(dataset, prompts, sampling.to_dict())


def sim_backend(url: str | None, **kw: Any) -> BackendSpec:
    base: dict[str, Any] = dict(
        name="sim",
        kind="simulated",
        endpoint=url,
        model="moonshotai/kimi-k2.5",
        concurrency=4,
        timeout_s=10.0,
        max_retries=4,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
        circuit_breaker_failures=1000,
    )
    base.update(kw)
    return BackendSpec(**base)


def run(
    prompts: pa.Table,
    backend: BackendSpec,
    root: Path,
    *,
    sampling: SamplingSpec = SAMPLING,
    dataset: str = "B1",
    **kw: Any,
):
    return generate_dataset(
        dataset=dataset,
        prompts=prompts,
        backend=backend,
        sampling=sampling,
        out_dir=root / "responses" / dataset,
        errors_dir=root / "responses" / dataset / "errors",
        **kw,
    )


def out_dirs(root: Path, dataset: str = "B1") -> tuple[Path, Path]:
    return root / "responses" / dataset, root / "responses" / dataset / "errors"
