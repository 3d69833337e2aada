"""Where a vLLM shard's rows go: the shard file (`VllmShardFile`, through the one shard writer
`shard_writer.ShardWriter`), or straight into a trainer's layout (`hidden_states.layout: speculators | specforge`,
`VllmLayoutRows`).

The shard file keeps only ids and masks, as the in-process layouts do (`trainer_layouts.SampleFilesWriter`); each
row's states go to the trainer's file named by `trainer_layouts.plan_layout_target`, recorded (path, size, XXH3-128)
for the shard index's `sample_files`, which `shard_status`, `open_shard` and every check read.

Every path reads each connector file once: `vllm_files.validate_states_file` maps it in the request worker, and the
writer gets that mapping (`ConnectorFile`), never the file again.

* A layout whose file the connector's already is (`Layout.takes_connector_file`: speculators' `hs_{i}.safetensors`,
  pre-norm final state, vLLM's layer order): `validate` adds the digest to the one read and `place` renames it (one filesystem) or writes the mapped bytes once
  (`vllm_handoff.place_file`). With `quantize: fp8` `validate` also quantizes the mapped bf16 states in the worker
  (`fp8.sample_file`: e4m3 with fp32 scales per token per layer) and `place` writes that FP8 `hs_{i}` (atomic); the
  bf16 file is then deleted like any copied one.
* Any other (SpecForge's `torch.save` record): `place` brings the mapped states' final state to the layout's
  convention (a post-norm one applies the target's final norm, `final_norm`, from the recorded head) and writes the
  layout's file (`TrainerLayout.serialise`; a full rewrite: docs/hidden_states.md §12 measures it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle_pipeline.drafter_types import POST_NORM
from eagle_pipeline.hidden_states.engines.vllm.vllm_files import (
    ConnectorFile,
    EngineShardError,
    FileFacts,
    validate_states_file,
)
from eagle_pipeline.hidden_states.engines.vllm.vllm_handoff import place_file
from eagle_pipeline.hidden_states.layouts.trainer_layouts import (
    LayoutTarget,
    SampleFilesWriter,
    remove_stale_tmp,
    trainer_layout,
)
from eagle_pipeline.hidden_states.store import fp8
from eagle_pipeline.hidden_states.store.format import sample_file_digest, sample_file_entry
from eagle_pipeline.hidden_states.store.shard_writer import ShardFacts, ShardWriter
from eagle_pipeline.shared.storage import write_bytes_atomic


class VllmLayoutRows:
    """Validates and places each connector file of one vLLM shard run in `target`'s layout.

    `validate` is `vllm_files.validate_states_file` as the request workers call it for this layout
    (`ShardRequests(validate=...)`); `place` is called by the shard's writer in row order; `files` are the shard
    index's `sample_files`; `close` drops what a failed run validated but never placed (its files stay for the
    journal to delete)."""

    def __init__(
        self,
        target: LayoutTarget,
        out_dir: Path,
        masks: dict[str, np.ndarray],
        n_aux: int,
        *,
        final_norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        layout = trainer_layout(target.name)
        if layout.final_state == POST_NORM and final_norm is None:
            raise ValueError(
                f"the {layout.name} layout holds the post-norm final state: the target's final norm is needed"
            )
        self.target, self.out_dir, self.masks, self.n_aux, self.final_norm = target, out_dir, masks, n_aux, final_norm
        remove_stale_tmp(target, list(masks))  # a copy a killed run of this shard left half written
        self._quantized: dict[Path, bytes] = {}  # validated rows' FP8 hs_{i}, until placed
        self.files: list[dict[str, Any]] = []
        self._rewrite: SampleFilesWriter | None = None  # a layout whose file is not the connector's

    @property
    def _fp8(self) -> bool:
        return self.target.quantize == fp8.QUANTIZE_FP8

    def validate(
        self, path: Path, ids: Sequence[int], layer_ids: Sequence[int], *, hidden_size: int | None = None
    ) -> ConnectorFile:
        # the file becomes hs_{i}: its digest is the record
        as_is = self.target.layout.takes_connector_file and not self._fp8
        file = validate_states_file(path, ids, layer_ids, hidden_size=hidden_size, digest=as_is)
        if self._fp8:  # here, in the request worker, so rows quantize side by side while the writer places others
            # the scales from the validator's own reduction: the mapped states are read once more, to quantize
            scales = fp8.scales_from_amax(file.amax.unsqueeze(-1))
            self._quantized[file.path] = fp8.sample_file(file.states, file.tensors["token_ids"], scales=scales)
        return file

    def place(self, sample_id: str, file: ConnectorFile, input_ids: torch.Tensor) -> None:
        """Put row `sample_id`'s validated connector file into the trainer's layout, and record it."""
        rel = self.target.file_of.get(sample_id)
        if rel is None:
            raise ValueError(
                f"sample {sample_id!r} has no file in the {self.target.name} layout: the merged table changed"
            )
        if not self.target.layout.takes_connector_file:
            self._rewrite_file(sample_id, file, input_ids)
            return
        dst = self.target.root / rel
        if self._fp8:
            data = self._quantized.pop(file.path)
            write_bytes_atomic(data, dst)
            size, digest = len(data), sample_file_digest(data)
        else:
            place_file(file.path, dst, file.buf)
            assert file.digest is not None
            size, digest = file.size, file.digest
        self.files.append(sample_file_entry(sample_id, os.path.relpath(dst, self.out_dir), size, digest))

    def _rewrite_file(self, sample_id: str, file: ConnectorFile, input_ids: torch.Tensor) -> None:
        if self._rewrite is None:  # the ids go to the shard file (`VllmShardFile`)
            self._rewrite = SampleFilesWriter(self.target, self.out_dir, self.masks, self.n_aux)
            self.files = self._rewrite.files
        hs = file.states
        t, h = int(hs.shape[0]), int(hs.shape[2])
        final = hs[:, self.n_aux]  # the servers' state, pre-norm
        if self.target.layout.final_state == POST_NORM:
            assert self.final_norm is not None  # checked when made
            final = self.final_norm(final)
        tensors = {
            "aux_hidden_states": hs[:, : self.n_aux].reshape(t, self.n_aux * h),
            "final_hidden_state": final,
            "input_ids": input_ids,
        }
        self._rewrite.write_sample(sample_id, tensors)

    def close(self) -> None:
        self._quantized.clear()


class VllmShardFile:
    """`ShardRequests.write_row` of a vLLM shard run: hands each validated connector file's states to the shard's
    writer, or to `placed` (a trainer's layout; the shard file then keeps ids and masks), in row order. The first
    file fixes H and the dtype of the whole shard: `facts(file_facts)` are then the shard's facts."""

    def __init__(
        self, shard: ShardWriter, facts: Callable[[FileFacts], ShardFacts], placed: VllmLayoutRows | None
    ) -> None:
        self.shard, self.facts_of, self.placed = shard, facts, placed
        self.first: FileFacts | None = None

    def __call__(self, i: int, file: ConnectorFile) -> None:
        facts, path, shard = file.facts, file.path, self.shard
        if self.first is None:
            self.first = facts
            shard.begin(self.facts_of(facts))
        first = self.first
        assert shard.facts is not None
        rows, n_aux = shard.facts.rows, len(shard.facts.aux)
        if (facts.hidden_size, facts.dtype) != (first.hidden_size, first.dtype):
            raise EngineShardError(
                f"shard {shard.facts.index:05d}, merged row {rows.global_row(i)} ({rows.sample_ids[i]}): {path} "
                f"holds {facts.dtype} H={facts.hidden_size}, the shard's first file {first.dtype} "
                f"H={first.hidden_size}: the endpoints serve different models"
            )
        if self.placed is not None:
            shard.write_sample(i)
            self.placed.place(rows.sample_ids[i], file, torch.from_numpy(rows.input_ids[i]).to(torch.int64))
            return
        hs = file.states
        shard.write_sample(i, hs[:, :n_aux].reshape(facts.tokens, n_aux * facts.hidden_size), hs[:, n_aux])
