"""The SGLang double: the native POST /generate with `input_ids` in, `output_ids` + `meta_info` out."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from eagle_pipeline.simulation.answers import ids_key, synthesize
from eagle_pipeline.simulation.faults import fault_response
from eagle_pipeline_tests.doubles.id_server import IdServer


class SimulatedSGLangServer(IdServer):
    """SGLang's native POST /generate: `input_ids` in, `output_ids` + `meta_info` out.

    Rejects requests without `input_ids` or without `sampling_params.max_new_tokens` (SGLang's default is 128,
    which silently truncates reasoning; the double makes forgetting it loud). `decode` (optional) lets answers
    quote the prompt; text markers are used in `text` when special tokens are not skipped.
    """

    routes = ("/generate",)

    def __init__(
        self,
        *,
        decode: Callable[[list[int]], str] | None = None,
        think_start_text: str = "<think>",
        think_end_text: str = "</think>",
        eos_text: str = "<|im_end|>",
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self.decode = decode
        self.think_start_text, self.think_end_text, self.eos_text = think_start_text, think_end_text, eos_text

    async def handle(self, request: web.Request, body: dict[str, Any], at: float) -> web.StreamResponse:
        input_ids = body.get("input_ids")
        sp = body["sampling_params"] if isinstance(body.get("sampling_params"), dict) else {}
        if not isinstance(input_ids, list) or not input_ids or not all(isinstance(x, int) for x in input_ids):
            return web.json_response({"error": {"message": "input_ids (list[int]) is required"}}, status=400)
        if not isinstance(sp.get("max_new_tokens"), int):
            return web.json_response(
                {"error": {"message": "sampling_params.max_new_tokens must be set explicitly"}}, status=400
            )
        key = ids_key(input_ids, sp.get("sampling_seed"))
        attempt, n_seen = self._note(key, body, dict(request.headers))
        fault = self.plan.status_fault(key, attempt, n_seen)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        ok = lambda: json.dumps(self.answer(body)).encode()  # noqa: E731
        if fault is not None and fault not in ("no_choices", "error_200"):
            resp = await fault_response(self.plan, request, fault, ok)
            if resp is not None:
                self._record(key, attempt, at, fault, resp.status)
                return resp
        if fault == "error_200":
            self._record(key, attempt, at, fault, 200)
            out = self.answer(body)
            out["meta_info"]["finish_reason"] = {"type": "abort", "message": "simulated abort"}
            return web.json_response(out)
        self._record(key, attempt, at, fault, 200)
        return await self._send_answer(request, web.json_response(self.answer(body)), key, attempt)

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        input_ids = body["input_ids"]
        sp = body.get("sampling_params") or {}
        key = ids_key(input_ids, sp.get("sampling_seed"))
        prompt_text = self.decode(input_ids) if self.decode else ""
        ans = synthesize([{"role": "user", "content": prompt_text}], None, key, thinking=True)
        count = self._count(True)
        max_new = int(sp["max_new_tokens"])
        if "length" in self.plan.quality_faults(key, 0):
            max_new = max(1, min(max_new, count(ans.reasoning, ans.content, []) // 2))
        ans, out_ids = self.generate(ans, thinking=True, max_tokens=max_new)
        finished = ans.finish_reason != "length"
        if finished:
            text = f"{self.think_start_text}{ans.reasoning}{self.think_end_text}{ans.content}"
            if not sp.get("skip_special_tokens", True) and sp.get("no_stop_trim", False):
                text += self.eos_text
        else:
            text = f"{self.think_start_text}{ans.reasoning}" + (
                f"{self.think_end_text}{ans.content}" if ans.content else ""
            )
        fr = {"type": "stop", "matched": self.eos_id} if finished else {"type": "length", "length": len(out_ids)}
        rid = body.get("rid") or key
        return {
            "text": text,
            "output_ids": out_ids,
            "meta_info": {
                "id": rid,
                "finish_reason": fr,
                "prompt_tokens": len(input_ids),
                "completion_tokens": len(out_ids),
                "cached_tokens": 0,
                "e2e_latency": self.latency_s,
            },
        }
