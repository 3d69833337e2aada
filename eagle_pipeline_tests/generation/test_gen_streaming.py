"""Streamed generation (issue 15): SSE over real loopback HTTP, row-for-row equal to non-streamed answers, every
stream failure retried or recorded and never kept, keep-alives keeping long generations alive, kill -9 mid-stream."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from eagle_pipeline.generation.backends.stream import ChatStreamAssembler, _envelope
from eagle_pipeline.generation.spec import BackendSpec
from eagle_pipeline.generation.store.shards import read_errors, read_responses
from eagle_pipeline.shared.failures import RequestFailure
from eagle_pipeline.simulation import SimulatedOpenRouterServer
from eagle_pipeline.simulation.streaming import STREAM_FAULTS
from eagle_pipeline.tokens import load_tokenizer, reconstruct_table
from eagle_pipeline_tests.doubles import SimulatedVLLMServer

from .generation_helpers import (
    GRACE_S,
    READ_SLACK_S,
    SAMPLING,
    ServerProcess,
    committed_ids,
    drained,
    durable_ids,
    kill_once_read,
    make_prompts,
    out_dirs,
    prompts_on_disk,
    proven_reads,
    run,
    run_child,
    sample_keys,
    sim_backend,
)

# Columns that differ between two answers to the same request for reasons other than the answer itself.
VOLATILE = {"latency_s", "started_at", "finished_at", "raw_response_json", "generation_id"}
STREAM_COLS = {"stream_chunks", "stream_keepalives"}


def _rows(root: Path) -> dict[str, dict]:
    t = read_responses(out_dirs(root)[0])
    return {r["sample_id"]: r for r in t.to_pylist()}


def _answer_cols(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in VOLATILE | STREAM_COLS}


# Streamed answers are read in the run's event loop (0) or in worker processes (stream_workers.py): the same rows.
PROCESSES = pytest.mark.parametrize("procs", [0, 2], ids=["one-loop", "2-workers"])


@PROCESSES
def test_streamed_rows_equal_non_streamed_rows_and_token_samples(tmp_path, kimi_dir, procs):
    kimi = load_tokenizer(kimi_dir)
    prompts = make_prompts(24, tools_every=2)
    # Small deltas: many chunks per answer, tool-call arguments cut every 2 characters.
    with SimulatedOpenRouterServer(stream={"chunk_chars": 9}) as srv:
        s1 = run(prompts, sim_backend(srv.url, stream=True, stream_processes=procs), tmp_path / "streamed")
        s2 = run(prompts, sim_backend(srv.url, stream=False), tmp_path / "plain")
        bodies = [srv.body_for(k) for k in sample_keys(prompts).values()]
    assert s1.completed == s2.completed == 24 and s1.failed == s2.failed == 0
    assert all(b is not None and b["stream"] is False for b in bodies)  # the last request of each key was plain
    streamed, plain = _rows(tmp_path / "streamed"), _rows(tmp_path / "plain")
    assert streamed.keys() == plain.keys()
    n_tools = 0
    for sid, row in streamed.items():
        ref = plain[sid]
        assert _answer_cols(row) == _answer_cols(ref), sid
        assert row["stream_chunks"] > 4 and row["stream_keepalives"] == 0
        assert ref["stream_chunks"] is None and ref["stream_keepalives"] is None
        # The stored body is the assembled equivalent of the non-streaming body.
        got, want = json.loads(row["raw_response_json"]), json.loads(ref["raw_response_json"])
        assert got["usage"] == want["usage"] and got["model"] == want["model"]
        gm, wm = got["choices"][0]["message"], want["choices"][0]["message"]
        for k in ("content", "reasoning", "tool_calls"):
            assert gm.get(k) == wm.get(k), (sid, k)
        if wm.get("reasoning_details"):
            assert [d["text"] for d in gm["reasoning_details"]] == [d["text"] for d in wm["reasoning_details"]]
        n_tools += bool(row["tool_calls_json"])
    assert n_tools >= 3  # tool-call fragments were reassembled, not only text

    # Reconstruction sees no difference: identical token samples from the real Kimi tokenizer.
    def samples(root: Path) -> list[dict]:
        table = read_responses(out_dirs(root)[0]).sort_by("sample_id")
        return reconstruct_table(table, kimi, "kimi-k2.5", dataset_has_tools=True).to_pylist()

    got_samples = samples(tmp_path / "streamed")
    assert len(got_samples) == 24 and got_samples == samples(tmp_path / "plain")


def encode(text: str) -> list[int]:
    return [b + 10 for b in text.encode("utf-8")]


@PROCESSES
def test_vllm_streamed_ids_equal_non_streamed(tmp_path, procs):
    prompts = make_prompts(10, tools_every=3)
    kw = dict(encode=encode, think_start_id=3, think_end_id=4, eos_id=2)
    with SimulatedVLLMServer(stream={"chunk_chars": 11}, **kw) as srv:
        base = dict(name="vllm-local", kind="vllm", endpoint=srv.url, model="m", concurrency=4, max_retries=1)
        assert BackendSpec(**base).effective_stream is False  # off by default for vLLM
        s1 = run(prompts, BackendSpec(**base, stream=True, stream_processes=procs), tmp_path / "streamed")
        key = next(iter(sample_keys(prompts).values()))
        body = srv.body_for(key)
        s2 = run(prompts, BackendSpec(**base), tmp_path / "plain")
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert s1.completed == s2.completed == 10
    streamed, plain = _rows(tmp_path / "streamed"), _rows(tmp_path / "plain")
    for sid, row in streamed.items():
        assert _answer_cols(row) == _answer_cols(plain[sid]), sid
        assert row["output_token_ids"] and row["prompt_token_ids"] and row["usage_completion_tokens"]
        assert row["stream_chunks"] > 3


def test_vllm_streamed_all_reasoning_answer_stores_content_none_as_plain(tmp_path):
    """vLLM's first streamed delta is `{"role": "assistant", "content": ""}` whatever follows (the real server's,
    eagle_pipeline_tests/real_vllm): an answer cut inside its reasoning has content null in the plain body, and the
    streamed one must store the same null, not the announcement's ''."""
    prompts = make_prompts(6)
    kw = dict(encode=encode, think_start_id=3, think_end_id=4, eos_id=2)
    short = dataclasses.replace(SAMPLING, max_tokens=8)  # the reasoning alone is longer: finish "length"
    with SimulatedVLLMServer(stream={"chunk_chars": 5}, **kw) as srv:
        base = dict(name="vllm-local", kind="vllm", endpoint=srv.url, model="m", concurrency=2, max_retries=1)
        run(prompts, BackendSpec(**base, stream=True), tmp_path / "streamed", sampling=short)
        run(prompts, BackendSpec(**base), tmp_path / "plain", sampling=short)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
        first = httpx.post(f"{srv.url}/chat/completions", json=body).text.split("\n\n")[0]
    assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    streamed, plain = _rows(tmp_path / "streamed"), _rows(tmp_path / "plain")
    assert streamed.keys() == plain.keys() and len(plain) == 6
    for sid, row in streamed.items():
        assert row["finish_reason"] == "length" and row["reasoning"] and row["content"] is None, sid
        assert _answer_cols(row) == _answer_cols(plain[sid]), sid
        assert json.loads(row["raw_response_json"])["choices"][0]["message"]["content"] is None


FAULT_CLASS = {
    "stream_error": ("provider_error", "mid-stream error"),
    "stream_finish_error": ("provider_error", "finish_reason 'error'"),
    "stream_cut": ("connection", ""),
    "stream_no_finish": ("provider_error", "without a finish_reason"),
    "stream_idle": ("timeout", "no data from the server for 0.5 s"),
    "stream_trickle": ("timeout", "only keep-alives for over 0.6 s"),
}


@PROCESSES
@pytest.mark.parametrize("fault", STREAM_FAULTS)
def test_stream_failures_are_recorded_then_retried_never_kept(tmp_path, fault, procs):
    assert set(FAULT_CLASS) == set(STREAM_FAULTS)
    prompts = make_prompts(4, tools_every=2)
    keys = set(sample_keys(prompts).values())
    with SimulatedOpenRouterServer(stream={"chunk_chars": 16, "keepalive_s": 0.05}) as clean:
        run(prompts, sim_backend(clean.url, stream=True), tmp_path / "clean")
    spec = dict(stream=True, timeout_s=0.5, max_keepalive_only_s=0.6, stream_processes=procs)
    faults = {fault: 1.0, "timeout_sleep_s": 5.0}  # every request's first attempt fails
    with SimulatedOpenRouterServer(stream={"chunk_chars": 16, "keepalive_s": 0.05}, faults=faults) as srv:
        # No retries: every first attempt fails, is recorded, and no partial row is kept.
        s = run(prompts, sim_backend(srv.url, max_retries=0, **spec), tmp_path)
        assert (s.completed, s.failed) == (0, 4)
        assert read_responses(out_dirs(tmp_path)[0]).num_rows == 0
        errors = read_errors(out_dirs(tmp_path)[1]).to_pylist()
        cls, text = FAULT_CLASS[fault]
        assert len(errors) == 4 and {e["error_class"] for e in errors} == {cls}
        assert all(text in e["message"] and e["attempts"] == 1 for e in errors), errors
        # The next run requests them again (second attempts: the fault has cleared) and keeps whole answers only.
        s = run(prompts, sim_backend(srv.url, max_retries=0, **spec), tmp_path)
        assert (s.completed, s.failed) == (4, 0)
    with SimulatedOpenRouterServer(stream={"chunk_chars": 16, "keepalive_s": 0.05}, faults=faults) as srv:
        # With retries, one run recovers every prompt: one failed and one good attempt each.
        s = run(prompts, sim_backend(srv.url, max_retries=2, **spec), tmp_path / "retried")
        assert (s.completed, s.failed) == (4, 0) and srv.request_counts() == {k: 2 for k in keys}
    # The kept rows are the whole answers, exactly as a clean server streams them (the servers' ports differ).
    same = {"attempts": None, "endpoint": None}
    want = {k: _answer_cols(v) | same for k, v in _rows(tmp_path / "clean").items()}
    for root, attempts in ((tmp_path, 1), (tmp_path / "retried", 2)):
        rows = _rows(root)
        assert {k: _answer_cols(v) | same for k, v in rows.items()} == want
        assert all(r["attempts"] == attempts for r in rows.values())


def test_overall_cap_ends_a_never_ending_trickle(tmp_path):
    prompts = make_prompts(2)
    faults = {"stream_trickle": 1.0}
    with SimulatedOpenRouterServer(stream={"keepalive_s": 0.05}, faults=faults) as srv:
        spec = sim_backend(
            srv.url, stream=True, timeout_s=0.5, max_keepalive_only_s=None, max_request_s=1.0, max_retries=0
        )
        t0 = time.monotonic()
        s = run(prompts, spec, tmp_path)
        elapsed = time.monotonic() - t0
    assert (s.completed, s.failed) == (0, 2) and s.errors_by_class == {"timeout": 2}
    errors = read_errors(out_dirs(tmp_path)[1]).to_pylist()
    assert all("exceeded max_request_s = 1 s" in e["message"] for e in errors), errors
    assert elapsed < 10


@PROCESSES
def test_keepalives_keep_a_long_generation_alive(tmp_path, procs):
    """2 s of silent thinking with keep-alives every 0.1 s completes under a 0.5 s idle timeout, which would have cut
    the same wait on a silent (non-streaming) connection."""
    prompts = make_prompts(3)
    with SimulatedOpenRouterServer(stream={"thinking_s": 2.0, "keepalive_s": 0.1}) as srv:
        spec = sim_backend(srv.url, stream=True, timeout_s=0.5, max_retries=0, stream_processes=procs)
        s = run(prompts, spec, tmp_path / "streamed")
    assert (s.completed, s.failed) == (3, 0)
    rows = _rows(tmp_path / "streamed").values()
    assert all(r["stream_keepalives"] >= 15 and r["attempts"] == 1 and r["latency_s"] >= 2.0 for r in rows)
    with SimulatedOpenRouterServer(latency_s=2.0) as srv:
        s = run(prompts, sim_backend(srv.url, stream=False, timeout_s=0.5, max_retries=0), tmp_path / "plain")
    assert (s.completed, s.failed) == (0, 3) and s.errors_by_class == {"timeout": 3}


# ~0.5 s per streamed answer (about 25 chunks, 20 ms apart): a kill always finds 8 streams mid-way.
KILL_STREAM = {"chunk_chars": 24, "chunk_delay_s": 0.02}
OLD_S = GRACE_S + READ_SLACK_S


@dataclass
class _StreamKill:
    """A streamed run of 40 prompts killed -9 inside its commit window, seen from the server's records and the files."""

    prompts_path: Path
    options: dict
    key_of: dict[str, str]  # sample id -> request key
    durable: set[str]  # request keys of the answers durable after the kill
    old: set[str]  # request keys of the answers the client had read more than OLD_S before the kill
    lost_age_s: float  # how long before the kill the client had read the oldest answer that is not durable (0: none)
    first_run: set[str]  # request keys the killed run sent


def _kill_a_streamed_run(tmp_path: Path, srv: ServerProcess, answer_log_s: float | None) -> _StreamKill:
    """Run 40 streamed prompts at 8 in flight and kill -9 the run once the client had read 10 answers more than OLD_S
    before (the server's proofs), far inside its commit window: no shard is written, only the answer log can keep
    them."""
    n = 40
    prompts = make_prompts(n)
    prompts_path, key_of = prompts_on_disk(prompts, tmp_path)
    out, _ = out_dirs(tmp_path)
    options = {
        "backend": {"stream": True},
        "commit_every_rows": 1000,
        "commit_every_s": 60.0,
        "answer_log_s": answer_log_s,
    }
    proc = run_child(prompts_path, srv.url, tmp_path, options)
    t_kill = kill_once_read(proc, srv, reads=10, max_written=n - 8, deadline_s=60)
    drained(srv)
    assert committed_ids(out)[0] == []  # nothing reached a shard: what survives is the log's
    durable = {key_of[s] for s in durable_ids(out)}
    reads = proven_reads(srv, 0, {(k, a) for k, a, _ in srv.answered()})
    old = {k for k, t in reads if t <= t_kill - OLD_S}
    lost = [t_kill - t for k, t in reads if k not in durable]
    first_run = {key for key, _ in srv.arrivals()}
    return _StreamKill(prompts_path, options, key_of, durable, old, max(lost, default=0.0), first_run)


@pytest.mark.slow
def test_kill_9_mid_stream_loses_nothing_committed(tmp_path):
    """Kill -9 a streamed run (8 streams of ~0.5 s in flight) inside its commit window once at least 10 answers were
    read by the client more than GRACE_S + READ_SLACK_S before, by the server's own records (a process of its own):
    every answer read before that bound is durable (in the answer log) and never requested again; the rerun
    requests exactly the prompts not durable, each once; the only prompts requested twice are the streams in flight
    and answers read after the bound."""
    out, _ = out_dirs(tmp_path)
    with ServerProcess(stream=KILL_STREAM) as srv:
        k = _kill_a_streamed_run(tmp_path, srv, answer_log_s=0.05)
        assert 10 <= len(k.durable) < len(k.key_of)
        assert len(k.old) >= 10 and k.old <= k.durable, (
            f"{len(k.old)} answers read more than {OLD_S} s before the kill; one read {k.lost_age_s:.3f} s before it "
            "is not durable"
        )
        in_flight = k.first_run - k.durable
        assert in_flight  # the streams mid-way, requested again
        log_start = len(srv.arrivals())
        proc = run_child(k.prompts_path, srv.url, tmp_path, k.options)
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-3000:]
        second = [key for key, _ in srv.arrivals()[log_start:]]
    # The rerun requested exactly the prompts not durable at the kill, each once: nothing answered and logged was
    # re-bought, none of the answers read before the bound, and the only re-requests are those in flight.
    assert sorted(second) == sorted(set(k.key_of.values()) - k.durable)
    assert not (set(second) & k.old)
    assert set(second) & k.first_run == in_flight
    assert json.loads(stdout.strip().splitlines()[-1])["recovered_from_log"] == len(k.durable)
    assert sorted(committed_ids(out)[0]) == sorted(k.key_of)
    rows = read_responses(out).to_pylist()
    assert len(rows) == len(k.key_of) and all(r["stream_chunks"] > 10 for r in rows)


@pytest.mark.slow
def test_without_the_answer_log_the_same_streamed_kill_loses_old_answers(tmp_path):
    """The negative control of the test above: with the answer log off the same kill keeps none of the answers the
    client had read more than GRACE_S + READ_SLACK_S before it, so that test's bound can fail."""
    with ServerProcess(stream=KILL_STREAM) as srv:
        k = _kill_a_streamed_run(tmp_path, srv, answer_log_s=None)
    assert len(k.old) >= 10 and not (k.old & k.durable), (len(k.old), len(k.durable))
    assert k.lost_age_s > OLD_S


def _feed(lines: list[bytes], *, bytewise: bool = False, **kw) -> ChatStreamAssembler:
    """An assembler fed the lines (joined by LF unless they carry their own ending) in one block or byte by byte."""
    raw = b"".join(line if line.endswith(b"\n") else line + b"\n" for line in lines)
    a = ChatStreamAssembler(**kw)
    for piece in [raw[i : i + 1] for i in range(len(raw))] if bytewise else [raw]:
        a.feed(piece)
    return a


def _data(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode()


def test_assembler_reasoning_details_crlf_multiline_events_and_fragments():
    chunk = {"id": "g1", "model": "m", "object": "chat.completion.chunk"}
    lines = [
        b": OPENROUTER PROCESSING\r\n",
        b"\r\n",
        # reasoning only as reasoning_details (no delta.reasoning): its text is the reasoning
        _data(
            {
                **chunk,
                "choices": [
                    {
                        "index": 0,
                        "delta": {
                            "role": "assistant",
                            "reasoning_details": [{"type": "reasoning.text", "text": "Thi", "index": 0}],
                        },
                    }
                ],
            }
        )
        + b"\r\n",
        b"\r\n",
        # one event split over two data lines (joined with a newline, as SSE defines)
        b'data: {"choices": [{"index": 0, "delta": {"reasoning_details": [{"type": "reasoning.text", "text": "nk."}],',
        b'data:  "content": "Hi", "tool_calls": [{"index": 1, "id": "b", "function": {"name": "g", "arguments": "{\\"x"}}]}}]}',
        b"",
        _data(
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {
                            "tool_calls": [
                                {
                                    "index": 0,
                                    "id": "a",
                                    "type": "function",
                                    "function": {"name": "f", "arguments": "{}"},
                                }
                            ]
                        },
                    }
                ]
            }
        ),
        b"",
        _data(
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {"tool_calls": [{"index": 1, "function": {"arguments": '": 1}'}}]},
                        "finish_reason": "tool_calls",
                    }
                ]
            }
        ),
        b"",
        _data({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}),
        b"",
        b"data: [DONE]",
        b"",
        _data({"choices": [{"delta": {"content": "ignored after DONE"}}]}),
        b"",
    ]
    a = _feed(lines)
    body = a.body()
    bytewise = _feed(lines, bytewise=True)  # network reads cut anywhere, CRLF split included
    assert bytewise.body() == body and (bytewise.chunks, bytewise.keepalives) == (a.chunks, a.keepalives)
    msg = body["choices"][0]["message"]
    assert (a.chunks, a.keepalives) == (5, 1)
    assert msg["reasoning"] == "Think." and msg["content"] == "Hi"
    assert msg["reasoning_details"] == [{"type": "reasoning.text", "text": "Think.", "index": 0}]
    assert [(t["id"], t["function"]["name"], json.loads(t["function"]["arguments"])) for t in msg["tool_calls"]] == [
        ("a", "f", {}),
        ("b", "g", {"x": 1}),
    ]
    assert body["choices"][0]["finish_reason"] == "tool_calls" and body["usage"]["completion_tokens"] == 5
    assert body["id"] == "g1" and body["model"] == "m" and body["object"] == "chat.completion"


def test_assembler_failures():
    start = _data({"choices": [{"index": 0, "delta": {"content": "part"}}]})
    with pytest.raises(RequestFailure) as e:
        _feed([start, b"", b'data: {"error": {"code": 502, "message": "upstream gone"}, "choices": []}', b""]).body()
    assert e.value.error_class == "provider_error" and "upstream gone" in e.value.message and e.value.retryable
    with pytest.raises(RequestFailure) as e:
        _feed([start, b"", b"data: {not json", b"", b"data: [DONE]", b""]).body()
    assert e.value.error_class == "malformed_body"
    with pytest.raises(RequestFailure) as e:
        _feed([start, b""]).body()
    assert e.value.error_class == "connection" and "[DONE]" in e.value.message
    with pytest.raises(RequestFailure) as e:
        _feed([start, b"", b"data: [DONE]", b""]).body()
    assert e.value.error_class == "provider_error" and "finish_reason" in e.value.message
    with pytest.raises(RequestFailure) as e:  # an error chunk, then the connection cut: the error is reported
        _feed([start, b"", b'data: {"choices": [{"index": 0, "finish_reason": "error"}]}', b"", b'data: {"cho']).body()
    assert e.value.error_class == "provider_error"
    with pytest.raises(RequestFailure) as e:  # cut mid-chunk
        _feed([start, b"", b'data: {"choices": [{"ind']).body()
    assert e.value.error_class == "connection"
    a = _feed([b": keep-alive", b""], keepalive_only_max_s=0.05)
    time.sleep(0.1)
    with pytest.raises(RequestFailure) as e:
        a.feed(b": keep-alive\n\n")
    assert e.value.error_class == "timeout"


def _compact(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode()


def test_assembler_envelope_cut_changes_nothing_apply_reads():
    """The members every chunk repeats before `choices` are decoded once (stream._joined); whatever a chunk says
    after them, or in place of them, still counts: first-seen top-level members, the last usage, a later error."""
    env = {"id": "g1", "provider": "P", "model": "m", "object": "chat.completion.chunk", "created": 1}

    def chunk(delta=None, finish=None, **top):
        return _compact({**env, **top, "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]})

    cuts = []

    def body(*events):
        lines = [e for ev in events for e in (ev, b"")] + [b"data: [DONE]", b""]
        framed = _feed(lines)
        framed._frame()
        cuts.append(_envelope(framed._events) > 0)
        return _feed(lines).body()

    first, done = chunk({"role": "assistant", "content": ""}), chunk(finish="stop")
    b = body(first, chunk({"content": "a"}), chunk({"content": "b"}, usage={"completion_tokens": 2}), done)
    assert b["choices"][0]["message"]["content"] == "ab" and b["usage"] == {"completion_tokens": 2}
    assert (b["id"], b["provider"], b["created"]) == ("g1", "P", 1)
    # a chunk whose envelope differs (another model): not cut, and the first-seen members stay
    other = _compact({**env, "model": "m2", "choices": [{"index": 0, "delta": {"content": "c"}}]})
    b = body(first, chunk({"content": "a"}), other, done)
    assert b["model"] == "m" and b["choices"][0]["message"]["content"] == "ac"
    # a member after the envelope (an error) is kept: the stream fails as it would uncut
    err = _compact({**env, "error": {"code": 502, "message": "upstream gone"}, "choices": []})
    with pytest.raises(RequestFailure) as e:
        body(first, chunk({"content": "a"}), err, done)
    assert "upstream gone" in e.value.message and "after 3 chunks" in e.value.message
    # usage before `choices` in every chunk: the envelope is not cut, the last usage wins
    u = [
        _compact({"id": "g1", "usage": {"n": i}, "choices": [{"index": 0, "delta": {"content": "x"}}]}) for i in (1, 2)
    ]
    b = body(first, *u, done)
    assert b["usage"] == {"n": 2} and b["choices"][0]["message"]["content"] == "xx"
    # a chunk that is invalid after the envelope stays invalid
    with pytest.raises(RequestFailure) as e:
        body(first, chunk({"content": "a"}), _compact(env)[:-1] + b',"choices":[}', done)
    assert e.value.error_class == "malformed_body"
    assert cuts == [True, False, True, False, True]  # the cases above did take the cut where they could


def test_assembler_blank_line_runs_frame_alike():
    """Events framed on lines (every event one line, one blank line after each) and on blank lines (any other
    layout: extra blank lines, a line with only a newline, a leading blank line) give the same chunks and body."""
    env = {"id": "g1", "model": "m", "object": "chat.completion.chunk"}
    events = [
        b": OPENROUTER PROCESSING",
        _compact({**env, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        *(_compact({**env, "choices": [{"index": 0, "delta": {"content": f"w{i} "}}]}) for i in range(6)),
        _compact({**env, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
        b"data: [DONE]",
    ]
    outcomes = []
    for sep, lead in ((b"\n\n", b""), (b"\n\n\n\n", b""), (b"\n\n", b"\n\n"), (b"\n\n\n", b""), (b"\n\n", b"\n")):
        raw = lead + sep.join(events) + sep
        whole = _outcome(raw, [raw])
        pieces = [raw[i : i + 7] for i in range(0, len(raw), 7)]
        assert _outcome(raw, pieces) == whole == _outcome(raw, pieces, batch_bytes=64)  # framed per batch too
        outcomes.append(whole)
    body, chunks, keepalives = outcomes[0]
    assert isinstance(body, dict) and body["choices"][0]["message"]["content"] == "w0 w1 w2 w3 w4 w5 "
    assert (chunks, keepalives) == (8, 1)
    assert all(o == outcomes[0] for o in outcomes)


def test_stream_setting_per_kind():
    base = dict(name="b", endpoint="http://127.0.0.1:1", model="m")
    assert BackendSpec(kind="openrouter", **base).effective_stream is True
    assert BackendSpec(kind="simulated", **base).effective_stream is True
    assert BackendSpec(kind="vllm", **base).effective_stream is False
    assert BackendSpec(kind="sglang", **base).effective_stream is False
    with pytest.raises(ValueError, match="stream"):
        BackendSpec(kind="sglang", stream=True, **base)


def _long_stream(n: int, *, nl: bytes = b"\n", error_at: int | None = None, bad_at: int | None = None) -> bytes:
    """An OpenRouter-style stream of `n` content/reasoning chunks (multi-byte UTF-8 text, tool-call fragments,
    keep-alives between events, vLLM-style ids in the first chunk, one event on two lines), usage, [DONE] and an
    event after it."""
    env = {"id": "g1", "provider": "P", "model": "m", "object": "chat.completion.chunk", "created": 1}
    events = [
        {**env, "prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
    ]
    for i in range(n):
        if i < n // 2:
            text = f"ré{i}思🙂"
            delta = {"reasoning": text, "reasoning_details": [{"type": "reasoning.text", "text": text, "index": 0}]}
        elif i % 7 == 0:
            delta = {"tool_calls": [{"index": i % 2, "id": f"c{i % 2}", "function": {"arguments": f'"é{i}'}}]}
        else:
            delta = {"content": f"ç{i}日本"}
        events.append({**env, "choices": [{"index": 0, "delta": delta, "token_ids": [i]}]})
    # members only the first chunk's count: later prompt ids and another model are ignored
    events[n // 3]["prompt_token_ids"] = [9]
    for ev in events[2 * n // 3 :]:
        ev["model"] = "m2"
    if error_at is not None:
        events[error_at] = {**env, "error": {"code": 502, "message": "upstream gone"}, "choices": []}
    events.append({**env, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    events.append({**env, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}})
    out = [b": OPENROUTER PROCESSING" + nl + nl]
    for i, ev in enumerate(events):
        payload = json.dumps(ev, ensure_ascii=False, separators=(",", ":")).encode()
        if i == bad_at:
            payload = payload[:-2]
        if i == 3:  # one event on two data lines, joined with a newline
            cut = payload.index(b'"choices"')
            payload = payload[:cut] + nl + b"data: " + payload[cut:]
        out.append(b"data: " + payload + nl + nl)
        if i % 11 == 5:
            out.append(b": keep-alive" + nl + nl)
    out.append(b"data: [DONE]" + nl + nl + b": after" + nl + nl + b'data: {"choices":[]}' + nl + nl)
    return b"".join(out)


def _outcome(raw: bytes, pieces, **kw):
    """The body (or the failure's class and message) and the counts of an assembler fed `raw` cut into `pieces`."""
    a = ChatStreamAssembler(**kw)
    try:
        for piece in pieces:
            a.feed(piece)
        result = a.body()
    except RequestFailure as f:
        result = (f.error_class, f.message)
    return result, a.chunks, a.keepalives


def _cuts(raw: bytes, rng, threshold: int) -> list[bytes]:
    """`raw` cut at random points, inside a multi-byte UTF-8 character, after a CR and inside `data:`, and at
    exactly `threshold` bytes after the start (where the first batch is decoded)."""
    points = {rng.randrange(len(raw)) for _ in range(len(raw) // 200)}
    points.add(raw.index("🙂".encode()) + 2)
    points.add(raw.index(b"da") + 2)
    if b"\r" in raw:
        points.add(raw.index(b"\r") + 1)
    points.update((threshold, threshold + 1))
    edges = [0, *sorted(p for p in points if 0 < p < len(raw)), len(raw)]
    return [raw[a:b] for a, b in zip(edges, edges[1:])]


@pytest.mark.parametrize("nl", [b"\n", b"\r\n", b"\r"])
def test_assembler_batches_equal_one_batch(nl):
    """Decoding in batches (a small `batch_bytes`) gives the body and counts of decoding the whole stream at once,
    for each line ending and network reads cut anywhere: random points, mid-UTF-8 character, mid-CRLF or between
    two CRs, mid-`data:`, and byte by byte
    (so at every batch boundary)."""
    import math
    import random

    raw = _long_stream(400, nl=nl)
    whole = _outcome(raw, [raw], batch_bytes=math.inf)
    body = whole[0]
    assert isinstance(body, dict) and body["prompt_token_ids"] == [1, 2, 3] and body["model"] == "m"
    assert body["choices"][0]["token_ids"] == list(range(400)) and "🙂" in body["choices"][0]["message"]["reasoning"]
    assert len(body["choices"][0]["message"]["tool_calls"]) == 2 and body["usage"]["completion_tokens"] == 400
    assert whole[1] == 403 and whole[2] == 1 + 403 // 11 + 1 + 1  # chunks before [DONE]; every keep-alive
    rng = random.Random(15)
    between_lines = raw.index(nl + b'data: "choices"') + 1  # inside the two-line event, after a CR if any
    for threshold in (1, 97, 300, between_lines, 4096, len(raw) - 1):
        got = _outcome(raw, _cuts(raw, rng, threshold), batch_bytes=threshold)
        assert got == whole, threshold
    assert _outcome(raw, [raw[i : i + 1] for i in range(len(raw))], batch_bytes=500) == whole


def test_assembler_memory_bounded_by_one_batch():
    """A 20 MB stream (~64K chunks) is decoded as it arrives: the undecoded bytes never exceed a batch plus one
    event plus one network read, and the body is complete."""
    env = b'data: {"id":"gen-1764000000-abcdefghijklmnopqrst","provider":"Moonshot AI","model":"moonshotai/kimi-k2.5",'
    env += b'"object":"chat.completion.chunk","created":1764000000,"choices":[{"index":0,"delta":{"role":"assistant",'
    event = (
        env
        + b'"content":"tok ","reasoning":null},"finish_reason":null,"native_finish_reason":null,"logprobs":null}]}\n\n'
    )
    n = 20_000_000 // len(event)
    last = env + b'"content":""},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
    raw = event * n + last
    read = 16 * 1024
    a = ChatStreamAssembler()
    peak = 0
    for i in range(0, len(raw), read):
        a.feed(raw[i : i + read])
        peak = max(peak, a.buffered_bytes)
    assert peak <= a.batch_bytes + len(event) + read
    assert peak >= a.batch_bytes - read  # it did hold a batch before decoding it
    body = a.body()
    assert body["choices"][0]["message"]["content"] == "tok " * n and a.chunks == n + 1
    assert a.buffered_bytes == 0


@pytest.mark.parametrize("done", [True, False])
def test_assembler_early_batch_failures_same_as_one_batch(done):
    """An error chunk in an early batch raises from `feed`, with the class and message of decoding at once; a chunk
    that is not JSON in an early batch is reported by `body()` as before (malformed, or the cut when no [DONE])."""
    import math

    for kw in ({"error_at": 30}, {"bad_at": 30}):
        raw = _long_stream(600, **kw)
        if not done:
            raw = raw[: raw.index(b"data: [DONE]")]
        whole = _outcome(raw, [raw], batch_bytes=math.inf)
        pieces = [raw[i : i + 512] for i in range(0, len(raw), 512)]
        got = _outcome(raw, pieces, batch_bytes=2048)
        assert got[0] == whole[0]
        error_class, message = got[0]
        if "error_at" in kw:
            assert error_class == "provider_error" and "upstream gone" in message and "after 31 chunks" in message
            a = ChatStreamAssembler(batch_bytes=2048)
            with pytest.raises(RequestFailure):  # raised while the stream is still arriving
                for piece in pieces[: len(pieces) // 2]:
                    a.feed(piece)
        else:
            assert error_class == ("malformed_body" if done else "connection")
            assert (not done) or "stream chunk 31 is not JSON" in message
