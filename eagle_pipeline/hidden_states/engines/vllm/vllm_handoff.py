"""A vLLM connector file handed to speculators as it is: validated and hashed in one read, then renamed into place.

The connector writes `hidden_states` [T, n_ids, H] (the aux layers, then vLLM id L: the final state before the final
norm) and `token_ids` [T] int64, which is byte for byte speculators' `hs_{i}.safetensors` (trainer_layouts.py). So with
`engine: vllm` and `layout: speculators` the client reads each file once (`vllm_files.validate_states_file`: one mapping, its XXH3-128
`format.sample_file_digest` and every check over that one buffer), then renames the file to its `hs_{i}` name when the connector's storage
and the export folder are on one filesystem (same `st_dev`), else writes the buffer it already holds (one streaming
copy) and deletes the connector's file. Crash safety: a kill -9 before the rename leaves the connector file, which
the shard's request journal lists and the rerun deletes and asks for again; one after it leaves `hs_{i}` (the
rename is atomic: the whole file or the old one), which no shard index vouches for until the shard is written, so the
rerun rewrites it (`os.replace`). The cost per GB beside the other paths: benchmarks/bench_layout_copy.py,
docs/hidden_states.md §12.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from eagle_pipeline.hidden_states.engines.vllm.vllm_files import FileFacts, validate_states_file
from eagle_pipeline.shared.storage import atomic_path, fsync_dir

RENAMED, COPIED = "renamed", "copied"


@dataclass(frozen=True)
class HandedFile:
    """A connector file handed over: what it holds, its size and digest (from the one read), how it was placed."""

    facts: FileFacts
    size: int
    digest: str  # format.sample_file_digest
    how: str = ""  # RENAMED | COPIED once placed


def same_filesystem(src: str | os.PathLike, dst_dir: str | os.PathLike) -> bool:
    return os.stat(src).st_dev == os.stat(dst_dir).st_dev


def place_file(src: str | os.PathLike, dst: str | os.PathLike, data: mmap.mmap) -> str:
    """Put the connector file `src` (whose bytes are `data`) at `dst`: a rename on one filesystem, else one write of
    `data` (atomic, fsynced) and the removal of `src`. Its `.lock` goes too. Returns RENAMED or COPIED."""
    src, dst = Path(src), Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if same_filesystem(src, dst.parent):
        os.replace(src, dst)
        with open(dst, "rb") as fh:  # the connector need not have synced it; the shard index will vouch for it
            os.fsync(fh.fileno())
        fsync_dir(dst.parent)
        how = RENAMED
    else:
        with atomic_path(dst) as tmp, open(tmp, "wb") as fh:
            fh.write(data)
        src.unlink()
        how = COPIED
    Path(f"{src}.lock").unlink(missing_ok=True)
    return how


def hand_off(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    ids: Sequence[int],
    layer_ids: Sequence[int],
    *,
    hidden_size: int | None = None,
) -> HandedFile:
    """Validate the connector file `src` and place it at `dst` (speculators' `hs_{i}.safetensors`); nothing is
    placed when the file is invalid (a RequestFailure says why)."""
    file = validate_states_file(src, ids, layer_ids, hidden_size=hidden_size, digest=True)
    try:
        how = place_file(src, dst, file.buf)
        assert file.digest is not None
        return HandedFile(file.facts, file.size, file.digest, how)
    finally:
        file.close()
