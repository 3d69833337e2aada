import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pyarrow.parquet as pq
import pytest

from eagle_pipeline.config import DEFAULT_CONFIG, load_config
from eagle_pipeline.prompts import PromptFileError, load_prompt_file, make_sample_id, prompts_table
from eagle_pipeline.shared.storage import clean_stale_tmp, numbered_files, write_parquet_atomic


def test_bundled_prompt_sets_are_valid_and_large_enough():
    cfg = load_config(DEFAULT_CONFIG)
    for ds in cfg.datasets.values():
        prompts = load_prompt_file(ds.prompts)
        assert len(prompts) >= 24, ds.name
        with_tools = [p for p in prompts if p.tools]
        if ds.name == "B6":
            assert len(with_tools) >= 20


def test_sample_id_is_stable_and_depends_on_content_and_sampling():
    msgs = [{"role": "user", "content": "hi"}]
    a = make_sample_id("B1", msgs, None, {"temperature": 0.6, "seed": 0})
    assert a == make_sample_id("B1", [{"content": "hi", "role": "user"}], None, {"seed": 0, "temperature": 0.6})
    assert a != make_sample_id("B2", msgs, None, {"temperature": 0.6, "seed": 0})
    assert a != make_sample_id("B1", msgs, None, {"temperature": 0.7, "seed": 0})
    assert a != make_sample_id("B1", [{"role": "user", "content": "hi!"}], None, {"temperature": 0.6, "seed": 0})


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "invalid JSON"),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"role": "wizard", "content": "x"}]}', "needs a role"),
        ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}', "last message"),
        ('{"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]}', "OpenAI-style"),
    ],
)
def test_malformed_prompt_file_names_file_and_line(tmp_path, line, message):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "ok", "messages": [{"role": "user", "content": "fine"}]}\n' + line + "\n")
    with pytest.raises(PromptFileError) as exc:
        load_prompt_file(p)
    assert f"{p}:2" in str(exc.value) and message in str(exc.value)


def test_prompts_table_columns(tmp_path):
    p = tmp_path / "p.jsonl"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    p.write_text(
        json.dumps({"id": "a", "messages": [{"role": "user", "content": "x"}]})
        + "\n"
        + json.dumps({"id": "b", "messages": [{"role": "user", "content": "y"}], "tools": tools})
        + "\n"
    )
    t = prompts_table("B6", load_prompt_file(p), {"seed": 1})
    assert t.column("source_id").to_pylist() == ["a", "b"]
    assert t.column("tools_json").to_pylist()[0] is None
    assert json.loads(t.column("tools_json").to_pylist()[1]) == tools
    assert len(set(t.column("sample_id").to_pylist())) == 2


def test_atomic_parquet_write_never_leaves_a_partial_file(tmp_path):
    # A writer killed mid-write leaves only a hidden tmp file, never a readable partial part file.
    script = textwrap.dedent(
        f"""
        import os, pyarrow as pa, pyarrow.parquet as pq
        from eagle_pipeline.shared import storage
        orig = pq.write_table
        def slow(table, where, **kw):
            orig(table, where, **kw)
            print("written-tmp", flush=True)
            import time; time.sleep(30)
        storage.pq.write_table = slow
        storage.write_parquet_atomic(pa.table({{"x": list(range(1000))}}), {str(tmp_path / "part-00000.parquet")!r})
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "written-tmp"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "part-00000.parquet").exists()
    assert clean_stale_tmp(tmp_path) == 1
    write_parquet_atomic(__import__("pyarrow").table({"x": [1, 2]}), tmp_path / "part-00000.parquet")
    assert pq.read_table(tmp_path / "part-00000.parquet").num_rows == 2
    assert list(tmp_path.iterdir()) == [tmp_path / "part-00000.parquet"]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_atomic_writes_and_committed_shards_respect_the_umask(tmp_path, umask, mode):
    import pyarrow as pa

    from eagle_pipeline.generation.store.shards import write_shard
    from eagle_pipeline.shared.storage import write_bytes_atomic, write_json_atomic

    old = os.umask(umask)
    try:
        table = pa.table({"x": [1, 2]})
        written = [
            write_parquet_atomic(table, tmp_path / "a.parquet"),
            write_json_atomic({"a": 1}, tmp_path / "b.json"),
            write_bytes_atomic(b"abc", tmp_path / "c.bin"),
            write_shard(table, tmp_path / "responses", 0),
        ]
        # A rewrite keeps the mode a fresh file would get, not the temporary file's.
        written.append(write_parquet_atomic(table, tmp_path / "a.parquet"))
    finally:
        os.umask(old)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in written} == {p.name: oct(mode) for p in written}


def test_numbered_files_come_in_number_order_without_other_names_or_folders(tmp_path):
    """The one lister of committed shards and answer-log segments: by number, not by name, and only the files the
    pattern names (a temporary, a subdirectory and an unrelated file are left out)."""
    pattern = re.compile(r"^part-(\d{5,})\.parquet$")
    for name in ("part-00010.parquet", "part-00002.parquet", "part-100000.parquet", ".part-00003.parquet.tmp", "x.txt"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "part-00001.parquet").mkdir()
    assert [p.name for p in numbered_files(tmp_path, pattern)] == [
        "part-00002.parquet",
        "part-00010.parquet",
        "part-100000.parquet",
    ]
    assert numbered_files(tmp_path / "missing", pattern) == []
