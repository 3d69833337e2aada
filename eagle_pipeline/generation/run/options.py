"""The options of one generation run (`generate_dataset(options=RunOptions(...))`), each defined once with its default.

`CommitCadence` (how often a run commits, writes its answer log and reports progress) is both part of every run's
options and the configuration's `generation` section (`GenerationSettings` extends it with the budget of all datasets;
`eagle_pipeline.config` assembles it), so the Python API and the YAML file share one type, bound and default per
setting.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from pydantic import Field
from pydantic.dataclasses import dataclass

from eagle_pipeline.generation.plan.turns import LAST_TURN
from eagle_pipeline.generation.store.answer_log import DEFAULT_FLUSH_S
from eagle_pipeline.generation.summary import DEFAULT_PROGRESS_EVERY_S
from eagle_pipeline.shared.spec_model import SPEC_CONFIG, Float, Int, SpecBase, Str


@dataclass(frozen=True, config=SPEC_CONFIG)
class CommitCadence(SpecBase):
    """When rows are committed (every `commit_every_rows` rows or `commit_every_s` seconds), how often the answer log
    is written and fsynced (`answer_log_s`; None: no log, a kill then loses the commit window's rows) and how often
    progress is reported."""

    commit_every_rows: Annotated[Int, Field(ge=1)] = 500
    commit_every_s: Annotated[Float, Field(ge=0)] = 10.0
    # Durability only (what a kill -9 can lose), never the rows: not part of any sample id or fingerprint.
    answer_log_s: Annotated[Float, Field(gt=0)] | None = DEFAULT_FLUSH_S
    progress_every_s: Annotated[Float, Field(ge=0)] = DEFAULT_PROGRESS_EVERY_S


@dataclass(frozen=True, config=SPEC_CONFIG)
class GenerationSettings(CommitCadence):
    """The configuration's `generation` section, run-wide: the commit cadence, answer-log interval and progress of every
    run (`CommitCadence`, each run's options too) and the budget of all datasets. A null in the file
    takes the default, so the file cannot turn the answer log off (the Python API's `answer_log_s=None` can)."""

    label = "generation"

    budget_usd: Annotated[Float, Field(ge=0)] | None = None


@dataclass(frozen=True, config=SPEC_CONFIG)
class RunOptions(CommitCadence):
    """How one `generate_dataset` run commits and reports (`CommitCadence`), what it may spend on this dataset
    (`budget_usd`, on top of a shared cap passed as `run_budget`), how many of the prompts it asks for at most
    (`limit`, None: all) and which turns it regenerates (`regenerate`: 'last_turn' | 'all_turns')."""

    label = "run options"

    budget_usd: Annotated[Float, Field(ge=0)] | None = None
    limit: Int | None = None
    regenerate: Str = LAST_TURN

    @classmethod
    def from_settings(cls, cadence: CommitCadence, **per_dataset: Any) -> RunOptions:
        """The run options of a configured run: the `generation` section's cadence and the dataset's own options."""
        shared = {f.name: getattr(cadence, f.name) for f in dataclasses.fields(CommitCadence)}
        return cls(**shared, **per_dataset)
