"""The generation runner: `generate_dataset`, exactly-once resume, and the set-up and tear-down of a run.

A run first folds the answer log a killed run left into shards (`shards.recover_answer_log`), reads the committed shards
once (`shards.read_committed`), requests only the missing prompts through a fixed pool of worker coroutines (bounded
memory: one prompt per worker in flight), and commits rows in atomically written `part-NNNNN.parquet` shards every N
rows or T seconds (`sink.ShardSink`), logging each row meanwhile (`answer_log`). A kill -9 loses only the answers of the
last ~0.1 s and the requests in flight, and the next run requests exactly those again. The prompts to request are chosen
by `pending`, the request loop is `live.LiveRun`, rows are built by `rows`, spend is accounted by `budget`; an 'import'
backend is handed to `importer.ImportRun`.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import pyarrow as pa

from eagle_pipeline.generation.backends.client import ChatClient
from eagle_pipeline.generation.backends.stream_workers import stream_workers
from eagle_pipeline.generation.backends.wire import RenderPromptIds, make_backend
from eagle_pipeline.generation.importing.importer import ImportRun
from eagle_pipeline.generation.plan.pending import RequestPlan, plan_requests
from eagle_pipeline.generation.plan.turns import ALL_TURNS, NO_TURN_KINDS, REGENERATE_MODES
from eagle_pipeline.generation.run.live import LiveRun, row_provenance
from eagle_pipeline.generation.run.options import CommitCadence, RunOptions
from eagle_pipeline.generation.spec import BackendSpec, SamplingSpec
from eagle_pipeline.generation.spend.budget import SpendLedger
from eagle_pipeline.generation.spend.ledger import SharedSpend
from eagle_pipeline.generation.store import shards
from eagle_pipeline.generation.store.identity import BackendIdentity
from eagle_pipeline.generation.store.retire import complete_pending_retirements
from eagle_pipeline.generation.store.sink import ShardSink
from eagle_pipeline.generation.summary import GenerationSummary, ProgressEvent
from eagle_pipeline.shared import storage
from eagle_pipeline.shared.aio import gc_tuned, run_coroutine
from eagle_pipeline.shared.failures import Redactor

log = logging.getLogger("eagle_pipeline.generation")
P = ParamSpec("P")
R = TypeVar("R")

APP_HEADERS = {"HTTP-Referer": "https://github.com/eagle-pipeline/eagle-pipeline", "X-Title": "eagle-pipeline"}


def _api_key(spec: BackendSpec) -> str | None:
    if not spec.api_key_env:
        return None
    value = os.environ.get(spec.api_key_env)
    if not value:
        raise RuntimeError(f"backend {spec.name!r}: environment variable {spec.api_key_env} is not set")
    return value


def _request_headers(spec: BackendSpec, key: str | None) -> dict[str, str]:
    headers = dict(APP_HEADERS) if spec.kind.speaks_openrouter else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return headers


@contextlib.contextmanager
def backend_endpoint(spec: BackendSpec) -> Iterator[BackendSpec]:
    """The spec to call: a 'simulated' spec without an endpoint gets a `SimulatedOpenRouterServer` on loopback for
    the duration of the run, serving `spec.model` at the spec's prices (the server's own when it sets none; an unset
    one of the two is 0) with `spec.simulated` as further constructor arguments (the Dagster shell adds the target
    tokenizer's counters there); any other spec as it is.

    The one place the product starts the simulated server: `eagle_pipeline.simulation` is imported here, at call time,
    so a run against a real endpoint never loads it (docs/architecture.md, "The simulation seam")."""
    if spec.kind != "simulated" or spec.endpoint:
        yield spec
        return
    from eagle_pipeline.simulation import SimulatedOpenRouterServer

    options: dict[str, Any] = {"model": spec.model}
    if spec.price_per_m_prompt is not None or spec.price_per_m_completion is not None:
        options["price_per_m_prompt"] = spec.price_per_m_prompt or 0.0
        options["price_per_m_completion"] = spec.price_per_m_completion or 0.0
    with SimulatedOpenRouterServer(**{**options, **spec.simulated}) as server:
        yield replace(spec, endpoint=server.url)


async def _generate_live(
    *,
    dataset: str,
    plan: RequestPlan,
    backend: BackendSpec,
    sampling: SamplingSpec,
    sink: ShardSink,
    render_prompt_ids: RenderPromptIds | None,
    identity: BackendIdentity,
    ledger: SpendLedger,
    cadence: CommitCadence,
    progress: Callable[[ProgressEvent], None] | None,
) -> GenerationSummary:
    """Request the plan's prompts from a live endpoint; every row and error in hand is committed whatever happens."""
    try:
        key = _api_key(backend)
        with backend_endpoint(backend) as spec:
            run = LiveRun(
                dataset=dataset,
                plan=plan,
                backend=spec,
                http_backend=make_backend(spec, sampling, render_prompt_ids),
                provenance=row_provenance(dataset, spec, sampling, identity),
                sink=sink,
                redact=Redactor([key] if key else []),
                ledger=ledger,
                cadence=cadence,
                progress=progress,
            )
            log.info(
                "[%s] %d prompts, %d already committed, %d to request from %s (%s, %d in flight)",
                dataset,
                plan.total,
                plan.already_done,
                len(plan.items),
                spec.name,
                spec.kind,
                run.n_workers,
            )
            if plan.items:
                headers = _request_headers(spec, key)
                with gc_tuned():
                    async with (
                        stream_workers(  # the same connection settings in every worker process
                            spec.stream_processes_for(run.n_workers),
                            concurrency=run.n_workers,
                            timeout_s=spec.timeout_s,
                            max_request_s=spec.max_request_s,
                            headers=headers,
                        ) as streamer,
                        ChatClient(
                            concurrency=run.n_workers,
                            timeout_s=spec.timeout_s,
                            max_request_s=spec.max_request_s,
                            headers=headers,
                            streamer=streamer,
                        ) as client,
                    ):
                        await run.run(client)
    finally:
        # Whatever happened (a stop, cancellation, a bug), commit every row and error in hand.
        await sink.close()
    return run.summary()


async def agenerate_dataset(
    *,
    dataset: str,
    prompts: pa.Table,
    backend: BackendSpec,
    sampling: SamplingSpec,
    out_dir: Path,
    errors_dir: Path,
    options: RunOptions | None = None,
    render_prompt_ids: RenderPromptIds | None = None,
    usage_tokenizer: str | None = None,
    run_budget: SharedSpend | None = None,
    progress: Callable[[ProgressEvent], None] | None = None,
) -> GenerationSummary:
    """The async form of `generate_dataset` (same arguments), for callers that already run an event loop."""
    opts = options or RunOptions()
    _check_regenerate(opts.regenerate, backend)
    t_start = time.monotonic()
    out_dir, errors_dir = Path(out_dir), Path(errors_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    errors_dir.mkdir(parents=True, exist_ok=True)
    with shards.DirLock(out_dir):
        # A killed writer may have left hidden temporaries; they were never committed.
        storage.clean_stale_tmp(out_dir)
        storage.clean_stale_tmp(errors_dir)
        complete_pending_retirements(out_dir)  # a retirement interrupted after its commit point is finished first
        recovered = shards.recover_answer_log(out_dir, errors_dir)  # a killed run's answers count as committed
        identity = BackendIdentity.of(backend, usage_tokenizer)
        plan, committed_usd = _plan_against_store(dataset, backend.name, prompts, out_dir, identity, opts)
        # Imports are not logged: a killed import reads its files again at no cost.
        sink = ShardSink(out_dir, errors_dir, answer_log_s=opts.answer_log_s if backend.kind.is_http else None)
        if not backend.kind.is_http:
            importer = ImportRun(
                dataset=dataset,
                plan=plan,
                backend=backend,
                sampling=sampling,
                sink=sink,
                commit_every_rows=opts.commit_every_rows,
            )
            summary = await importer.run()
            label = "import"
        else:
            # A shared cap: this run takes its slot in the data root's spend ledger (refused there: nothing is
            # requested) and leaves it once every row is committed.
            with (
                run_budget.join(dataset, committed_usd)
                if run_budget is not None
                else contextlib.nullcontext() as shared
            ):
                summary = await _generate_live(
                    dataset=dataset,
                    plan=plan,
                    backend=backend,
                    sampling=sampling,
                    sink=sink,
                    render_prompt_ids=render_prompt_ids,
                    identity=identity,
                    ledger=SpendLedger(committed_usd=committed_usd, budget_usd=opts.budget_usd, run_budget=shared),
                    cadence=opts,
                    progress=progress,
                )
            label = "summary"
        summary.elapsed_s = time.monotonic() - t_start
        summary.shards_written = sink.shards_written
        summary.recovered_from_log = recovered.responses
        summary.answer_log_s = sink.log.flush_interval_s if sink.log is not None else None
        log.info("[%s] %s: %s", dataset, label, json.dumps(summary.to_dict()))
        return summary


def _plan_against_store(
    dataset: str, backend_name: str, prompts: pa.Table, out_dir: Path, identity: BackendIdentity, opts: RunOptions
) -> tuple[RequestPlan, float]:
    """What this run requests, and the spend already committed, from one read of the shards (the plan, its progress
    counts and the spend ledger all come from it). Rows another backend produced (another kind, model, endpoint
    class, or simulated usage counted with another tokenizer: generation/store/identity.py) stay on disk but answer
    nothing: their prompts are requested again. The committed rows are not held past the plan."""
    committed = shards.read_committed(out_dir, identity)
    if committed.mismatched:
        log.warning(
            "[%s] committed rows that do not count for backend %r (%s): %s; kept on disk, their prompts are "
            "requested again",
            dataset,
            backend_name,
            identity.describe(),
            committed.mismatched,
        )
    return plan_requests(prompts, committed, opts.limit, regenerate=opts.regenerate), committed.spend_usd


def _check_regenerate(regenerate: str, backend: BackendSpec) -> None:
    if regenerate not in REGENERATE_MODES:
        raise ValueError(f"regenerate must be one of {list(REGENERATE_MODES)}, got {regenerate!r}")
    if regenerate == ALL_TURNS and backend.kind in NO_TURN_KINDS:
        raise ValueError(f"backend {backend.name!r}: regenerate 'all_turns' is not available for kind {backend.kind!r}")


def _signature_of(model: Callable[P, Any]) -> Callable[[Callable[..., R]], Callable[P, R]]:
    """Gives the decorated function the parameters of `model` (for type checkers and `inspect.signature`)."""

    def give(f: Callable[..., R]) -> Callable[P, R]:
        f.__signature__ = inspect.signature(model)  # type: ignore[attr-defined]
        return f

    return give


@_signature_of(agenerate_dataset)
def generate_dataset(*args: Any, **kwargs: Any) -> GenerationSummary:
    """Generate (or import) responses for every prompt of `prompts` not yet committed under `out_dir`.

    Exactly-once: rows are committed in atomically renamed shards and a rerun requests only the sample ids missing
    from them (a rerun after success makes no request). Every answer is also in an answer log beside the shards
    within `answer_log_s` seconds (written and fsynced; None: no log, a kill then loses the rows of the commit
    window), which the next run folds into shards, so a kill -9 loses no answered work. Failed requests go to
    `errors_dir`; a stop for auth, credits, budget or the circuit breaker commits everything done and is reported in
    `stopped_reason`.

    `options` (`RunOptions`): the commit cadence, the answer-log interval, progress reports, this dataset's budget,
    `limit` and `regenerate` (`options=RunOptions(budget_usd=50.0)`).
    `regenerate='all_turns'` regenerates every assistant turn of each prompt's conversation against the target's own
    earlier turns, one row per turn, exactly once per turn (generation/plan/turns.py, docs/generation.md).
    """
    return run_coroutine(lambda: agenerate_dataset(*args, **kwargs))
