"""Hidden states from running vLLM `extract_hidden_states` servers: shard runs are HTTP clients, never model loads.

For every merged row of a shard: `POST {endpoint}/v1/completions` with the row's exact ids as the prompt,
`max_tokens: 1`, `return_token_ids: true`; the returned `prompt_token_ids` must equal the ids; the connector's file
(`kv_transfer_params.hidden_states_path`) is read once its `{path}.lock` is free, validated, and copied into the
project's shard (hidden_states/store/format.py: same file, index and checks as the in-process extractor). A per-request
file is deleted as soon as it is copied into the shard's temporary file, the rest when the shard ends; at most
2 x concurrency x endpoints rows are fetched ahead of the copy. Layer ids: project aux layer k is vLLM id k + 1; the final state is
vLLM id L (`num_hidden_layers`), the last layer's output **before** the final norm. The target's final norm and lm_head
are read from the checkpoint's safetensors files (only those two tensors, and only while the head recorded beside
the shards was not recorded from the checkpoint as it is now) and recorded beside the shards, as the in-process engine
records them, so the audit's norm and teacher checks judge engine shards too.
"""

from __future__ import annotations

import functools
import io
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle_pipeline.drafter_types import PRE_NORM
from eagle_pipeline.hidden_states.engines.engine import ShardJob
from eagle_pipeline.hidden_states.engines.vllm.vllm_files import (
    FileFacts,
    clean_journal,
    delete_request_files,
    journal_path,
    sweep_orphans,
    vllm_layer_ids,
)
from eagle_pipeline.hidden_states.engines.vllm.vllm_layouts import VllmLayoutRows, VllmShardFile
from eagle_pipeline.hidden_states.engines.vllm.vllm_requests import ShardRequests
from eagle_pipeline.hidden_states.engines.vllm.vllm_served import apply_length_limit, target_without_too_long, too_long
from eagle_pipeline.hidden_states.layouts.trainer_layouts import LayoutTarget, layout_of, plan_layout_target
from eagle_pipeline.hidden_states.settings import SHARDS
from eagle_pipeline.hidden_states.store.fingerprint import ExtractionFingerprint
from eagle_pipeline.hidden_states.store.head import (
    CheckpointHead,
    TargetHead,
    checkpoint_head,
    save_target_head_from_checkpoint,
)
from eagle_pipeline.hidden_states.store.merged import MergedRows, count_rows, read_rows, shard_row_range
from eagle_pipeline.hidden_states.store.shard_writer import ShardFacts, ShardRun, ShardWriter, VllmFacts
from eagle_pipeline.hidden_states.store.shards import ShardSummary
from eagle_pipeline.shared.aio import run_coroutine
from eagle_pipeline.shared.http_client import HttpClient


@dataclass(frozen=True)
class EngineModel:
    """The model the servers run, as a shard run knows it without loading it: its shape
    (`model.describe_model_config`), the checkpoint its final norm and lm_head are read from (None: not recorded;
    the audit's norm and teacher checks cannot judge then), and its identity when that is not the checkpoint's
    `hidden_states.model` names (None)."""

    description: dict[str, Any]
    checkpoint: Path | None
    identity: dict[str, Any] | None = None

    @property
    def num_layers(self) -> int:
        return int(self.description["num_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.description["hidden_size"])


def extract_shard_vllm(
    job: ShardJob, model: EngineModel, endpoints: Sequence[str], *, backoff_base_s: float = 2.0
) -> ShardSummary:
    """Extract the job's shard through the vLLM servers at `endpoints` into `out_dir/shard-NNNNN.safetensors` +
    `.index.parquet`, under `job.wanted` (engine 'vllm', dtype not pinned: the servers'); whether it is to be
    extracted was decided before (`run.run_shard`), with the servers' `max_model_len` in `job.facts`.

    A transient failure (5xx, timeout, connection, a lock not freed in `timeout_s`, a file not there) is retried up
    to `hidden_states.vllm.max_retries` times, on whichever endpoint is free; an invalid file or answer stops the
    shard with an `EngineShardError` naming the shard, row, sample and endpoint, and writes nothing. The model's
    checkpoint (checked before the first request) gives the final norm and lm_head recorded beside the shards once
    the shard is written, read only while the recorded head lacks the checkpoint's key
    (`head.save_target_head_from_checkpoint`). With `hidden_states.layout` a trainer's, each row's states go to that
    trainer's file instead of the shard (`vllm_layouts.VllmLayoutRows`; SpecForge's post-norm `.ckpt` needs the
    checkpoint). Rows at or over the servers' limit stop the shard naming them, or with `too_long_rows: drop` are
    left out and recorded (`dropped_rows`; the fingerprint's `left_out`).
    """
    h, v, paths, out_dir = job.settings, job.settings.vllm, job.paths, Path(job.paths.out_dir)
    layout_target = plan_layout_target(h.layout, paths.exports_dir / h.layout, paths.merged_dir, quantize=h.quantize)
    found_head, final_state = _checked_settings(endpoints, layout_target, model.checkpoint, model.hidden_size)
    if job.wanted.final_state != final_state:
        raise ValueError(f"the vLLM servers give the {final_state} state; the job asks for {job.wanted.final_state}")
    max_model_len = job.facts.max_model_len
    if max_model_len is None:
        raise ValueError("the vLLM engine's job needs the servers' max_model_len (VLLMEngine.facts)")
    row_range = shard_row_range(job.shard, job.wanted.shard_size, count_rows(paths.merged_dir))
    journal = _fresh_journal(out_dir, job.shard)
    rows, dropped = apply_length_limit(
        read_rows(paths.merged_dir, *row_range),
        max_model_len,
        shard_index=job.shard,
        too_long_rows=v.too_long_rows,
        log=job.log,
    )
    shard = _VllmShard(
        index=job.shard,
        rows=rows,
        num_layers=model.num_layers,
        fingerprint=job.wanted,
        model=model.description,
        max_model_len=max_model_len,
        dropped=dropped,
        head=found_head,
        layout_target=_dense_target(layout_target, paths.merged_dir, max_model_len, v.too_long_rows),
        endpoints=tuple(endpoints),
    )
    requests = functools.partial(
        ShardRequests,
        storage_path=Path(v.storage_path),
        hidden_size=model.hidden_size,
        concurrency=v.concurrency,
        timeout_s=v.timeout_s,
        max_retries=v.max_retries,
        backoff_base_s=backoff_base_s,
        log=job.log,
        progress=job.progress,
    )
    return _run_shard(shard, out_dir, journal, requests, Path(v.storage_path), log=job.log)


def left_out_rows(merged_dir: str | Path, shard: int, shard_size: int, max_model_len: int) -> tuple[str, ...]:
    """The sample ids of shard `shard`'s rows a server of `max_model_len` cannot take (`vllm_served.too_long`),
    sorted: what the shard leaves out under `too_long_rows: drop`."""
    row_range = shard_row_range(shard, shard_size, count_rows(merged_dir))
    rows = read_rows(merged_dir, *row_range)
    return tuple(sorted(sid for sid, n in zip(rows.sample_ids, rows.lengths) if too_long(n, max_model_len)))


def _dense_target(
    target: LayoutTarget | None, merged_dir: str | Path, max_model_len: int, too_long_rows: str
) -> LayoutTarget | None:
    """Under `too_long_rows: drop` speculators' hs_{i} stay dense without the rows any shard drops."""
    if too_long_rows == "drop" and target is not None:
        return target_without_too_long(target, merged_dir, max_model_len)
    return target


@dataclass(frozen=True)
class _VllmShard:
    """What one shard run fixed before its first request: the rows to ask for and how their states are stored."""

    index: int
    rows: MergedRows
    num_layers: int
    fingerprint: ExtractionFingerprint  # its aux layers and final state are the shard's
    model: dict[str, Any]
    max_model_len: int
    dropped: list[dict[str, Any]]  # rows left out under too_long_rows: drop
    head: CheckpointHead | None
    layout_target: LayoutTarget | None
    endpoints: tuple[str, ...]  # as configured (recorded in the index)

    @property
    def aux(self) -> tuple[int, ...]:
        return tuple(self.fingerprint.aux_layers)

    @property
    def final_state(self) -> str:
        return self.fingerprint.final_state

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return vllm_layer_ids(self.aux, self.num_layers)

    def facts(self, file: FileFacts) -> ShardFacts:
        """The shard's facts, once the first file fixed H and the dtype."""
        layout = self.layout_target
        return ShardFacts(
            index=self.index,
            rows=self.rows,
            fingerprint=self.fingerprint,
            num_layers=self.num_layers,
            hidden_size=file.hidden_size,
            dtype=file.dtype,
            model=self.model,
            final_norm_eps=self.head.eps if self.head is not None else None,
            layout=layout.name if layout is not None else None,
            layout_root=layout.root if layout is not None else None,
            vllm=VllmFacts(self.layer_ids, self.max_model_len, self.endpoints, self.dropped),
        )


def _checked_settings(
    endpoints: Sequence[str],
    layout_target: LayoutTarget | None,
    head_checkpoint: str | Path | None,
    hidden_size: int | None,
) -> tuple[CheckpointHead | None, str]:
    """Checked before anything is read: the checkpoint's final norm and lm_head (found, not read; None without a
    checkpoint) and the final state the layout holds (a post-norm one needs the checkpoint's final norm)."""
    if not endpoints:
        raise ValueError("hidden_states.vllm.endpoints is empty")
    found = checkpoint_head(head_checkpoint) if head_checkpoint is not None else None
    if found is not None and hidden_size is not None and found.hidden_size != hidden_size:
        raise ValueError(f"{head_checkpoint}: hidden_size {found.hidden_size}, the servers' model {hidden_size}")
    layout = layout_target.name if layout_target is not None else SHARDS
    final_state = layout_of(layout).final_state
    if final_state != PRE_NORM and found is None:
        raise ValueError(
            f"the {layout} layout holds the {final_state} final state: pass head_checkpoint (its final norm)"
        )
    return found, final_state


def _fresh_journal(out_dir: Path, shard_index: int) -> Path:
    """The shard's request journal, after deleting the files a run killed before it could delete them listed."""
    journal = journal_path(out_dir, shard_index)
    out_dir.mkdir(parents=True, exist_ok=True)
    clean_journal(journal)
    return journal


def _run_shard(
    shard: _VllmShard,
    out_dir: Path,
    journal: Path,
    requests: Callable[..., ShardRequests],
    storage: Path,
    *,
    log: Callable[[str], None] | None,
) -> ShardSummary:
    """Request every row, copy the files into the shard, then write the head and the index (the 'done' marker).
    Whatever is left of the connector's files is deleted, whatever happened."""
    placed = _layout_rows(shard, out_dir)
    t0 = time.perf_counter()
    run: ShardRequests | None = None
    try:
        with open(journal, "a") as journal_file:
            with ShardWriter(out_dir, shard.index) as writer:
                run = requests(
                    shard.rows,
                    shard_index=shard.index,
                    endpoints=shard.endpoints,
                    layer_ids=shard.layer_ids,
                    journal=journal_file,
                    write_row=VllmShardFile(writer, shard.facts, placed),
                    **({"validate": placed.validate} if placed is not None else {}),
                )
                run_coroutine(run.run)
            done = ShardRun(
                seconds=time.perf_counter() - t0,
                compute_seconds=run.compute_seconds,
                write_wait_seconds=run.write_seconds,
                batches=len(shard.rows),
                nonfinite=np.zeros(len(shard.rows), dtype=np.int64),  # refused: a shard never holds NaN/Inf here
                sample_files=placed.files if placed is not None else [],
                retries=run.retries,
            )
            if shard.head is not None:  # recorded once the shard is complete: an aborted shard leaves nothing
                _, done.head_sha256 = save_target_head_from_checkpoint(shard.head, out_dir, log=log)
            return writer.write_index(done)
    finally:
        # Whatever is left (retried attempts' files; all of them after a failure): never reused, a rerun asks again.
        if placed is not None:
            placed.close()
        if run is not None:
            delete_request_files(run.received)
        sweep_orphans(storage, shard.rows.input_ids)  # files of requests a killed or stopped run never heard back from
        journal.unlink(missing_ok=True)


def _layout_rows(shard: _VllmShard, out_dir: Path) -> VllmLayoutRows | None:
    """Where each row's states go in the trainer's layout; None when they go into the shard file."""
    if shard.layout_target is None:
        return None
    rows = shard.rows
    return VllmLayoutRows(
        shard.layout_target,
        out_dir,
        dict(zip(rows.sample_ids, rows.loss_mask)),
        len(shard.aux),
        final_norm=_final_norm(shard.head) if shard.final_state != PRE_NORM else None,
    )


def _final_norm(found: CheckpointHead | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The target's final norm from its checkpoint (only the norm weight is read), for a post-norm layout."""
    from safetensors import safe_open

    assert found is not None
    with safe_open(str(found.norm_file), framework="pt") as f:
        weight = f.get_tensor(found.norm_key)
    return TargetHead(weight, found.eps, torch.empty(0), {}).final_norm


def smoke_request(
    endpoint: str,
    *,
    storage_path: str | Path,
    ids: Sequence[int],
    layer_ids: tuple[int, ...],
    hidden_size: int | None,
    timeout_s: float = 600.0,
) -> FileFacts:
    """One request exactly as a shard run sends it, its file validated and then deleted; raises RequestFailure."""
    from eagle_pipeline.hidden_states.store.merged import MergedRows

    row = np.asarray(list(ids), dtype=np.int32)
    rows = MergedRows(0, ["smoke"], ["smoke"], [row], [np.ones(len(row), dtype=np.int8)])
    run = ShardRequests(
        rows,
        shard_index=0,
        endpoints=[endpoint],
        storage_path=Path(storage_path),
        layer_ids=layer_ids,
        hidden_size=hidden_size,
        concurrency=1,
        timeout_s=timeout_s,
        max_retries=0,
        backoff_base_s=0.0,
        journal=io.StringIO(),
        write_row=lambda *_: None,
        log=None,
        progress=None,
    )

    async def one() -> FileFacts:
        async with HttpClient(concurrency=1, timeout_s=timeout_s) as client:
            result = await run._one(client, endpoint.rstrip("/"), 0)
        assert result.file is not None
        result.file.close()
        return result.file.facts

    try:
        return run_coroutine(one)
    finally:
        delete_request_files(run.received)
