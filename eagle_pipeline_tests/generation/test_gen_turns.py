"""On-policy multi-turn regeneration (`regenerate: all_turns`) over real HTTP on loopback: histories from the server's
request log, stop reasons, exactly-once resume per turn (kill -9 between turns), exact prompt ids (real Kimi
tokenizer, against an independent render of its chat template)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jinja2
import jinja2.ext
import pyarrow.parquet as pq
import pytest

from eagle_pipeline.generation.plan.turns import (
    END_COMPLETE,
    END_FEWER_TOOL_CALLS,
    END_LENGTH,
    END_MORE_TOOL_CALLS,
    END_NO_TOOL_CALL,
    END_TOOL_MISMATCH,
    ConversationError,
    next_turn,
    split_conversation,
    turn_sample_id,
)
from eagle_pipeline.generation.run.options import RunOptions
from eagle_pipeline.generation.store.shards import part_files, read_responses
from eagle_pipeline.prompts import Prompt, canonical_json, prompts_table
from eagle_pipeline.simulation import SimulatedOpenRouterServer

from .generation_helpers import (
    SAMPLING,
    SEARCH_TOOL,
    WEATHER_TOOL,
    FileOpens,
    out_dirs,
    run,
    run_child,
    sample_key,
    sim_backend,
)


def _source(result_name: str | None = None, rounds: int = 2) -> list[dict]:
    """A tool conversation with `rounds` source tool calls and results: `rounds + 1` turns to generate."""
    msgs: list[dict] = [
        {"role": "system", "content": "You are a weather agent."},
        {"role": "user", "content": "Plan my week in Paris: what is the weather going to be?"},
    ]
    for r in range(rounds):
        call = {
            "id": f"call_src_{r}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})},
        }
        msgs.append({"role": "assistant", "content": f"source turn {r}", "tool_calls": [call]})
        result = {"role": "tool", "tool_call_id": f"call_src_{r}", "content": f"day {r}: 18C, sunny spells"}
        if result_name:
            result["name"] = result_name
        msgs.append(result)
    return msgs


def _trip(i: int) -> list[dict]:
    """`_source()` with the user's message made the i-th of its kind: another conversation id."""
    msgs = _source()
    msgs[1] = {**msgs[1], "content": f"{msgs[1]['content']} (trip {i})"}
    return msgs


def _shard_of_turn(out: Path) -> dict[tuple[str, int], Path]:
    """(conversation id, turn index) -> the shard holding that turn, for shards of one row each."""
    return {
        (t.column("conversation_id")[0].as_py(), t.column("turn_index")[0].as_py()): p
        for p in part_files(out)
        for t in [pq.read_table(p)]
    }


def _prompts(messages: list[dict], tools: list[dict] | None = None, regenerate: str = "all_turns"):
    return prompts_table("B5", [Prompt("conv-1", messages, tools or [WEATHER_TOOL])], SAMPLING.to_dict(), regenerate)


def _rows(root: Path) -> list[dict]:
    return sorted(read_responses(out_dirs(root, "B5")[0]).to_pylist(), key=lambda r: r["turn_index"])


def _sent(srv: SimulatedOpenRouterServer, row: dict) -> dict:
    body = srv.body_for(sample_key(row["sample_id"], row["messages_json"]))
    assert body is not None, f"the server never received turn {row['turn_index']}"
    return body


def test_three_turn_tool_conversation_histories_are_the_targets_own(tmp_path):
    source = _source()
    prompts = _prompts(source)
    conv = prompts.column("sample_id")[0].as_py()
    events = []
    with SimulatedOpenRouterServer(tool_call_rate=1.0, tool_rounds=2) as srv:
        s = run(
            prompts,
            sim_backend(srv.url, concurrency=2),
            tmp_path,
            dataset="B5",
            progress=events.append,
            options=RunOptions(regenerate="all_turns"),
        )
        rows = _rows(tmp_path)
        assert (s.requested, s.completed, s.failed) == (3, 3, 0)
        assert (events[-1].done, events[-1].total) == (1, 1)  # progress counts the conversation, not its turns
        assert [r["turn_index"] for r in rows] == [0, 1, 2]
        assert [r["sample_id"] for r in rows] == [turn_sample_id(conv, k) for k in range(3)]
        assert len({r["sample_id"] for r in rows}) == 3 and conv not in {r["sample_id"] for r in rows}
        assert {r["conversation_id"] for r in rows} == {conv}
        assert [r["conversation_end"] for r in rows] == [None, None, END_COMPLETE]
        assert [r["finish_reason"] for r in rows] == ["tool_calls", "tool_calls", "stop"]
        assert len(srv.request_log()) == 3 and all(rec.status == 200 for rec in srv.request_log())

        bodies = [_sent(srv, r) for r in rows]
        for row, body in zip(rows, bodies):
            assert body["messages"] == json.loads(row["messages_json"])  # stored = sent
        assert bodies[0]["messages"] == source[:2]  # turn 0: the source's messages before its first assistant turn
        for k in (1, 2):
            sent = bodies[k]["messages"]
            # The history is the target's own turns, as the server answered them, never the source's.
            assert [m for m in sent if m["role"] == "assistant"] == [
                {
                    "role": "assistant",
                    "content": srv.answer(b)["choices"][0]["message"]["content"],
                    "reasoning": srv.answer(b)["choices"][0]["message"]["reasoning"],
                    "tool_calls": srv.answer(b)["choices"][0]["message"]["tool_calls"],
                }
                for b in bodies[:k]
            ]
            assert not any("source turn" in (m.get("content") or "") for m in sent)
            # Tool results are the source's, in order, addressed to the target's calls.
            tools_sent = [m for m in sent if m["role"] == "tool"]
            assert [m["content"] for m in tools_sent] == [f"day {r}: 18C, sunny spells" for r in range(k)]
            assert [m["tool_call_id"] for m in tools_sent] == [
                json.loads(rows[j]["tool_calls_json"])[0]["id"] for j in range(k)
            ]
            assert sent[: len(bodies[k - 1]["messages"])] == bodies[k - 1]["messages"]

        again = run(prompts, sim_backend(srv.url), tmp_path, dataset="B5", options=RunOptions(regenerate="all_turns"))
        assert (again.requested, again.already_done) == (0, 1) and len(srv.request_log()) == 3


@pytest.mark.parametrize(
    ("tool_rounds", "result_name", "n_rows", "end"),
    [
        (1, None, 2, END_NO_TOOL_CALL),  # turn 1 answers without a tool where the source has a result
        (2, "lookup_calendar", 1, END_TOOL_MISMATCH),  # the source's result answers another tool
    ],
)
def test_conversation_stops_with_its_reason_rows_kept(tmp_path, tool_rounds, result_name, n_rows, end):
    prompts = _prompts(_source(result_name))
    with SimulatedOpenRouterServer(tool_call_rate=1.0, tool_rounds=tool_rounds) as srv:
        run(prompts, sim_backend(srv.url), tmp_path, dataset="B5", options=RunOptions(regenerate="all_turns"))
        rows = _rows(tmp_path)
        assert [r["turn_index"] for r in rows] == list(range(n_rows))
        assert [r["conversation_end"] for r in rows] == [None] * (n_rows - 1) + [end]
        assert len(srv.request_log()) == n_rows
        # A stopped conversation is answered: a rerun requests nothing.
        again = run(prompts, sim_backend(srv.url), tmp_path, dataset="B5", options=RunOptions(regenerate="all_turns"))
        assert again.requested == 0 and len(srv.request_log()) == n_rows


def test_next_turn_pairs_results_in_order_and_names_every_stop():
    msgs = _source(rounds=1)
    src = split_conversation("c", canonical_json(msgs), None)
    assert src.n_turns == 2 and list(src.prefix) == msgs[:2]

    def call(name: str, i: int) -> dict:
        return {"id": f"functions.{name}:{i}", "type": "function", "function": {"name": name, "arguments": "{}"}}

    def answer(*calls: dict) -> dict:
        return {"role": "assistant", "content": "", "reasoning": "think", "tool_calls": list(calls)}

    ok = next_turn(src, 0, msgs[:2], answer(call("get_weather", 0)), "tool_calls")
    assert ok.end is None and ok.next_messages is not None
    assert ok.next_messages[-1] == {**msgs[3], "tool_call_id": "functions.get_weather:0"}
    assert ok.next_messages[2]["reasoning"] == "think"
    assert next_turn(src, 0, msgs[:2], {"role": "assistant", "content": "x"}, "stop").end == END_NO_TOOL_CALL
    two = answer(call("get_weather", 0), call("get_weather", 1))
    assert next_turn(src, 0, msgs[:2], two, "tool_calls").end == END_MORE_TOOL_CALLS
    assert next_turn(src, 0, msgs[:2], answer(call("search_docs", 0)), "tool_calls").end == END_TOOL_MISMATCH
    assert next_turn(src, 0, msgs[:2], answer(call("get_weather", 0)), "length").end == END_LENGTH
    assert next_turn(src, 1, msgs, {"role": "assistant", "content": "done"}, "stop").end == END_COMPLETE
    two_results = _source(rounds=1)
    two_results.append({"role": "tool", "tool_call_id": "call_src_0", "content": "more"})
    src2 = split_conversation("c", canonical_json(two_results), None)
    assert next_turn(src2, 0, msgs[:2], answer(call("get_weather", 0)), "tool_calls").end == END_FEWER_TOOL_CALLS
    with pytest.raises(ConversationError, match="conversation c: starts with an assistant turn"):
        split_conversation("c", canonical_json(msgs[2:]), None)


def test_simulated_server_rejects_a_tool_result_for_no_open_call(tmp_path):
    """The double refuses what a chat API refuses, so a history that kept the source's call ids cannot pass."""
    msgs = _source(rounds=1)
    msgs[3] = {**msgs[3], "tool_call_id": "functions.get_weather:9"}
    prompts = prompts_table("B5", [Prompt("p", msgs, [WEATHER_TOOL, SEARCH_TOOL])], SAMPLING.to_dict())
    with SimulatedOpenRouterServer() as srv:
        s = run(prompts, sim_backend(srv.url), tmp_path, dataset="B5")
        assert (s.completed, s.errors_by_class) == (0, {"bad_request": 1})


def _child(prompts_path: Path, url: str, root: Path) -> subprocess.Popen:
    options = {"regenerate": "all_turns", "dataset": "B5", "commit_every_rows": 1, "backend": {"concurrency": 1}}
    return run_child(prompts_path, url, root, options)


def _committed_turns(out: Path) -> list[int]:
    return sorted(k for p in part_files(out) for k in pq.read_table(p).column("turn_index").to_pylist())


def test_kill_9_between_turns_resumes_at_the_next_turn(tmp_path):
    prompts = _prompts(_source())
    prompts_path = tmp_path / "prompts.parquet"
    pq.write_table(prompts, prompts_path)
    out, _ = out_dirs(tmp_path, "B5")
    with SimulatedOpenRouterServer(tool_call_rate=1.0, tool_rounds=2, latency_s=0.5) as srv:
        child = _child(prompts_path, srv.url, tmp_path)
        deadline = time.monotonic() + 60
        while _committed_turns(out) != [0, 1]:
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "turns 0 and 1 never committed"
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)  # turn 2 is in flight (or about to be)
        child.wait()
        assert _committed_turns(out) == [0, 1]
        before = len(srv.request_log())

        done = _child(prompts_path, srv.url, tmp_path)
        stdout, stderr = done.communicate(timeout=60)
        assert done.returncode == 0, stderr
        assert json.loads(stdout.strip().splitlines()[-1])["requested"] == 1
        rows = _rows(tmp_path)
        assert [r["turn_index"] for r in rows] == [0, 1, 2] and rows[2]["conversation_end"] == END_COMPLETE
        keys = [sample_key(r["sample_id"], r["messages_json"]) for r in rows]
        log = srv.request_log()
        assert {rec.key for rec in log[before:]} == {keys[2]}  # the rerun asked for turn 2 only
        counts = srv.request_counts()
        assert counts[keys[0]] == counts[keys[1]] == 1  # committed turns were never re-requested
        assert 1 <= counts[keys[2]] <= 2  # at most once more than the attempt the kill interrupted


def _independent_render(template_path: Path, messages: list[dict], tools: list[dict]) -> str:
    """The Kimi chat template rendered with plain jinja2 (transformers' settings), not the project's renderer."""
    from eagle_pipeline.tokens.tool_declarations import sort_keys_deep, typescript_tool_declarations

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda v, **kw: json.dumps(v, ensure_ascii=False, **kw)
    history = [
        {**{k: v for k, v in m.items() if k != "reasoning"}, "reasoning_content": m["reasoning"]}
        if "reasoning" in m
        else m
        for m in messages
    ]
    tools = sort_keys_deep(tools)
    return env.from_string(template_path.read_text()).render(
        messages=history,
        tools=tools,
        tools_ts_str=typescript_tool_declarations(tools),
        add_generation_prompt=True,
        thinking=True,
    )


@pytest.mark.parametrize("wire", ["openrouter", "vllm"])
def test_prompt_ids_hold_each_earlier_turns_output_ids_where_the_template_puts_them(tmp_path, kimi_dir, wire):
    """OpenRouter returns text (ids rebuilt from it); the vLLM double, given the Kimi tokenizer, returns the ids a
    real vLLM serving Kimi returns: each turn's prompt rendered by the chat template from the history it was sent."""
    from eagle_pipeline.tokens import IDS_RECONSTRUCTED, IDS_RETURNED, load_tokenizer, reconstruct_table
    from eagle_pipeline_tests.doubles import SimulatedVLLMServer

    from .test_gen_selfhosted import vllm_backend

    tok = load_tokenizer(kimi_dir)
    prompts = _prompts(_source())
    if wire == "openrouter":
        with SimulatedOpenRouterServer(tool_call_rate=1.0, tool_rounds=2) as srv:
            run(prompts, sim_backend(srv.url), tmp_path, dataset="B5", options=RunOptions(regenerate="all_turns"))
    else:
        with SimulatedVLLMServer(tokenizer=tok, tool_call_rate=1.0, tool_rounds=2) as vllm:
            run(prompts, vllm_backend(vllm.url), tmp_path, dataset="B5", options=RunOptions(regenerate="all_turns"))
    responses = read_responses(out_dirs(tmp_path, "B5")[0])
    returned_prompts = [ids is not None for ids in responses.column("prompt_token_ids").to_pylist()]
    assert returned_prompts == [wire == "vllm"] * 3  # vLLM: the prompt ids checked below are the server's
    samples = reconstruct_table(responses, tok, "kimi-k2.5", dataset_has_tools=True).to_pylist()
    samples.sort(key=lambda r: r["turn_index"])
    assert [r["turn_index"] for r in samples] == [0, 1, 2]
    assert {r["ids_origin"] for r in samples} == {IDS_RETURNED if wire == "vllm" else IDS_RECONSTRUCTED}
    assert [r["finish_reason"] for r in samples] == ["tool_calls", "tool_calls", "stop"]
    assert {r["conversation_id"] for r in samples} == {responses.column("conversation_id")[0].as_py()}
    p = [r["prompt_ids"] for r in samples]
    o = [r["output_ids"] for r in samples]
    last_messages = json.loads(_rows(tmp_path)[2]["messages_json"])
    independent = tok.encode_with_specials(
        _independent_render(kimi_dir / "chat_template.jinja", last_messages, [WEATHER_TOOL])
    )
    assert independent == p[2]
    for k in (0, 1):
        # Turn k's output (reasoning, </think>, content, tool section, <|im_end|>) follows turn k's prompt verbatim.
        assert p[k + 1][: len(p[k]) + len(o[k])] == p[k] + o[k]
        assert independent[len(p[k]) : len(p[k]) + len(o[k])] == o[k]


def test_a_conversation_missing_a_turn_is_reopened(tmp_path):
    """Rows moved out of the shards (as retire-responses does) reopen their conversation: a missing last turn is
    requested again; a missing middle turn fails the run naming the conversation (its later turns answer a history
    that no longer exists)."""
    prompts = _prompts(_source())
    conv = prompts.column("sample_id")[0].as_py()
    out, _ = out_dirs(tmp_path, "B5")
    with SimulatedOpenRouterServer(tool_call_rate=1.0, tool_rounds=2) as srv:
        run(
            prompts,
            sim_backend(srv.url),
            tmp_path,
            dataset="B5",
            options=RunOptions(regenerate="all_turns", commit_every_rows=1),
        )
        shard_of = {pq.read_table(p).column("turn_index")[0].as_py(): p for p in part_files(out)}
        assert sorted(shard_of) == [0, 1, 2]
        shard_of[2].rename(tmp_path / "turn2.parquet")
        again = run(prompts, sim_backend(srv.url), tmp_path, dataset="B5", options=RunOptions(regenerate="all_turns"))
        assert (again.requested, again.completed) == (1, 1)
        assert [r["turn_index"] for r in _rows(tmp_path)] == [0, 1, 2]
        shard_of[1].rename(tmp_path / "turn1.parquet")
        with pytest.raises(RuntimeError, match=f"conversation {conv} has committed turns \\[0, 2\\] but not \\[1\\]"):
            run(prompts, sim_backend(srv.url), tmp_path, dataset="B5", options=RunOptions(regenerate="all_turns"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts file opens with inotify")
def test_an_all_turns_run_start_reads_each_committed_shard_once(tmp_path):
    """Resuming two open conversations, the done set, the ledger, the open conversations and the progress counts
    come from one read of the committed shards; only the shards holding an open conversation's last committed turn
    are opened a second time, for that row's history (the kernel's count of opens over the whole run)."""
    prompts = prompts_table(
        "B5", [Prompt(f"conv-{i}", _trip(i), [WEATHER_TOOL]) for i in range(3)], SAMPLING.to_dict(), "all_turns"
    )
    first_conv, second_conv = prompts.column("sample_id").to_pylist()[:2]
    out, _ = out_dirs(tmp_path, "B5")
    with SimulatedOpenRouterServer(tool_call_rate=1.0, tool_rounds=2) as srv:
        run(
            prompts,
            sim_backend(srv.url),
            tmp_path,
            dataset="B5",
            options=RunOptions(regenerate="all_turns", commit_every_rows=1),
        )
        shard_of = _shard_of_turn(out)
        assert len(shard_of) == 9
        # The first conversation reopens after its turn 1, the second after its turn 0.
        for i, key in enumerate([(first_conv, 2), (second_conv, 1), (second_conv, 2)]):
            shard_of.pop(key).rename(tmp_path / f"aside-{i}.parquet")
        events: list = []
        with FileOpens(out) as opens:
            s = run(
                prompts,
                sim_backend(srv.url),
                tmp_path,
                dataset="B5",
                progress=events.append,
                options=RunOptions(regenerate="all_turns", progress_every_s=0.0),
            )
            counts = opens.counts()
    continued = {shard_of[(first_conv, 1)].name, shard_of[(second_conv, 0)].name}
    assert {p.name: counts[p.name] for p in shard_of.values()} == {
        p.name: 2 if p.name in continued else 1 for p in shard_of.values()
    }
    assert (s.already_done, s.requested, s.completed) == (1, 3, 3)
    assert (events[-1].response_rows, events[-1].rows_this_run) == (9, 3)
    second_turns = [r["turn_index"] for r in read_responses(out).to_pylist() if r["conversation_id"] == second_conv]
    assert second_turns == [0, 1, 2]


def test_all_turns_over_the_vllm_wire_format(tmp_path):
    """vLLM returns reasoning in `reasoning_content` (older releases) and ids with every turn; the history sent back
    carries the target's reasoning and calls, and each turn keeps the ids the server returned."""
    from eagle_pipeline_tests.doubles import SimulatedVLLMServer

    from .test_gen_selfhosted import END_THINK, EOS, THINK, encode, vllm_backend

    prompts = _prompts(_source())
    with SimulatedVLLMServer(
        encode=encode,
        think_start_id=THINK,
        think_end_id=END_THINK,
        eos_id=EOS,
        reasoning_field="reasoning_content",
        tool_call_rate=1.0,
        tool_rounds=2,
    ) as srv:
        s = run(prompts, vllm_backend(srv.url), tmp_path, dataset="B5", options=RunOptions(regenerate="all_turns"))
        rows = _rows(tmp_path)
        assert (s.completed, [r["conversation_end"] for r in rows]) == (3, [None, None, END_COMPLETE])
        bodies = [_sent(srv, r) for r in rows]
    for k in (1, 2):
        answer = srv.answer(bodies[k - 1])
        sent = [m for m in bodies[k]["messages"] if m["role"] == "assistant"][-1]
        message = answer["choices"][0]["message"]
        assert sent["reasoning"] == message["reasoning_content"] and sent["tool_calls"] == message["tool_calls"]
        assert rows[k - 1]["output_token_ids"] == answer["choices"][0]["token_ids"]
    assert all(r["prompt_token_ids"] and r["output_token_ids"] for r in rows)


def test_a_turn_that_fails_once_is_retried_and_the_conversation_goes_on(tmp_path):
    prompts = _prompts(_source())
    with SimulatedOpenRouterServer(tool_call_rate=1.0, tool_rounds=2, faults={"http_500": 1.0}) as srv:
        s = run(prompts, sim_backend(srv.url), tmp_path, dataset="B5", options=RunOptions(regenerate="all_turns"))
        rows = _rows(tmp_path)
        assert (s.completed, s.failed) == (3, 0) and [r["attempts"] for r in rows] == [2, 2, 2]
        assert [rec.status for rec in srv.request_log()] == [500, 200] * 3  # each turn after the one before


def test_retiring_a_turn_retires_the_conversation_from_that_turn_on(tmp_path):
    import pyarrow as pa

    from eagle_pipeline.generation.store.retire import retire_responses
    from eagle_pipeline.generation.store.shards import write_shard

    prompts = _prompts(_source())
    out, _ = out_dirs(tmp_path, "B5")
    with SimulatedOpenRouterServer(tool_call_rate=1.0, tool_rounds=2) as srv:
        run(
            prompts,
            sim_backend(srv.url),
            tmp_path,
            dataset="B5",
            options=RunOptions(regenerate="all_turns", commit_every_rows=1),
        )
        for i, p in enumerate(part_files(out)):  # turn 1 was answered by a provider found bad afterwards
            t = pq.read_table(p)
            bad = t.column("turn_index")[0].as_py() == 1
            t = t.set_column(t.schema.get_field_index("provider"), "provider", pa.array(["Bad" if bad else "Good"]))
            write_shard(t, out, i)
        summary = retire_responses(out, dataset="B5", provider="Bad")
        assert summary.rows_retired == 2 and summary.by_backend_provider == {"sim/Bad": 1, "sim/Good": 1}
        assert [r["turn_index"] for r in _rows(tmp_path)] == [0]
        again = run(prompts, sim_backend(srv.url), tmp_path, dataset="B5", options=RunOptions(regenerate="all_turns"))
        assert again.requested == 2
        rows = _rows(tmp_path)
        assert [r["turn_index"] for r in rows] == [0, 1, 2] and rows[2]["conversation_end"] == END_COMPLETE


def test_the_last_progress_report_agrees_with_the_final_metadata(tmp_path):
    """Live figures and the materialization's count the same things: conversations under `current_prompts*` and
    `already_done`, turn rows under `response_rows` and `completed_this_run`, earlier runs' turns included."""
    from eagle_pipeline.defs.generation import generation_metadata
    from eagle_pipeline.generation.store.coverage import current_responses
    from eagle_pipeline.generation.store.shards import read_errors

    prompts = prompts_table(
        "B5",
        [Prompt(f"conv-{i}", _trip(i), [WEATHER_TOOL]) for i in range(3)]
        + [Prompt("plain", _trip(3)[:2], [WEATHER_TOOL])],  # no assistant turn: one turn to generate
        SAMPLING.to_dict(),
        "all_turns",
    )
    out, errors_dir = out_dirs(tmp_path, "B5")
    with SimulatedOpenRouterServer(tool_call_rate=1.0, tool_rounds=2) as srv:
        run(
            prompts,
            sim_backend(srv.url),
            tmp_path,
            dataset="B5",
            options=RunOptions(regenerate="all_turns", commit_every_rows=1),
        )
        shards = _shard_of_turn(out)
        assert len(shards) == 3 * 3 + 1
        first, second = prompts.column("sample_id").to_pylist()[:2]
        # Conversations reopened at their last turn and at their second: 3 turns to request for 2 conversations.
        for i, key in enumerate([(first, 2), (second, 1), (second, 2)]):
            shards[key].rename(tmp_path / f"aside-{i}.parquet")
        events = []
        summary = run(
            prompts,
            sim_backend(srv.url),
            tmp_path,
            dataset="B5",
            progress=events.append,
            options=RunOptions(regenerate="all_turns"),
        )
    table, cov = current_responses("B5", read_responses(out), prompts.column("sample_id").to_pylist())
    final = {**generation_metadata(summary, table, read_errors(errors_dir), simulated=True), **cov.metadata()}
    last = events[-1].figures()
    shared = (
        "current_prompts",
        "current_prompts_answered",
        "current_prompts_missing",
        "already_done",
        "response_rows",
        "completed_this_run",
        "failed_this_run",
        "spend_usd_this_run",
    )
    assert {k: last[k] for k in shared} == {k: final[k] for k in shared}
    assert (last["current_prompts"], last["current_prompts_answered"], last["already_done"]) == (4, 4, 2)
    assert (last["response_rows"], last["completed_this_run"]) == (10, 3) and final["dagster/row_count"] == 10
    assert (events[-1].done_this_run, summary.requested) == (2, 3)
    assert [e.response_rows for e in events] == sorted(e.response_rows for e in events) and events[0].response_rows >= 7
