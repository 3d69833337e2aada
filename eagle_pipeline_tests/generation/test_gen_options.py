"""A run's options (`RunOptions`): one definition per setting, shared with the configuration's `generation` section,
taken as one object (`options=`), the only way the runner takes them."""

from __future__ import annotations

import dataclasses
import inspect

import pydantic
import pytest

from eagle_pipeline.generation.run.options import CommitCadence, GenerationSettings, RunOptions
from eagle_pipeline.generation.run.runner import agenerate_dataset, generate_dataset
from eagle_pipeline.simulation import SimulatedOpenRouterServer

from .generation_helpers import SAMPLING, make_prompts, run, sim_backend

CADENCE = {f.name for f in dataclasses.fields(CommitCadence)}


def test_each_cadence_setting_is_defined_once():
    # The section and the run options inherit the cadence; neither declares (and so defaults) a field of it again.
    assert {"commit_every_rows", "commit_every_s", "answer_log_s", "progress_every_s"} == CADENCE
    for cls in (GenerationSettings, RunOptions):
        assert issubclass(cls, CommitCadence)
        assert not CADENCE & set(inspect.get_annotations(cls)), cls
    # Nor do the runner's entry points list an option as a parameter of their own.
    fields = {f.name for f in dataclasses.fields(RunOptions)}
    for fn in (generate_dataset, agenerate_dataset):
        assert not fields & set(inspect.signature(fn).parameters), fn


def test_a_configured_run_takes_the_sections_cadence_and_the_datasets_options():
    settings = GenerationSettings(commit_every_rows=7, commit_every_s=2.5, answer_log_s=0.2, progress_every_s=1.0)
    opts = RunOptions.from_settings(settings, budget_usd=3.0, regenerate="all_turns")
    assert {k: getattr(opts, k) for k in CADENCE} == {k: getattr(settings, k) for k in CADENCE}
    assert (opts.budget_usd, opts.regenerate, opts.limit) == (3.0, "all_turns", None)


def test_options_are_checked_and_only_the_object_passes_them(tmp_path):
    with pytest.raises(pydantic.ValidationError, match="commit_every_row"):
        RunOptions(commit_every_row=3)  # a misspelt option is refused, not ignored
    with pytest.raises(pydantic.ValidationError, match="commit_every_rows"):
        RunOptions(commit_every_rows=0)
    assert RunOptions(answer_log_s=None).answer_log_s is None  # the API can turn the answer log off
    with pytest.raises(TypeError, match="limit"):  # one way to pass an option: the object
        generate_dataset(
            dataset="B1",
            prompts=make_prompts(1),
            backend=sim_backend("http://127.0.0.1:9"),
            sampling=SAMPLING,
            out_dir=tmp_path / "r",
            errors_dir=tmp_path / "e",
            limit=4,
        )
    assert not (tmp_path / "r").exists()


def test_the_options_object_runs(tmp_path):
    prompts = make_prompts(10)
    with SimulatedOpenRouterServer() as srv:
        by_object = run(prompts, sim_backend(srv.url), tmp_path / "a", options=RunOptions(limit=4, answer_log_s=None))
    assert (by_object.total_prompts, by_object.completed, by_object.answer_log_s) == (4, 4, None)
    assert srv.total_requests == 4
