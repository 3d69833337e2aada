"""Hidden states from running vLLM `extract_hidden_states` servers: shard runs are HTTP clients, never model loads.

For every merged row of a shard: `POST {endpoint}/v1/completions` with the row's exact ids as the prompt,
`max_tokens: 1`, `return_token_ids: true`; the returned `prompt_token_ids` must equal the ids; the connector's file
(`kv_transfer_params.hidden_states_path`) is read once its `{path}.lock` is free, validated, and copied into the
project's shard (hidden_states/format.py: same file, index and checks as the in-process extractor). A per-request
file is deleted as soon as it is copied into the shard's temporary file, the rest when the shard ends; at most
2 x concurrency x endpoints rows are fetched ahead of the copy. Layer ids: project aux layer k is vLLM id k + 1; the final state is
vLLM id L (`num_hidden_layers`), the last layer's output **before** the final norm. The target's final norm and lm_head
are read from the checkpoint's safetensors files (only those two tensors, and only while the head recorded beside
the shards was not recorded from the checkpoint as it is now) and recorded beside the shards, as the in-process engine
records them, so the audit's norm and teacher checks judge engine shards too.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..shared.aio import run_coroutine
from ..shared.http_client import HttpClient
from ..shared.progress import ProgressCallback
from ..shared.storage import atomic_path
from .fingerprint import ExtractionFingerprint, merged_version
from .format import StreamingSafetensorsWriter, shard_layout, shard_paths, tensor_key
from .head import PRE_NORM, CheckpointHead, TargetHead, checkpoint_head, save_target_head_from_checkpoint
from .layers import resolve_aux_layers
from .merged import count_rows, read_rows, shard_row_range
from .shard_index import IDS_DTYPE, MASK_DTYPE, shard_header, shard_summary, write_shard_index
from .shards import ShardSummary, prepare_shard
from .trainer_layouts import SHARDS, LayoutTarget, final_state_for_layout, without_states
from .vllm_files import (
    EngineShardError,
    FileFacts,
    clean_journal,
    delete_request_files,
    journal_path,
    sweep_orphans,
    vllm_layer_ids,
)
from .vllm_layouts import VllmLayoutRows
from .vllm_requests import ShardRequests
from .vllm_served import apply_length_limit, endpoints_max_model_len, target_without_too_long


def extract_shard_vllm(
    merged_dir: str | Path,
    *,
    shard_index: int,
    shard_size: int,
    out_dir: str | Path,
    endpoints: Sequence[str],
    storage_path: str | Path,
    num_layers: int,
    aux_layers: Sequence[int] | int | None = None,
    hidden_size: int | None = None,
    model_description: dict[str, Any] | None = None,
    head_checkpoint: str | Path | None = None,
    concurrency: int = 8,
    timeout_s: float = 600.0,
    max_retries: int = 4,
    backoff_base_s: float = 2.0,
    fingerprint: ExtractionFingerprint | None = None,
    on_mismatch: str = "refuse",
    force: bool = False,
    too_long_rows: str = "refuse",
    log: Callable[[str], None] | None = None,
    progress: ProgressCallback | None = None,
    layout_target: LayoutTarget | None = None,
) -> ShardSummary:
    """Extract shard `shard_index` through vLLM servers into `out_dir/shard-NNNNN.safetensors` + `.index.parquet`.

    `num_layers` is the target's decoder-layer count (L: the final id); `aux_layers` are in the project's convention
    (default low/mid/high). `fingerprint` (engine 'vllm', final state 'pre_norm', dtype not pinned: the servers')
    is recorded with the shard; by default it names the model by `model_description`. A done shard with that
    fingerprint is skipped (unless `force`); one extracted under other settings is refused or, with
    `on_mismatch='redo'`, moved aside (`shards.prepare_shard`); anything else is redone from the start. A transient
    failure (5xx, timeout, connection, a lock not freed in `timeout_s`, a file not there) is retried up to
    `max_retries` times, on whichever endpoint is free; an invalid file or answer stops the shard with an
    `EngineShardError` naming the shard, row, sample and endpoint, and writes nothing. `head_checkpoint`: the
    target's checkpoint directory, whose final norm and lm_head (`head.checkpoint_head`) are recorded beside the
    shards once the shard is written; it is checked before the first request (a missing tensor stops the run
    then, naming the file). Without it no head is recorded and the audit's norm and teacher checks cannot judge.
    The two tensors are read from the checkpoint only when the recorded head does not carry the checkpoint's current
    key (`head.save_target_head_from_checkpoint`): a later shard run only verifies the recorded file.
    `layout_target` (`trainer_layouts.plan_layout_target`): each row's states go to that trainer's file instead of
    the shard (`vllm_layouts.VllmLayoutRows`: speculators' `hs_{i}` is the connector's file renamed; SpecForge's
    `.ckpt` needs `head_checkpoint` for its post-norm state); the shard keeps ids and masks.
    Before the first request the servers' `max_model_len` is read (`vllm_served.endpoints_max_model_len`): rows the
    servers cannot take stop the shard naming them, or with `too_long_rows='drop'` are left out and recorded in the
    shard's metadata (`dropped_rows`); a done shard that dropped rows is reused only under 'drop'.
    """
    if not endpoints:
        raise ValueError("hidden_states.vllm.endpoints is empty")
    found_head = checkpoint_head(head_checkpoint) if head_checkpoint is not None else None
    if found_head is not None and hidden_size is not None and found_head.hidden_size != hidden_size:
        raise ValueError(f"{head_checkpoint}: hidden_size {found_head.hidden_size}, the servers' model {hidden_size}")
    out_dir, storage = Path(out_dir), Path(storage_path)
    st_path, idx_path = shard_paths(out_dir, shard_index)
    n_rows = count_rows(merged_dir)
    row_start, row_stop = shard_row_range(shard_index, shard_size, n_rows)
    journal = journal_path(out_dir, shard_index)
    out_dir.mkdir(parents=True, exist_ok=True)
    clean_journal(journal)  # files of a run killed before it could delete them
    aux = resolve_aux_layers(aux_layers, num_layers)
    layout = layout_target.name if layout_target is not None else SHARDS
    final_state = final_state_for_layout(layout)
    if final_state != PRE_NORM and found_head is None:
        raise ValueError(
            f"the {layout} layout holds the {final_state} final state: pass head_checkpoint (its final norm)"
        )
    wanted = fingerprint or ExtractionFingerprint(
        model=dict(model_description or {}),
        aux_layers=aux,
        final_state=final_state,
        layout=layout,
        shard_size=shard_size,
        dtype=None,
        merged_version=merged_version(merged_dir),
        engine="vllm",
    )
    if (wanted.engine, wanted.final_state, tuple(wanted.aux_layers)) != ("vllm", final_state, aux):
        raise ValueError(f"fingerprint {wanted.to_dict()} is not one of this engine's shards (aux layers {aux})")
    decision = prepare_shard(out_dir, shard_index, wanted, on_mismatch=on_mismatch, force=force)
    if decision.reuse is not None:
        _check_reused_drops(idx_path, shard_index, too_long_rows)
        return decision.reuse

    layer_ids = vllm_layer_ids(aux, num_layers)
    n_aux = len(aux)
    max_model_len = endpoints_max_model_len(endpoints, timeout_s=timeout_s, log=log)
    rows, dropped = apply_length_limit(
        read_rows(merged_dir, row_start, row_stop), max_model_len, shard_index=shard_index, too_long_rows=too_long_rows
    )
    if too_long_rows == "drop" and layout_target is not None:  # hs_{i} dense without the rows any shard drops
        layout_target = target_without_too_long(layout_target, merged_dir, max_model_len)
    for d in dropped:
        d["reason"] = f"{d['n_tokens']} tokens >= the servers' max_model_len {max_model_len} (too_long_rows: drop)"
        if log is not None:
            log(f"warning: shard {shard_index:05d}: merged row {d['row']} ({d['sample_id']}) dropped: {d['reason']}")
    lengths = rows.lengths
    order = list(range(len(rows)))
    header_extra = {
        **({"final_norm_eps": repr(found_head.eps)} if found_head is not None else {}),
        "engine": "vllm",
        "vllm_layer_ids": json.dumps(list(layer_ids)),
        "vllm_max_model_len": str(max_model_len),
        "dropped_rows": json.dumps(dropped),
        "vllm_layer_ids_convention": "id k = residual entering decoder layer k (= output of layer k-1); "
        "aux layer k -> id k+1; the final state is id num_hidden_layers, the last layer's output before the "
        "final norm (apply the target's final norm for lm_head targets)",
    }
    if layout_target is not None:
        header_extra["layout"] = layout_target.name
    placed = (
        VllmLayoutRows(
            layout_target,
            out_dir,
            dict(zip(rows.sample_ids, rows.loss_mask)),
            n_aux,
            final_norm=_final_norm(found_head) if final_state != PRE_NORM else None,
        )
        if layout_target is not None
        else None
    )
    state: dict[str, Any] = {}

    def write_row(i: int, path: Path, facts: FileFacts) -> None:
        from safetensors import safe_open

        if "writer" not in state:  # the first file fixes H and the dtype of the whole shard
            state["facts"] = facts
            meta = shard_header(
                rows,
                shard_index=shard_index,
                aux=aux,
                num_layers=num_layers,
                hidden_size=facts.hidden_size,
                dtype=facts.dtype,
                final_state=final_state,
                model=model_description or {},
                fingerprint=wanted,
                extra=header_extra,
            )
            layout = shard_layout(
                rows.sample_ids,
                lengths,
                order,
                n_aux=n_aux,
                hidden=facts.hidden_size,
                state_dtype=facts.dtype,
                ids_dtype=IDS_DTYPE,
                mask_dtype=MASK_DTYPE,
            )
            if placed is not None:  # the states go to the trainer's files; the shard keeps ids and masks
                layout = without_states(layout)
            state["writer"] = StreamingSafetensorsWriter(state["fh"], layout, meta)
        first: FileFacts = state["facts"]
        if (facts.hidden_size, facts.dtype) != (first.hidden_size, first.dtype):
            raise EngineShardError(
                f"shard {shard_index:05d}, merged row {rows.global_row(i)} ({rows.sample_ids[i]}): {path} holds "
                f"{facts.dtype} H={facts.hidden_size}, the shard's first file {first.dtype} H={first.hidden_size}: "
                "the endpoints serve different models"
            )
        t, sid, w = facts.tokens, rows.sample_ids[i], state["writer"]
        if placed is not None:
            w.write(tensor_key(sid, "input_ids"), torch.from_numpy(rows.input_ids[i]))
            placed.place(sid, path, torch.from_numpy(rows.input_ids[i]).to(torch.int64))
            return
        with safe_open(str(path), framework="pt") as f:
            hs = f.get_tensor("hidden_states")
        w.write(tensor_key(sid, "aux_hidden_states"), hs[:, :n_aux].reshape(t, n_aux * facts.hidden_size))
        w.write(tensor_key(sid, "final_hidden_state"), hs[:, n_aux])
        w.write(tensor_key(sid, "input_ids"), torch.from_numpy(rows.input_ids[i]))

    t0 = time.perf_counter()
    run: ShardRequests | None = None
    try:
        with open(journal, "a") as journal_file:
            with atomic_path(st_path) as tmp, open(tmp, "wb") as fh:
                state["fh"] = fh
                run = ShardRequests(
                    rows,
                    shard_index=shard_index,
                    endpoints=endpoints,
                    storage_path=storage,
                    layer_ids=layer_ids,
                    hidden_size=hidden_size,
                    concurrency=concurrency,
                    timeout_s=timeout_s,
                    max_retries=max_retries,
                    backoff_base_s=backoff_base_s,
                    journal=journal_file,
                    write_row=write_row,
                    log=log,
                    progress=progress,
                    **({"validate": placed.validate} if placed is not None else {}),
                )
                run_coroutine(run.run)
                writer: StreamingSafetensorsWriter = state["writer"]
                for i in order:
                    writer.write(tensor_key(rows.sample_ids[i], "loss_mask"), torch.from_numpy(rows.loss_mask[i]))
                sha = writer.finish()
                size = writer.total_bytes
            seconds = time.perf_counter() - t0
            facts = state["facts"]
            summary = shard_summary(
                rows,
                shard_index=shard_index,
                paths=(st_path, idx_path),
                sha256=sha,
                size_bytes=size,
                dtype=facts.dtype,
                final_state=final_state,
                fingerprint=wanted,
                seconds=seconds,
                compute_seconds=run.compute_seconds,
                write_wait_seconds=run.write_seconds,
                batches=len(rows),
            )
            extra: dict[str, Any] = {
                "engine": "vllm",
                "vllm_layer_ids": list(layer_ids),
                "vllm_endpoints": list(endpoints),
                "vllm_max_model_len": max_model_len,
                "dropped_rows": dropped,
                "retries": run.retries,
                "final_state": final_state,
            }
            if placed is not None and layout_target is not None:
                extra.update(
                    layout=layout_target.name,
                    layout_root=os.path.relpath(layout_target.root, out_dir),
                    sample_files=placed.files,
                )
            if found_head is not None:  # recorded once the shard is complete: an aborted shard leaves nothing
                _, head_sha = save_target_head_from_checkpoint(found_head, out_dir, log=log)
                extra.update(final_norm_eps=found_head.eps, target_head_sha256=head_sha)
            nonfinite = np.zeros(len(rows), dtype=np.int64)  # refused above: a shard never holds NaN/Inf here
            model = model_description or {}
            write_shard_index(idx_path, rows, summary, nonfinite, hidden=facts.hidden_size, model=model, extra=extra)
    finally:
        # Whatever is left (retried attempts' files; all of them after a failure): never reused, a rerun asks again.
        if placed is not None:
            placed.close()
        if run is not None:
            delete_request_files(run.received)
        sweep_orphans(storage, rows.input_ids)  # files of requests a killed or stopped run never heard back from
        journal.unlink(missing_ok=True)
    return summary


def _final_norm(found: CheckpointHead | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The target's final norm from its checkpoint (only the norm weight is read), for a post-norm layout."""
    from safetensors import safe_open

    assert found is not None
    with safe_open(str(found.norm_file), framework="pt") as f:
        weight = f.get_tensor(found.norm_key)
    return TargetHead(weight, found.eps, torch.empty(0), {}).final_norm


def _check_reused_drops(idx_path: Path, shard_index: int, too_long_rows: str) -> None:
    """A done shard that left rows out (`too_long_rows: drop`) is not the whole range: taken as done only while
    dropping is still the choice."""
    from .format import read_index_meta

    dropped = read_index_meta(idx_path).get("dropped_rows") or []
    if dropped and too_long_rows != "drop":
        named = ", ".join(f"{d['row']} ({d['sample_id']})" for d in dropped[:10])
        raise EngineShardError(
            f"shard {shard_index:05d} is done without {len(dropped)} merged rows, dropped under too_long_rows: drop "
            f"({named}); with too_long_rows: {too_long_rows} it would need them: set it back to drop, or delete the "
            "shard's files and rerun it against servers started with a larger --max-model-len"
        )


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
    from .merged import MergedRows

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
        assert result.facts is not None
        return result.facts

    try:
        return run_coroutine(one)
    finally:
        delete_request_files(run.received)
