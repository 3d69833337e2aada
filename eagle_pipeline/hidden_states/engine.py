"""The interface every extraction engine implements (in_process, vllm, torchrun), and what it is given.

`run.run_shard` is the one entry point: it decides whether a shard is already done under the wanted fingerprint,
then hands it to the engine `hidden_states.engine` names (`run.ENGINES`). Each engine is one module implementing
`ShardEngine.extract`; none decides reuse or reads the configuration file itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..shared.progress import ProgressCallback
from .fingerprint import ExtractionFingerprint
from .shards import ShardSummary

if TYPE_CHECKING:
    from ..shared.storage import DataRoot
    from .settings import HiddenStatesConfig

Log = Callable[[str], None]


@dataclass(frozen=True)
class ExtractionPaths:
    """Where a shard run reads and writes: the merged table, the shards (with the recorded head, and the seeded
    tiny model saved once beside them in their parent folder), and the export folder a trainer layout is written
    into directly (`hidden_states.layout` other than 'shards')."""

    merged_dir: Path
    out_dir: Path
    exports_dir: Path

    @classmethod
    def of(cls, root: DataRoot) -> ExtractionPaths:
        """The paths of a data root (`storage.DataRoot`): merged/, hidden_states/, exports/."""
        return cls(root.merged_dir, root.hidden_states_dir, root.exports_dir)

    @property
    def cache_dir(self) -> Path:
        """Where a `tiny-random` model is saved once for engines that load a checkpoint (torchrun ranks, the vLLM
        engine's head)."""
        return Path(self.out_dir).parent


@dataclass(frozen=True)
class EngineResult:
    """What an engine returns for one extracted shard: its summary and where it ran (a device, servers, a world)."""

    summary: ShardSummary
    device: str


@dataclass(frozen=True)
class ShardJob:
    """One shard to extract: shard `shard` of the merged table under `settings` (the `hidden_states` section), its
    fingerprint `wanted` (recorded with the shard), and where to report: `progress(rows_done, rows_total,
    tokens_done, tokens_total)` as rows finish, where the engine can report them (an exception from it aborts the
    shard, leaving nothing partial), and `log` for lines worth a log."""

    settings: HiddenStatesConfig
    paths: ExtractionPaths
    shard: int
    vocab_size: int
    wanted: ExtractionFingerprint
    progress: ProgressCallback | None = None
    log: Log | None = None


class ShardEngine(Protocol):
    """One extraction engine: `extract` writes the job's shard (a shard file and its index, in `paths.out_dir`);
    `run.run_shard` has already decided the shard is not done."""

    def extract(self, job: ShardJob) -> EngineResult: ...
