"""Deterministic answers of the simulated servers: request keys, token counters, and the answer to one request.

An answer is a pure function of the request (hash of messages + seed): reasoning that quotes the prompt, an answer,
and, for ~60% of prompts that offer tools, tool calls whose arguments follow the tool's JSON schema. Shared by every
wire format (OpenRouter, vLLM, SGLang), which only differ in how they put the answer on the wire.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from eagle_pipeline.prompts import canonical_json

CountCompletion = Callable[[str, str, list], int]
CountPrompt = Callable[[list, "list | None", bool], int]  # (messages, tools, thinking) -> prompt tokens


def request_key(messages: Sequence[dict[str, Any]] | str, seed: int | None = None) -> str:
    """The key a simulated server files a request under: a hash of the canonical messages and the seed.

    `messages` may be the prompts table's `messages_json` (already canonical) or the list itself.
    """
    mj = messages if isinstance(messages, str) else canonical_json(list(messages))
    return hashlib.sha256(f"{mj}|{seed}".encode()).hexdigest()[:24]


def ids_key(input_ids: Sequence[int], seed: int | None = None) -> str:
    """SGLang server key: a hash of the prompt ids and the seed."""
    return hashlib.sha256(f"{','.join(map(str, input_ids))}|{seed}".encode()).hexdigest()[:24]


def crude_token_count(text: str) -> int:
    """~4 bytes a token: the fallback when no tokenizer-backed counter is given."""
    return (len(text.encode("utf-8")) + 3) // 4


def crude_completion_tokens(reasoning: str, content: str, tool_calls: list) -> int:
    n = crude_token_count(reasoning) + crude_token_count(content) + 1  # + end of turn
    if reasoning:
        n += 2  # think markers
    for tc in tool_calls:
        fn = tc.get("function", {})
        n += 5 + crude_token_count(fn.get("name", "")) + crude_token_count(fn.get("arguments", ""))
    return n


def crude_prompt_tokens(messages: list, tools: list | None, thinking: bool = True) -> int:
    n = 3
    for m in messages:
        c = m.get("content")
        n += 4 + crude_token_count(c if isinstance(c, str) else json.dumps(c or ""))
    if tools:
        n += crude_token_count(json.dumps(tools))
    return n


_WORD = re.compile(r"[A-Za-z][A-Za-z'\-]{3,}")
_STOP = {
    "what",
    "that",
    "this",
    "with",
    "from",
    "have",
    "your",
    "about",
    "which",
    "would",
    "could",
    "should",
    "there",
    "their",
    "please",
    "explain",
}

_REASONING = (
    'The user is asking: "{snippet}".',
    "The key terms are {w1} and {w2}, so the answer has to connect them.",
    "Let me work through {w3} step by step before writing anything.",
    "I should double-check the part about {w1}; it is easy to get wrong.",
    "An edge case involving {w2} is worth a sentence.",
    "A short, direct answer with one example should be enough here.",
    "First define {w1}, then show how {w3} follows from it.",
    "Nothing in the request about {w2} is ambiguous, so no clarifying question is needed.",
)
_CONTENT = (
    "Here is the short version about {w1}.",
    "In brief, {w1} relates to {w2} in a direct way: one determines the other.",
    "Start from {w3}; then apply it to {w1}, and the result follows.",
    "For example, take a small case of {w2} and check it by hand.",
    "A common mistake is to ignore {w3} — keep it in mind.",
    "If you want, I can go deeper into {w2}.",
)


def _topic(messages: list) -> tuple[str, list[str]]:
    text = ""
    for m in reversed(messages):
        if m.get("role") in ("user", "tool") and isinstance(m.get("content"), str):
            text = m["content"]
            break
    words = [w for w in _WORD.findall(text) if w.lower() not in _STOP] or ["question", "request", "details"]
    snippet = " ".join(text.split()[:10]) or "the request"
    return snippet.replace('"', "'"), words


def _value_for(schema: Any, name: str, rng: random.Random, words: list[str], depth: int = 0) -> Any:
    if not isinstance(schema, dict):
        return rng.choice(words)
    if schema.get("enum"):
        return rng.choice(schema["enum"])
    t = schema.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), "string")
    if t == "integer":
        lo, hi = int(schema.get("minimum", 1)), int(schema.get("maximum", 100))
        return rng.randint(lo, max(lo, hi))
    if t == "number":
        flo, fhi = float(schema.get("minimum", 0)), float(schema.get("maximum", 100))
        return round(rng.uniform(flo, max(flo, fhi)), 2)
    if t == "boolean":
        return rng.random() < 0.5
    if t == "array":
        if depth > 3:
            return []
        return [_value_for(schema.get("items", {}), name, rng, words, depth + 1) for _ in range(rng.randint(1, 2))]
    if t == "object" or "properties" in schema:
        if depth > 3:
            return {}
        props = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        return {
            k: _value_for(v, k, rng, words, depth + 1) for k, v in props.items() if k in required or rng.random() < 0.5
        }
    return " ".join(rng.sample(words, k=min(len(words), rng.randint(1, 3))))


@dataclass(frozen=True)
class AnswerLengths:
    """Long answers, as a reasoning model writes them: each answer's length (in ~4-byte crude tokens, before any
    `max_tokens` cut) is drawn per request key from a log-normal of mean `mean_tokens` and shape `sigma`, capped at
    `cap_tokens`; `reasoning_share` of it is reasoning. The text is the usual templates, repeated with fresh words."""

    mean_tokens: float = 3460.0
    sigma: float = 0.9
    cap_tokens: int = 16384
    reasoning_share: float = 0.8

    def draw(self, key: str) -> int:
        rng = random.Random(f"length:{key}")
        mu = math.log(self.mean_tokens) - self.sigma**2 / 2  # the log-normal's mean is exp(mu + sigma^2 / 2)
        return max(8, min(self.cap_tokens, round(rng.lognormvariate(mu, self.sigma))))


def _grow(text: str, target_chars: int, templates: tuple[str, ...], fill: Callable[[str], str]) -> str:
    parts = [text] if text else []
    size = len(text)
    i = 0
    while size < target_chars:
        part = fill(templates[i % len(templates)])
        parts.append(part)
        size += len(part) + 1
        i += 1
    return " ".join(parts)


@dataclass
class Answer:
    reasoning: str
    content: str
    tool_calls: list[dict[str, Any]]
    finish_reason: str


def synthesize(
    messages: list,
    tools: list | None,
    key: str,
    *,
    thinking: bool = True,
    tool_call_rate: float = 0.6,
    tool_rounds: int = 0,
    lengths: AnswerLengths | None = None,
) -> Answer:
    """The deterministic answer to one request.

    After a tool result the answer calls no tool, unless the conversation has fewer than `tool_rounds` tool results
    so far (an agent loop of that many rounds: what multi-turn regeneration tests need). With `lengths`, the
    reasoning and content are grown to the length drawn for this key (a tool-calling answer grows its reasoning);
    nothing else changes."""
    rng = random.Random(int(key, 16))
    snippet, words = _topic(messages)

    def fill(t: str) -> str:
        return t.format(snippet=snippet, w1=rng.choice(words), w2=rng.choice(words), w3=rng.choice(words))

    reasoning = ""
    if thinking:
        reasoning = " ".join([fill(_REASONING[0])] + [fill(t) for t in rng.sample(_REASONING[1:], k=rng.randint(2, 5))])
    content = " ".join(fill(t) for t in rng.sample(_CONTENT, k=rng.randint(2, 5)))
    tool_calls: list[dict[str, Any]] = []
    last_role = messages[-1].get("role") if messages else None
    usable = [
        t
        for t in (tools or [])
        if isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name")
    ]
    may_call = last_role != "tool" or sum(m.get("role") == "tool" for m in messages) < tool_rounds
    if usable and may_call and rng.random() < tool_call_rate:
        prior = sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")
        n = 2 if len(usable) > 1 and rng.random() < 0.2 else 1
        for i, tool in enumerate(rng.sample(usable, k=n)):
            fn = tool["function"]
            args = _value_for(fn.get("parameters") or {"type": "object", "properties": {}}, fn["name"], rng, words)
            tool_calls.append(
                {
                    "id": f"functions.{fn['name']}:{prior + i}",
                    "type": "function",
                    "index": i,
                    "function": {"name": fn["name"], "arguments": json.dumps(args, ensure_ascii=False)},
                }
            )
        content = "" if rng.random() < 0.5 else f"I'll call {tool_calls[0]['function']['name']} to get that."
        return _grown(Answer(reasoning, content, tool_calls, "tool_calls"), key, words, lengths)
    return _grown(Answer(reasoning, content, [], "stop"), key, words, lengths)


def _grown(ans: Answer, key: str, words: list[str], lengths: AnswerLengths | None) -> Answer:
    """`ans` grown to the length `lengths` draws for `key` (from its own random stream, so that everything else in
    the answer is what it is without `lengths`): reasoning to its share (all of it for a tool call), content the rest."""
    if lengths is None:
        return ans
    rng = random.Random(f"grow:{key}")

    def fill(t: str) -> str:
        return t.format(snippet="", w1=rng.choice(words), w2=rng.choice(words), w3=rng.choice(words))

    target_chars = 4 * lengths.draw(key)
    share = 1.0 if ans.tool_calls else lengths.reasoning_share
    reasoning_chars = round(target_chars * share) if ans.reasoning else 0
    reasoning = _grow(ans.reasoning, reasoning_chars, _REASONING[1:], fill) if reasoning_chars else ans.reasoning
    content = ans.content if ans.tool_calls else _grow(ans.content, target_chars - reasoning_chars, _CONTENT, fill)
    return Answer(reasoning, content, ans.tool_calls, ans.finish_reason)


def tool_history_problem(messages: list) -> str | None:
    """Why a chat API would reject this history's tool results (None: it would not): each tool message must answer a
    call of the latest assistant message with tool calls, each call at most once."""
    open_ids: set[Any] = set()
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        if m.get("role") == "assistant" and m.get("tool_calls"):
            open_ids = {c.get("id") for c in m["tool_calls"] if isinstance(c, dict)}
        elif m.get("role") == "tool":
            if m.get("tool_call_id") not in open_ids:
                return f"messages[{i}]: tool_call_id {m.get('tool_call_id')!r} answers no open tool call"
            open_ids.discard(m.get("tool_call_id"))
    return None


def _longest_prefix(text: str, fits: Callable[[str], bool]) -> str:
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(text[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return text[:lo]


def truncate_answer(ans: Answer, max_tokens: int, count: CountCompletion) -> Answer:
    """Cut an answer to `max_tokens` as a provider would: reasoning first consumes the budget; finish 'length'."""
    if count(ans.reasoning, ans.content, ans.tool_calls) <= max_tokens:
        return ans
    if count(ans.reasoning, "", []) >= max_tokens:
        r = _longest_prefix(ans.reasoning, lambda p: count(p, "", []) <= max_tokens)
        return Answer(r, "", [], "length")
    c = _longest_prefix(ans.content, lambda p: count(ans.reasoning, p, []) <= max_tokens)
    return Answer(ans.reasoning, c, [], "length")
