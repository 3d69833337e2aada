"""The one shape of a blocking check, for the merged table's checks and each shard's structural and semantic ones:
what a check found (`CheckResult`) and its entry in a stage's registry (`CheckSpec`). A stage's registry is a tuple
of `CheckSpec`s (`merge.checks.MERGED_CHECKS`, `hidden_states.checks.SHARD_CHECKS`); the Dagster shell declares one
blocking asset check per entry, under its name, and nothing else names them.

The response audit's gates (`audit.report.GateResult`) are not checks of this shape: see that class for why."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, TypeVar


@dataclass
class CheckResult:
    """What one check found. `checked` items (samples, rows) of which `failing` failed, the first failing sample ids
    (the stage caps the list; `failing` is always the full count), a `detail` a user reads, and the check's own
    figures (`counts`, e.g. the merged table's `expected_rows`)."""

    name: str
    passed: bool
    checked: int = 0
    failing: int = 0
    failing_sample_ids: list[str] = field(default_factory=list)
    detail: str = ""
    counts: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


Context = TypeVar("Context", contravariant=True)


@dataclass(frozen=True)
class CheckSpec(Generic[Context]):
    """One blocking check of a stage's registry: `name` in the UI and the docs, `description` (what it proves),
    `result` (the name of the CheckResult it reads) and `run`, which computes that result from the stage's check
    context (which shard, which folder)."""

    name: str
    description: str
    result: str
    run: Callable[[Context], CheckResult]
