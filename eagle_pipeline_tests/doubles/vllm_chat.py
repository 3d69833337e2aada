"""The vLLM double: POST /v1/chat/completions with `return_token_ids`."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from typing import Any

from aiohttp import web

from eagle_pipeline.simulation.answers import Answer, request_key, synthesize, tool_history_problem
from eagle_pipeline.simulation.faults import fault_response
from eagle_pipeline.simulation.streaming import STREAM_FAULTS, StreamStyle, completion_chunks, write_stream
from eagle_pipeline.tokens import TargetTokenizer, reconstruct_output, render_prompt_ids
from eagle_pipeline.tokens.reconstruct import as_profile_ids
from eagle_pipeline_tests.doubles.id_server import IdServer


class SimulatedVLLMServer(IdServer):
    """vLLM's POST /v1/chat/completions with `return_token_ids` (top-level prompt_token_ids, choices[0].token_ids).

    `supports_token_ids=False` imitates a server older than v0.10.2 (the flag is ignored); `reasoning_field`
    chooses `reasoning` (current) or `reasoning_content` (older releases). `stream: true` requests get server-sent
    events paced by `stream` (a `StreamStyle` or its keyword arguments): `prompt_token_ids` in the first chunk,
    whose delta is always `{"role": "assistant", "content": ""}`, each chunk's `token_ids`, usage in a last chunk
    only when `stream_options.include_usage` is set, as vLLM does.

    Given the target's `tokenizer` (and its model `profile`), ids are the target's, as a real vLLM serving it
    returns them: `prompt_token_ids` the chat template's render of the request's messages and tools with the
    generation prompt (`tokens.render_prompt_ids`, the `thinking` of `chat_template_kwargs`), `token_ids` the
    answer in the profile's output layout (`tokens.reconstruct_output`: reasoning `</think>` content, tool-call
    section, end of turn); `encode` and the special ids then come from the tokenizer. Without one, a toy render:
    role markers and content through `encode`.

    As vLLM 0.32 answers: a model name other than `served_model_name` gets a 404 with vLLM's error body (None: every
    name is served, and echoed as `model`); `stop_reason` is the stop token id the answer ended on (vLLM adds the
    generation config's end-of-turn ids to the stop ids), null when that id is the tokenizer's own EOS
    (`eos_token_id`, from the tokenizer's `eos_token` when given one) or the answer was cut; `usage` carries
    `completion_tokens_details.reasoning_tokens`, counted as vLLM's think-tag reasoning parsers count (the ids after
    the first think-open, or from the start with thinking on, up to the first think-close).
    `chat_template` renders prompts with another template than the tokenizer's (a server started with
    `--chat-template`, or a checkpoint of another version). `prompt_blind` imitates a tiny randomly initialised
    model: its answer depends on the request's seed only, not on the prompt (one seed for every request then
    gives every prompt the same answer, as a real server does).
    """

    base_path = "/v1"
    routes = ("/chat/completions",)

    def __init__(
        self,
        *,
        supports_token_ids: bool = True,
        reasoning_field: str = "reasoning",
        stream: StreamStyle | dict[str, Any] | None = None,
        tool_call_rate: float = 0.6,
        tool_rounds: int = 0,
        tokenizer: TargetTokenizer | None = None,
        profile: str = "kimi-k2.5",
        served_model_name: str | None = None,
        eos_token_id: int | None = None,
        chat_template: str | None = None,
        prompt_blind: bool = False,
        **kw: Any,
    ) -> None:
        if tokenizer is not None and chat_template is not None:
            tokenizer = copy.copy(tokenizer)
            tokenizer.chat_template = chat_template
        self.tokenizer, self.profile = tokenizer, profile
        self.served_model_name, self.prompt_blind = served_model_name, prompt_blind
        if eos_token_id is None and tokenizer is not None and tokenizer.template_vars.get("eos_token"):
            eos_token_id = tokenizer.special_tokens.get(tokenizer.template_vars["eos_token"])
        self.eos_token_id = eos_token_id
        if tokenizer is not None:
            ids = as_profile_ids(tokenizer, profile)
            kw = dict(
                encode=tokenizer.encode_ordinary,
                think_start_id=ids.think_open_id,
                think_end_id=ids.think_close_id,
                eos_id=ids.eot_id,
                **kw,
            )
        super().__init__(**kw)
        self.tool_call_rate, self.tool_rounds = tool_call_rate, tool_rounds
        self.stream_style = stream if isinstance(stream, StreamStyle) else StreamStyle(**(stream or {}))
        self.supports_token_ids = supports_token_ids
        self.reasoning_field = reasoning_field

    def prompt_ids(self, messages: list, tools: list | None, *, thinking: bool = True) -> list[int]:
        """The ids the target sees: the chat template's render with a tokenizer, else the toy render."""
        if self.tokenizer is not None:
            return render_prompt_ids(self.tokenizer, messages, tools, thinking=thinking)
        text = "".join(f"<|{m.get('role')}|>{m.get('content') or ''}" for m in messages) + "<|assistant|>"
        if tools:
            text = json.dumps(tools) + text
        return self.encode(text)

    def output_ids(self, ans: Answer, *, thinking: bool, finished: bool) -> list[int]:
        """The answer's ids: the profile's output layout with a tokenizer, else the toy layout (`IdServer`)."""
        if self.tokenizer is None:
            return super().output_ids(ans, thinking=thinking, finished=finished)
        ids = reconstruct_output(
            self.tokenizer,
            self.profile,
            reasoning=ans.reasoning if thinking else None,
            content=ans.content,
            tool_calls=ans.tool_calls,
            thinking=thinking,
        ).ids
        return ids if finished else ids[:-1]  # unfinished: no end of turn

    async def handle(self, request: web.Request, body: dict[str, Any], at: float) -> web.StreamResponse:
        model, messages = body.get("model"), body.get("messages")
        if self.served_model_name is not None and model != self.served_model_name:
            # vLLM checks the name before anything else (OpenAIServing._check_model), streamed requests included.
            key = request_key(messages if isinstance(messages, list) else [], body.get("seed"))
            attempt = self._note(key, body, dict(request.headers))[0]
            self._record(key, attempt, at, None, 404)
            error = {"message": f"The model `{model}` does not exist.", "type": "NotFoundError", "param": "model"}
            return web.json_response({"error": {**error, "code": 404}}, status=404)
        if not isinstance(messages, list) or not messages:
            return web.json_response(
                {"error": {"message": "messages required", "type": "BadRequestError", "param": None, "code": 400}},
                status=400,
            )
        problem = tool_history_problem(messages)
        if problem:
            return web.json_response(
                {"error": {"message": problem, "type": "BadRequestError", "param": None, "code": 400}}, status=400
            )
        seed = body.get("seed")
        key = request_key(messages, seed)
        attempt, n_seen = self._note(key, body, dict(request.headers))
        fault = self.plan.status_fault(key, attempt, n_seen)
        streaming = body.get("stream") is True
        if fault in STREAM_FAULTS and not streaming:
            fault = None
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        ok = lambda: json.dumps(self.answer(body)).encode()  # noqa: E731
        if fault is not None and fault not in STREAM_FAULTS:
            resp = await fault_response(self.plan, request, fault, ok)
            if resp is not None:
                self._record(key, attempt, at, fault, resp.status)
                return resp
        self._record(key, attempt, at, fault, 200)
        if streaming:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            chunks = completion_chunks(
                self.answer(body),
                chunk_chars=self.stream_style.chunk_chars,
                include_usage=include_usage,
                announce_content=True,  # vLLM's first delta is {"role": "assistant", "content": ""}, always
            )
            sent = await write_stream(
                request, chunks, self.stream_style, fault=fault, idle_gap_s=self.plan.timeout_sleep_s
            )
            return sent if fault is not None else await self._send_answer(request, sent, key, attempt)
        return await self._send_answer(request, web.json_response(self.answer(body)), key, attempt)

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        messages, tools, seed = body["messages"], body.get("tools"), body.get("seed")
        key = request_key(messages, seed)
        thinking = (body.get("chat_template_kwargs") or {}).get("thinking", True) is not False
        if self.prompt_blind:  # the seed's noise alone decides the answer
            ans = synthesize([], None, request_key([], seed), thinking=thinking)
        else:
            ans = synthesize(
                messages,
                tools,
                key,
                thinking=thinking,
                tool_call_rate=self.tool_call_rate,
                tool_rounds=self.tool_rounds,
            )
        q = self.plan.quality_faults(key, 0)
        count = self._count(thinking)
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        if "length" in q:
            max_tokens = max(1, count(ans.reasoning, ans.content, ans.tool_calls) // 2)
        ans, out_ids = self.generate(
            ans, thinking=thinking, max_tokens=max_tokens if isinstance(max_tokens, int) else None
        )
        p_ids = self.prompt_ids(messages, tools, thinking=thinking)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": ans.content or None,
            self.reasoning_field: ans.reasoning or None,
        }
        if ans.tool_calls:
            message["tool_calls"] = ans.tool_calls
        stop_id = out_ids[-1] if ans.finish_reason != "length" and out_ids else None
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": ans.finish_reason,
            "stop_reason": None if stop_id == self.eos_token_id else stop_id,
        }
        out: dict[str, Any] = {
            "id": f"chatcmpl-{key[:16]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.served_model_name or body.get("model") or "simulated",
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(p_ids),
                "completion_tokens": len(out_ids),
                "total_tokens": len(p_ids) + len(out_ids),
                "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens(out_ids, thinking=thinking)},
            },
        }
        if self.supports_token_ids and body.get("return_token_ids"):
            out["prompt_token_ids"] = p_ids
            choice["token_ids"] = out_ids
        return out

    def reasoning_tokens(self, out_ids: list[int], *, thinking: bool) -> int:
        """vLLM's count (BaseThinkingReasoningParser.count_reasoning_tokens): the ids after the first think-open (or
        from the start when thinking is on and none was generated) up to the first think-close (or the end)."""
        if self.think_start_id in out_ids:
            start = out_ids.index(self.think_start_id) + 1
        elif thinking:
            start = 0
        else:
            return 0
        end = out_ids.index(self.think_end_id) if self.think_end_id in out_ids else len(out_ids)
        return max(0, end - start)
