"""The one writer of a shard (`format.py`: its safetensors file and its index) for every engine and every layout.

An engine describes the shard once (`ShardFacts`), hands each row's states to `ShardWriter` in the order it declared,
and ends with what only the run knew (`ShardRun`: timings, NaN/Inf counts, a trainer layout's files, the head's hash).
Every fact about the shard is taken from those two objects in one place, `ShardFacts.record`, and stated once in it:
the fingerprint is the record of the layers, the final state, the layout, the quantization and the engine
(`fingerprint.recorded_fingerprint` reads them). The safetensors header holds the record, so that the file describes
itself; the index holds it too (`ShardFacts.index_meta`, with what only the run knew), so that listings and the
reuse decision never open a states file; the summary is derived from the index (`ShardSummary.from_index`). The
states file is written to a temporary file renamed into place when complete, the index (the 'done' marker) after it:
a killed run leaves only temporaries, and a rerun writes the same bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch

from eagle_pipeline.drafter_types import POST_NORM
from eagle_pipeline.hidden_states.models.layers import aux_layer_to_hf_index, final_state_hf_index
from eagle_pipeline.hidden_states.settings import SHARDS
from eagle_pipeline.hidden_states.store import fp8
from eagle_pipeline.hidden_states.store.fingerprint import FINGERPRINT_META_KEY, ExtractionFingerprint
from eagle_pipeline.hidden_states.store.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    SCALES_NAME,
    TENSOR_NAMES,
    StreamingSafetensorsWriter,
    dtype_name,
    shard_layout,
    shard_paths,
    tensor_key,
    write_index,
)
from eagle_pipeline.hidden_states.store.merged import MergedRows
from eagle_pipeline.hidden_states.store.shard_index import IDS_DTYPE, MASK_DTYPE
from eagle_pipeline.hidden_states.store.shards import FORMAT_META_KEY, HEAD_META_KEY, RUN_META_KEY, ShardSummary
from eagle_pipeline.shared.storage import atomic_path

VLLM_LAYER_IDS_CONVENTION = (
    "id k = residual entering decoder layer k (= output of layer k-1); aux layer k -> id k+1; the final state is id "
    "num_hidden_layers, the last layer's output before the final norm (apply the target's final norm for lm_head "
    "targets)"
)
# What the safetensors header records for a reader of the file alone; the index has its own record of the rest.
_HEADER_ONLY = frozenset(
    {
        "aux_layers_convention",
        "hf_hidden_states_indices",
        "hf_hidden_states_final_index",
        "ids_dtype",
        "mask_dtype",
        "torch_version",
        "transformers_version",
        "vllm_layer_ids_convention",
    }
)


@dataclass(frozen=True)
class VllmFacts:
    """What a shard cut by the vLLM engine records of its own."""

    layer_ids: tuple[int, ...]  # the connector's ids of the aux layers and the final state
    max_model_len: int  # the servers' length limit
    endpoints: tuple[str, ...]  # as configured
    dropped: list[dict[str, Any]]  # rows left out under too_long_rows: drop


@dataclass(frozen=True)
class ShardFacts:
    """Everything recorded about one shard that is fixed before its first tensor is written."""

    index: int
    rows: MergedRows
    fingerprint: ExtractionFingerprint  # its aux layers and final state are the shard's
    num_layers: int
    hidden_size: int
    dtype: torch.dtype  # the stored states'
    model: Mapping[str, Any]  # `model.describe_model_config`
    final_norm_eps: float | None  # None: the target's final norm is not recorded (a vLLM run without checkpoint)
    layout: str | None = None  # a trainer layout holding the states; None: the shard file holds them
    layout_root: Path | None = None  # that layout's folder
    vllm: VllmFacts | None = None

    def __post_init__(self) -> None:
        if (self.layout or SHARDS) != self.fingerprint.layout:
            raise ValueError(
                f"shard {self.index:05d}: its states go to the {self.layout or SHARDS} layout, but its fingerprint "
                f"records {self.fingerprint.layout}"
            )

    @property
    def aux(self) -> list[int]:
        return list(self.fingerprint.aux_layers)

    @property
    def states_in_shard(self) -> bool:
        return self.layout is None

    @property
    def quantized(self) -> bool:
        """The shard file holds FP8 states and their scales (`quantize: fp8` in the shards layout; a trainer
        layout's files quantize on their own, `TrainerLayout.serialise`)."""
        return self.states_in_shard and self.fingerprint.quantize == fp8.QUANTIZE_FP8

    def record(self) -> dict[str, Any]:
        """The shard's facts, each once, typed, in the order the safetensors header lists them (the file format,
        docs/hidden_states.md §5); the index records those not in `_HEADER_ONLY`."""
        rows, n = self.rows, self.num_layers
        facts: dict[str, Any] = {
            "format": FORMAT_NAME,
            FORMAT_META_KEY: FORMAT_VERSION,
            FINGERPRINT_META_KEY: self.fingerprint.to_dict(),
            "aux_layers_convention": "0-based decoder-layer outputs",
            # transformers' names of the same tensors, for a reader of the file alone; null where the tensor is not
            # in transformers' tuple (the last layer's raw output; a pre-norm state)
            "hf_hidden_states_indices": [aux_layer_to_hf_index(x, n) for x in self.aux],
            "hf_hidden_states_final_index": final_state_hf_index(
                n, post_norm=self.fingerprint.final_state == POST_NORM
            ),
            "hidden_size": self.hidden_size,
            "dtype": dtype_name(self.dtype),
            "ids_dtype": dtype_name(IDS_DTYPE),
            "mask_dtype": dtype_name(MASK_DTYPE),
            "shard_index": self.index,
            "row_start": rows.row_start,
            "row_stop": rows.row_stop,
            "rows": len(rows),
            "tokens": int(sum(rows.lengths)),
            "model": dict(self.model),
            "torch_version": torch.__version__,
            "transformers_version": transformers_version(),
        }
        if self.final_norm_eps is not None:
            facts["final_norm_eps"] = self.final_norm_eps
        if self.vllm is not None:
            facts.update(
                vllm_layer_ids=list(self.vllm.layer_ids),
                vllm_max_model_len=self.vllm.max_model_len,
                dropped_rows=self.vllm.dropped,
                vllm_layer_ids_convention=VLLM_LAYER_IDS_CONVENTION,
            )
        if self.quantized:  # `dtype` stays the states' dtype before quantizing, what the readers dequantize back to
            facts.update(
                stored_dtype=dtype_name(fp8.FP8_DTYPE),
                scale_granularity=fp8.PER_TOKEN_LAYER,
                scales_tensor=SCALES_NAME,
            )
        return facts

    def header(self) -> dict[str, str]:
        """The safetensors header's metadata: `record` as strings (JSON but for plain strings; mappings with
        sorted keys)."""
        return {
            k: v if isinstance(v, str) else json.dumps(v, sort_keys=isinstance(v, dict))
            for k, v in self.record().items()
        }

    def index_meta(self, writer: ShardWriter, run: ShardRun) -> dict[str, Any]:
        """The index's metadata: the file's name, hash and size, the facts the header records too, and what only
        the run knew."""
        meta: dict[str, Any] = {
            "safetensors_file": writer.paths[0].name,
            "sha256": writer.sha256,
            "size_bytes": writer.size_bytes,
            **{k: v for k, v in self.record().items() if k not in _HEADER_ONLY},
            RUN_META_KEY: {
                "seconds": run.seconds,
                "compute_seconds": run.compute_seconds,
                "write_wait_seconds": run.write_wait_seconds,
                "batches": run.batches,
                "padded_tokens": run.padded_tokens,
                "n_nonfinite_samples": int((run.nonfinite > 0).sum()),
            },
        }
        if run.head_sha256 is not None:
            meta[HEAD_META_KEY] = run.head_sha256
        if self.vllm is not None:
            meta.update(vllm_endpoints=list(self.vllm.endpoints), retries=run.retries)
        if self.layout is not None:
            assert self.layout_root is not None
            meta.update(layout_root=os.path.relpath(self.layout_root, writer.out_dir), sample_files=run.sample_files)
        return meta


@dataclass
class ShardRun:
    """What only the run of a shard knew once its last tensor was written."""

    seconds: float
    compute_seconds: float
    write_wait_seconds: float
    batches: int
    nonfinite: np.ndarray  # per row: NaN/Inf values among its real tokens
    padded_tokens: int = 0
    sample_files: list[dict[str, Any]] = field(default_factory=list)  # a trainer layout's files of the shard
    head_sha256: str | None = None  # the target head recorded beside the shards; None: none recorded
    retries: int = 0  # requests retried (the vLLM engine)


class ShardWriter:
    """Writes one shard: `begin` declares its facts and the order of its rows (the header is written then),
    `write_sample` each row in that order, leaving the context commits the states file (a temporary renamed into
    place; deleted on an exception) and `write_index` the index, last.

    In a trainer layout the shard file keeps the ids and masks; the states go to the layout's files, which the
    engine writes and `ShardRun.sample_files` lists."""

    def __init__(self, out_dir: str | Path, shard_index: int) -> None:
        self.out_dir = Path(out_dir)
        self.paths = shard_paths(self.out_dir, shard_index)
        self.facts: ShardFacts | None = None
        self._stack = ExitStack()
        self._file: Any = None
        self._writer: StreamingSafetensorsWriter | None = None
        self._order: list[int] = []
        self.sha256 = ""
        self.size_bytes = 0

    def __enter__(self) -> ShardWriter:
        tmp = self._stack.enter_context(atomic_path(self.paths[0]))
        self._file = self._stack.enter_context(open(tmp, "wb"))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            with self._stack:  # closes the file, then renames it into place, or deletes it if _finish raises
                self._finish()
        else:
            self._stack.__exit__(exc_type, exc, tb)

    def begin(self, facts: ShardFacts, order: Sequence[int] | None = None) -> None:
        """Declare the shard (`order`: the rows in the order they will be written; all of them in row order when
        None) and write its header."""
        if self._writer is not None:
            raise ValueError(f"shard {facts.index:05d} was begun already")
        rows = facts.rows
        self._order = list(order) if order is not None else list(range(len(rows)))
        layout = shard_layout(
            rows.sample_ids,
            rows.lengths,
            self._order,
            n_aux=len(facts.aux),
            hidden=facts.hidden_size,
            state_dtype=fp8.FP8_DTYPE if facts.quantized else facts.dtype,
            ids_dtype=IDS_DTYPE,
            mask_dtype=MASK_DTYPE,
            states=facts.states_in_shard,
            scales=facts.quantized,
        )
        self.facts, self._writer = facts, StreamingSafetensorsWriter(self._file, layout, facts.header())

    @property
    def begun(self) -> bool:
        return self._writer is not None

    def write_sample(self, i: int, aux: torch.Tensor | None = None, final: torch.Tensor | None = None) -> None:
        """Row `i`'s aux [T, n_aux*H] and final [T, H] states (when the shard file holds them; else None) and its
        ids from the merged rows."""
        facts, w = self.facts, self._writer
        assert facts is not None and w is not None, "begin() first"
        sid = facts.rows.sample_ids[i]
        if facts.states_in_shard:
            if aux is None or final is None:
                raise ValueError(f"sample {sid!r}: the shard file holds the states, none were given")
            if facts.quantized:
                self._write_fp8(sid, aux, final)
            else:
                w.write(tensor_key(sid, "aux_hidden_states"), aux)
                w.write(tensor_key(sid, "final_hidden_state"), final)
        elif aux is not None or final is not None:
            raise ValueError(f"sample {sid!r}: the {facts.layout} layout holds the states, not the shard file")
        w.write(tensor_key(sid, "input_ids"), torch.from_numpy(facts.rows.input_ids[i]))

    def _write_fp8(self, sid: str, aux: torch.Tensor, final: torch.Tensor) -> None:
        """e4m3 aux and final states with one fp32 scale per token per layer (`fp8.quantize`, the quantizer of
        every layout), the aux layers' scales first."""
        facts, w = self.facts, self._writer
        assert facts is not None and w is not None
        t, n_aux, h = int(final.shape[0]), len(facts.aux), facts.hidden_size
        try:
            q = fp8.quantize(torch.cat([aux.reshape(t, n_aux, h), final.reshape(t, 1, h)], dim=1))
        except ValueError as e:
            raise ValueError(f"shard {facts.index:05d}, sample {sid!r}: {e}") from None
        w.write(tensor_key(sid, "aux_hidden_states"), q.states[:, :n_aux].reshape(t, n_aux * h))
        w.write(tensor_key(sid, "final_hidden_state"), q.states[:, n_aux])
        w.write(tensor_key(sid, SCALES_NAME), q.scales.reshape(t, n_aux + 1))

    def _finish(self) -> None:
        """The loss masks (after every sample: the 1-byte tensors last keep the offsets aligned), then the hash."""
        facts, w = self.facts, self._writer
        if facts is None or w is None:
            raise ValueError(f"{self.paths[0]}: no row was written; the shard is not committed")
        for i in self._order:
            w.write(tensor_key(facts.rows.sample_ids[i], "loss_mask"), torch.from_numpy(facts.rows.loss_mask[i]))
        self.sha256, self.size_bytes = w.finish(), w.total_bytes

    def write_index(self, run: ShardRun) -> ShardSummary:
        """The index (the shard's 'done' marker), once the states file is in place; the shard's summary."""
        facts = self.facts
        if facts is None or not self.sha256:
            raise ValueError(f"{self.paths[0]}: the states file is not complete; no index is written")
        rows, meta = facts.rows, facts.index_meta(self, run)
        write_index(
            self.paths[1],
            {
                "sample_id": rows.sample_ids,
                "dataset": rows.datasets,
                "row_index": [rows.global_row(i) for i in range(len(rows))],
                "n_tokens": rows.lengths,
                "n_supervised": [int((m != 0).sum()) for m in rows.loss_mask],
                "n_nonfinite": run.nonfinite.tolist(),
                "keys": [[tensor_key(sid, k) for k in TENSOR_NAMES] for sid in rows.sample_ids],
            },
            meta,
        )
        return ShardSummary.from_index(meta, self.paths[1])


def transformers_version() -> str:
    try:
        import transformers

        return transformers.__version__
    except Exception:
        return "unknown"
