"""Kimi-like answer lengths of the simulated OpenRouter server (`simulation.AnswerLengths`): what the seed-scale
rehearsal (benchmarks/bench_seed_scale.py) asks the server for."""

from __future__ import annotations

import statistics

from eagle_pipeline.simulation import (
    AnswerLengths,
    SimulatedOpenRouterServer,
    crude_token_count,
    request_key,
    synthesize,
)

from .generation_helpers import WEATHER_TOOL


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Explain how the parser cache handles case {i} of the lattice theorem."}]


def test_lengths_follow_the_drawn_length_with_a_long_tail():
    lengths = AnswerLengths(mean_tokens=3460, cap_tokens=16384)
    sizes, drawn = [], []
    for i in range(400):
        key = request_key(_messages(i), 0)
        ans = synthesize(_messages(i), None, key, lengths=lengths)
        sizes.append(crude_token_count(ans.reasoning) + crude_token_count(ans.content))
        drawn.append(lengths.draw(key))
        assert ans.reasoning and ans.content and ans.finish_reason == "stop"
        if drawn[-1] > 1000:  # reasoning first: about reasoning_share of the answer
            assert 0.7 < crude_token_count(ans.reasoning) / sizes[-1] < 0.9
    # grown to the drawn length, a sentence or so over (the few shortest draws are the template sentences' length)
    assert all(d <= s <= max(d, 300) + 80 for d, s in zip(drawn, sizes))
    assert 2800 < statistics.mean(drawn) < 4200  # the log-normal's mean, cap included
    assert max(drawn) > 3 * statistics.median(drawn)  # a long tail
    assert max(drawn) <= 16384


def test_without_lengths_answers_stay_short_and_unchanged():
    key = request_key(_messages(1), 0)
    assert synthesize(_messages(1), None, key) == synthesize(_messages(1), None, key, lengths=None)
    assert crude_token_count(synthesize(_messages(1), None, key).reasoning) < 300


def test_a_tool_calling_answer_grows_its_reasoning_and_keeps_its_calls():
    lengths = AnswerLengths(mean_tokens=2000)
    for i in range(40):
        key = request_key(_messages(i), 0)
        short = synthesize(_messages(i), [WEATHER_TOOL], key, tool_call_rate=1.0)
        long = synthesize(_messages(i), [WEATHER_TOOL], key, tool_call_rate=1.0, lengths=lengths)
        assert long.tool_calls == short.tool_calls and long.finish_reason == "tool_calls"
        assert crude_token_count(long.reasoning) >= 0.8 * lengths.draw(key) - 1


def test_the_server_takes_lengths_as_keyword_arguments():
    srv = SimulatedOpenRouterServer(lengths={"mean_tokens": 1000, "sigma": 0.5})
    body = {"model": "m", "messages": _messages(3), "max_tokens": 200}
    answer = srv.answer(body)
    assert answer["choices"][0]["finish_reason"] == "length"  # 1,000-ish tokens cut at max_tokens
    assert answer["usage"]["completion_tokens"] <= 200
