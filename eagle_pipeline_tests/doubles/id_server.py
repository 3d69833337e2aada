"""The base of the vLLM and SGLang doubles: answers rendered to token ids with a tokenizer-like `encode`."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from eagle_pipeline.simulation.answers import Answer, CountCompletion, truncate_answer
from eagle_pipeline.simulation.server import LoopbackServer


class IdServer(LoopbackServer):
    """Shared by the vLLM and SGLang doubles: answers rendered to ids with `encode` and special ids."""

    def __init__(
        self,
        *,
        encode: Callable[[str], list[int]],
        think_start_id: int,
        think_end_id: int,
        eos_id: int,
        latency_s: float = 0.0,
        faults: dict[str, Any] | None = None,
        port: int = 0,
    ) -> None:
        super().__init__(latency_s=latency_s, faults=faults, port=port)
        self.encode = encode
        self.think_start_id, self.think_end_id, self.eos_id = think_start_id, think_end_id, eos_id

    def output_ids(self, ans: Answer, *, thinking: bool, finished: bool) -> list[int]:
        ids: list[int] = []
        if thinking:
            ids += [self.think_start_id, *self.encode(ans.reasoning), self.think_end_id]
        ids += self.encode(ans.content)
        for tc in ans.tool_calls:
            ids += self.encode(json.dumps(tc["function"], ensure_ascii=False))
        if finished:
            ids.append(self.eos_id)
        return ids

    def _count(self, thinking: bool) -> CountCompletion:
        return lambda r, c, tcs: len(self.output_ids(Answer(r, c, tcs, "stop"), thinking=thinking, finished=True))

    def generate(self, ans: Answer, *, thinking: bool, max_tokens: int | None) -> tuple[Answer, list[int]]:
        """Ids as a server emits them: at most `max_tokens`, cut mid-stream (no closing markers) on 'length'.

        The text fields of a cut answer are the longest prefixes that fit (what a detokenizer would show, roughly)."""
        ids = self.output_ids(ans, thinking=thinking, finished=True)
        if not max_tokens or len(ids) <= max_tokens:
            return ans, ids
        cut = truncate_answer(ans, max_tokens, self._count(thinking))
        return Answer(cut.reasoning, cut.content, [], "length"), ids[:max_tokens]
