"""The interface every extraction engine implements (in_process, vllm, torchrun), and what it is given.

`run.run_shard` is the one entry point and the one decision: it asks the engine what it knows of the run before any
model loads (`ShardEngine.facts`), builds the wanted fingerprint from the settings and those facts
(`runtime.fingerprint_for_config`), decides whether the shard is reused, superseded or refused
(`shards.prepare_shard`), checks the disk, and only then hands the engine a `ShardJob` to turn rows into states. No
engine builds a fingerprint, decides reuse or reads the configuration file itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from eagle_pipeline.hidden_states.store.fingerprint import ExtractionFingerprint
from eagle_pipeline.hidden_states.store.shards import ShardSummary
from eagle_pipeline.shared.progress import ProgressCallback

if TYPE_CHECKING:
    from eagle_pipeline.hidden_states.settings import HiddenStatesConfig
    from eagle_pipeline.shared.storage import DataRoot

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
class RunFacts:
    """What an engine knows of a shard run, beyond the settings, that changes what the shard holds; each field None
    where the settings alone decide it.

    `model_identity` and `num_layers`: the model it runs when that is not the checkpoint `hidden_states.model` names
    (a model already in memory); `dtype`: the stored dtype when not the device's default; `left_out`: the sample
    ids of the shard's rows it gives no states for (vLLM under `too_long_rows: drop`: the rows at or over the servers'
    `max_model_len`), sorted; `max_model_len`: the servers' limit those rows were judged by, handed to the job so that
    the shard is cut by the limit the decision used."""

    model_identity: dict[str, Any] | None = None
    num_layers: int | None = None
    dtype: str | None = None
    left_out: tuple[str, ...] | None = None
    max_model_len: int | None = None


@dataclass(frozen=True)
class ShardJob:
    """One shard to extract: shard `shard` of the merged table under `settings` (the `hidden_states` section), its
    fingerprint `wanted` (recorded with the shard), and where to report: `progress(rows_done, rows_total,
    tokens_done, tokens_total)` as rows finish, where the engine can report them (an exception from it aborts the
    shard, leaving nothing partial), and `log` for lines worth a log. The way is clear: no done shard is there.
    `facts` are what the engine reported before the decision (`ShardEngine.facts`)."""

    settings: HiddenStatesConfig
    paths: ExtractionPaths
    shard: int
    vocab_size: int
    wanted: ExtractionFingerprint
    facts: RunFacts = RunFacts()
    progress: ProgressCallback | None = None
    log: Log | None = None


class ShardEngine(Protocol):
    """One extraction engine. `facts` says, before any model loads, what of the run the settings do not
    (`RunFacts`); `extract` writes the job's shard (a shard file and its index, in `paths.out_dir`) under
    `job.wanted`, once `run.run_shard` has decided it is to be extracted."""

    def facts(self, settings: HiddenStatesConfig, paths: ExtractionPaths, shard: int, vocab_size: int) -> RunFacts: ...

    def extract(self, job: ShardJob) -> EngineResult: ...
