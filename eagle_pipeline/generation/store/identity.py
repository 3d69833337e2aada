"""What served a stored response (its backend identity), and the one rule for whether it still counts for a dataset.

A committed row answers a current prompt only if its identity matches the identity of the dataset's configured
backend (`BackendIdentity.changes`). The identity is:

- `kind`: openrouter, vllm, sglang, simulated or import. Simulated rows never count for a real backend. Imported
  rows count for every backend, and every row but a simulated one counts for an import (an import fills a
  dataset's prompts on purpose): only their models must agree.
- `model`: the model the backend asks for (compared without case: OpenRouter spells it `moonshotai/kimi-k2.5`,
  a vLLM server `moonshotai/Kimi-K2.5`).
- `endpoint_class`: the API's host for OpenRouter, `self-hosted` for vLLM and SGLang (the same weights on another
  host give the same answers: moving a server keeps its rows), `loopback` for the simulated server a run starts,
  `files` for imports.
- `usage_tokenizer`: for a simulated server a run starts, the tokenizer its usage (billing) figures were counted
  with; the `billing_agreement` audit compares them with the target tokenizer's counts, so rows counted with another
  tokenizer would fail it. Simulated rows are free: changing the target tokenizer regenerates them.

What may differ, on purpose: the backend's name in the YAML, its concurrency, retries, prices, and OpenRouter's
provider routing (`provider:`): the same model served by another provider is kept. Rows of a provider you no longer
want are moved out with `eagle-pipeline retire-responses --provider NAME` (docs/generation.md).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.compute as pc

from eagle_pipeline.generation.spec import BackendKind, BackendSpec

# The counters the Dagster shell gives a simulated server (defs/generation.py); without them it counts ~4 bytes a token.
_COUNTER_KEYS = ("count_completion_tokens", "count_prompt_tokens")
CRUDE_USAGE = "crude (4 bytes a token)"
IMPORT, SIMULATED = BackendKind.IMPORT.value, BackendKind.SIMULATED.value


@dataclass(frozen=True)
class BackendIdentity:
    """What served a response; stored as every row's `backend_identity` (`to_json`)."""

    kind: str
    model: str
    endpoint_class: str
    usage_tokenizer: str | None = None

    @classmethod
    def of(cls, spec: BackendSpec, usage_tokenizer: str | None = None) -> BackendIdentity:
        """The identity of rows `spec` produces. `usage_tokenizer` names the tokenizer a loopback simulated server
        counts usage with (the target's, `tokenizer_label`); ignored for every other backend."""
        usage = None
        if spec.kind is BackendKind.SIMULATED and not spec.endpoint:
            has_counters = any(k in spec.simulated for k in _COUNTER_KEYS)
            usage = usage_tokenizer or ("custom counters" if has_counters else CRUDE_USAGE)
        return cls(
            kind=spec.kind.value, model=spec.model.lower(), endpoint_class=_endpoint_class(spec), usage_tokenizer=usage
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | None) -> BackendIdentity | None:
        """The identity a row recorded; None for a row that recorded none (it matches no backend)."""
        if not text:
            return None
        d: dict[str, Any] = json.loads(text)
        return cls(
            kind=str(d.get("kind")),
            model=str(d.get("model") or ""),
            endpoint_class=str(d.get("endpoint_class")),
            usage_tokenizer=d.get("usage_tokenizer"),
        )

    def changes(self, stored: BackendIdentity | None) -> list[str]:
        """What differs between rows stored under `stored` and this (configured) identity, one phrase each
        ('kind: simulated (stored) -> openrouter (now)'); empty when the rows count."""
        if stored is None:
            return ["backend identity: none recorded (stored) -> " + self.describe() + " (now)"]
        if IMPORT in (stored.kind, self.kind) and not (SIMULATED == stored.kind != self.kind):
            # An import fills a dataset's prompts on purpose, beside a live backend's rows (docs/generation.md,
            # Import): only a model both name must agree. Simulated rows still never count for an import.
            models = (stored.model, self.model)
            return [f"model: {models[0]} (stored) -> {models[1]} (now)"] if all(models) and len(set(models)) > 1 else []
        return [
            f"{name}: {getattr(stored, name)} (stored) -> {getattr(self, name)} (now)"
            for name in ("kind", "model", "endpoint_class", "usage_tokenizer")
            if getattr(stored, name) != getattr(self, name)
        ]

    def describe(self) -> str:
        usage = f", usage counted with {self.usage_tokenizer}" if self.usage_tokenizer else ""
        return f"{self.kind} {self.model} at {self.endpoint_class}{usage}"


def dataset_identity(cfg: Any, dataset: str, tokenizer: Any) -> BackendIdentity:
    """The identity of the backend configured for `dataset` (`cfg` a PipelineConfig; `tokenizer` the target's, which
    a loopback simulated server counts usage with): what its committed rows must match to count."""
    return BackendIdentity.of(cfg.backends[cfg.datasets[dataset].backend], tokenizer_label(tokenizer))


def tokenizer_label(tokenizer: Any) -> str:
    """How a row names the tokenizer its simulated usage was counted with: name, kind and fingerprint."""
    return f"{tokenizer.name} [{tokenizer.kind}] {tokenizer.fingerprint()[:16]}"


def _endpoint_class(spec: BackendSpec) -> str:
    if spec.kind is BackendKind.IMPORT:
        return "files"
    if spec.kind in (BackendKind.VLLM, BackendKind.SGLANG):
        return "self-hosted"
    if spec.kind is BackendKind.SIMULATED and not spec.endpoint:
        return "loopback"
    return (urlsplit(spec.endpoint or "").hostname or spec.endpoint or "").lower()


def counting_identities(identity: BackendIdentity, column: pa.ChunkedArray | pa.Array) -> tuple[pa.Array, str]:
    """Of the `backend_identity` values in `column` (a responses table's), the distinct ones whose rows count for
    `identity` (a value set for `pc.is_in`), and the report of the rows that do not ('' when every row counts)."""
    stored = {r["values"]: int(r["counts"]) for r in pc.value_counts(column).to_pylist()} if len(column) else {}
    counting = sorted(s for s in stored if s is not None and not identity.changes(BackendIdentity.from_json(s)))
    report = _mismatch_report(identity, {k: v for k, v in stored.items() if k not in counting})
    return pa.array(counting, pa.string()), report


def _mismatch_report(identity: BackendIdentity, stored: dict[str | None, int]) -> str:
    """One sentence naming the stored rows that do not count for `identity` (count per stored identity), their
    source and what changed; '' when every row counts."""
    parts = []
    for s, n in sorted(stored.items(), key=lambda kv: str(kv[0])):
        changes = identity.changes(BackendIdentity.from_json(s))
        if changes:
            old = BackendIdentity.from_json(s)
            source = old.describe() if old else "no recorded backend"
            parts.append(f"{n} row(s) from {source} ({'; '.join(changes)})")
    return "; ".join(parts)
