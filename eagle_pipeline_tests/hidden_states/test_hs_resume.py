"""Shard states (done / missing / partial), skip-if-done, redo-if-partial, clean aborts."""

from __future__ import annotations

import pytest

from eagle_pipeline.hidden_states.run import extract_shard
from eagle_pipeline.hidden_states.store.format import shard_paths, shard_status, shard_tmp_leftovers

from .conftest import make_rows


@pytest.fixture
def merged(merged_factory):
    return merged_factory(make_rows(12, seed=11), [5, 7])


def _extract(model, merged, out, shard, **kw):
    return extract_shard(model, merged, shard_index=shard, shard_size=5, out_dir=out, max_tokens_per_batch=128, **kw)


def test_done_shard_is_skipped_untouched(tiny_ds, merged, tmp_path):
    out = tmp_path / "hs"
    assert shard_status(out, 0) == "missing"
    first = _extract(tiny_ds, merged, out, 0)
    assert shard_status(out, 0) == "done" and not first.skipped
    st, idx = shard_paths(out, 0)
    stamps = (st.stat().st_mtime_ns, idx.stat().st_mtime_ns)
    again = _extract(tiny_ds, merged, out, 0)
    assert again.skipped and again.sha256 == first.sha256 and again.rows == first.rows
    assert (st.stat().st_mtime_ns, idx.stat().st_mtime_ns) == stamps
    fresh = _extract(tiny_ds, merged, tmp_path / "fresh", 0)
    assert not fresh.skipped and fresh.sha256 == first.sha256  # deterministic on CPU/fp32


def test_partial_shard_from_killed_writer_is_redone(tiny_ds, merged, tmp_path):
    out = tmp_path / "hs"
    out.mkdir()
    st, _ = shard_paths(out, 2)
    st.write_bytes(b"half a file")  # safetensors without an index
    (out / ".shard-00002.safetensors.abc123.tmp").write_bytes(b"junk")  # atomic_path leftover
    assert shard_status(out, 2) == "partial"
    s = _extract(tiny_ds, merged, out, 2)
    assert not s.skipped and s.rows == 2
    assert shard_status(out, 2) == "done"
    assert shard_tmp_leftovers(out, 2) == []


def test_tmp_leftover_alone_or_index_alone_is_partial(tiny_ds, merged, tmp_path):
    out = tmp_path / "hs"
    _extract(tiny_ds, merged, out, 1)
    (out / ".shard-00001.index.parquet.zz.tmp").write_bytes(b"")
    assert shard_status(out, 1) == "partial"
    assert shard_status(out, 0) == "missing"  # other shards' leftovers don't leak
    (out / ".shard-00001.index.parquet.zz.tmp").unlink()
    st, _ = shard_paths(out, 1)
    st.unlink()
    assert shard_status(out, 1) == "partial"


def test_hash_mismatch_is_partial_and_redone(tiny_ds, merged, tmp_path):
    out = tmp_path / "hs"
    first = _extract(tiny_ds, merged, out, 0)
    st, _ = shard_paths(out, 0)
    data = bytearray(st.read_bytes())
    data[-100] ^= 0xFF  # same size, different content
    st.write_bytes(bytes(data))
    assert shard_status(out, 0, check_hash=False) == "done"  # the cheap check only looks at size
    assert shard_status(out, 0) == "partial"
    redo = _extract(tiny_ds, merged, out, 0)
    assert not redo.skipped and redo.sha256 == first.sha256
    assert shard_status(out, 0) == "done"


def test_abort_mid_shard_leaves_nothing(tiny_ds, merged, tmp_path):
    out = tmp_path / "hs"

    def stop(done, total, tokens_done, tokens_total):
        if done >= 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _extract(tiny_ds, merged, out, 0, progress=stop)
    assert shard_status(out, 0) == "missing"
    assert list(out.iterdir()) == []
