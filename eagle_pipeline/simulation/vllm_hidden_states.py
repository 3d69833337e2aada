"""A loopback double of vLLM's `extract_hidden_states` server, computing real states from a transformers model.

It answers as `vllm serve --speculative-config '{"method": "extract_hidden_states", ...}' --kv-transfer-config
'{"kv_connector": "ExampleHiddenStatesConnector", ...}'` does (docs/hidden_states.md §10):

* `POST /v1/completions` with `prompt` = token ids: one forward of the prompt, the next token from the lm_head,
  `choices[0].prompt_token_ids` (with `return_token_ids`) and a top-level `kv_transfer_params.hidden_states_path`;
* `GET /v1/models` (vLLM's model card, with `max_model_len`), `GET /version`, `GET /health` (the readiness probe);
* vLLM 0.32's refusals, with its error body `{"error": {"message", "type", "param", "code"}}`: 404 for a `model`
  other than the served name, 400 for a prompt of `max_model_len` tokens or more (at exactly the limit no output
  token is left: "max_tokens must be at least 1, got 0"; over it: "maximum context length");
* the connector's file `{storage_path}/{request id}.safetensors` with `hidden_states` [T, n_ids, H] in the model's
  dtype and `token_ids` [T] int64, written by writer threads while an exclusive `flock` on `{path}.lock` is held;
  the lock is taken before the response leaves.

Layer ids are vLLM's: id k is transformers' `hidden_states[k]` (the output of decoder layer k - 1, the embeddings
for k = 0) and id L = `num_hidden_layers` is the last layer's output before the final norm (the final norm's input).
The double reads the model through transformers' own structure (`.model`, `.layers`, `.norm`), not through the
extractor's helpers in `eagle_pipeline.hidden_states`: as vLLM runs its own model code, a bug in those helpers then
shows as a difference between the two paths instead of being mirrored (and the hidden-states domain, which starts this
double for `endpoints: [simulated]`, is not imported back).

Faults (`faults`: a name maps to a rate in [0, 1], chosen per prompt by hash, or `select: {name: [keys]}` with keys
from `ids_key`). Transient ones hit the first `fail_first_n_attempts` attempts of a prompt (default 1):
`http_500`, `http_503`, `timeout` (sleeps `timeout_sleep_s`), `lock_never_released` (the file is written, its
lock is never let go). The field's silent bugs hit every attempt: `final_layer_missing` (id L dropped: the
DeepSeek-V2-backbone bug fixed by vLLM PR #46973), `zero_states` (one layer all zero), `nan_states`,
`short_states` (the first `block_size` positions missing, as under prefix caching), `prompt_ids_mismatch` (a BOS
the client did not send, in the response and the file), `no_kv_transfer_params` (a server started without the
connector: `kv_transfer_params: null`, as vLLM 0.32 answers then), `late_file` (the lock is let go at once and the
file appears `late_file_s` later).
`die_after_requests: N` makes the server exit when request N + 1 arrives: connections are refused afterwards.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from safetensors.torch import save_file

from eagle_pipeline.shared.loopback_http import LoopbackHttpServer

TRANSIENT_FAULTS = ("http_500", "http_503", "timeout", "lock_never_released")
PERSISTENT_FAULTS = (
    "final_layer_missing",
    "zero_states",
    "nan_states",
    "short_states",
    "prompt_ids_mismatch",
    "no_kv_transfer_params",
    "late_file",
)
ALL_FAULTS = TRANSIENT_FAULTS + PERSISTENT_FAULTS
_OPTIONS = ("select", "fail_first_n_attempts", "timeout_sleep_s", "late_file_s", "block_size", "die_after_requests")
DOUBLE_VERSION = "0.32.0+eagle-double"  # the vLLM release it answers as (vllm_command.PINNED_VLLM_VERSION)
BOS_ID = 1


def ids_key(ids: Sequence[int]) -> str:
    """The key the double files a prompt under (for `faults.select`)."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:24]


def _unit(fault: str, key: str) -> float:
    return int.from_bytes(hashlib.sha256(f"{fault}|{key}".encode()).digest()[:8], "big") / 2**64


class _Faults:
    def __init__(self, faults: dict[str, Any] | None) -> None:
        faults = dict(faults or {})
        unknown = set(faults) - set(ALL_FAULTS) - set(_OPTIONS)
        if unknown:
            raise ValueError(f"unknown fault settings {sorted(unknown)}; known: {list(ALL_FAULTS) + list(_OPTIONS)}")
        self.rates = {k: float(faults[k]) for k in ALL_FAULTS if k in faults}
        self.select = {k: set(v) for k, v in (faults.get("select") or {}).items()}
        if set(self.select) - set(ALL_FAULTS):
            raise ValueError(f"unknown faults in select: {sorted(set(self.select) - set(ALL_FAULTS))}")
        self.fail_first_n = int(faults.get("fail_first_n_attempts", 1))
        self.timeout_sleep_s = float(faults.get("timeout_sleep_s", 3600.0))
        self.late_file_s = float(faults.get("late_file_s", 0.3))
        self.block_size = int(faults.get("block_size", 16))
        die = faults.get("die_after_requests")
        self.die_after = int(die) if die is not None else None

    def hits(self, key: str, attempt: int) -> set[str]:
        def hit(f: str) -> bool:
            rate = self.rates.get(f, 0.0)
            return key in self.select.get(f, ()) or (rate > 0 and _unit(f, key) < rate)

        found = {f for f in PERSISTENT_FAULTS if hit(f)}
        if attempt <= self.fail_first_n:
            found |= {f for f in TRANSIENT_FAULTS if hit(f)}
        return found


class VLLMHiddenStatesDouble(LoopbackHttpServer):
    """The double, on 127.0.0.1 in a background thread (`loopback_http`); a context manager. `url` is the base URL
    to configure; requests are counted per prompt key (`ids_key`).

    `layer_ids` are vLLM ids (what `eagle_aux_hidden_state_layer_ids` would hold). The forward runs on one
    worker thread (the server's one "GPU"), the file writes on `num_writer_threads` others, as the connector does.
    """

    client_max_size = 256 * 1024 * 1024  # prompts of token ids, the longest rows several MB of JSON

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        layer_ids: Sequence[int],
        storage_path: str | os.PathLike,
        served_model_name: str = "tiny-random",
        faults: dict[str, Any] | None = None,
        latency_s: float = 0.0,
        num_writer_threads: int = 2,
        port: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        super().__init__(port=port)
        self.model = model.eval()
        backbone: Any = getattr(model, "model", model)  # a *ForCausalLM's decoder stack; a bare base model is its own
        self.backbone = backbone
        self.num_layers = len(backbone.layers)
        bad = [k for k in layer_ids if not 0 <= int(k) <= self.num_layers]
        if bad or not layer_ids:
            raise ValueError(f"layer ids {list(layer_ids)} out of range [0, {self.num_layers}] for this model")
        self.layer_ids = tuple(int(k) for k in layer_ids)
        self.storage_path = Path(storage_path)
        self.storage_path.mkdir(parents=True, exist_ok=True)
        self.served_model_name = served_model_name
        # vLLM's default: the model's max_position_embeddings (`--max-model-len` sets it)
        self.max_model_len = int(max_model_len or getattr(model.config, "max_position_embeddings", 0) or 2**31 - 1)
        self.faults = _Faults(faults)
        self.latency_s = float(latency_s)
        self.vocab_size = int(backbone.embed_tokens.num_embeddings)
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="double-gpu")
        self._writers = ThreadPoolExecutor(num_writer_threads, thread_name_prefix="double-writer")
        self._stuck_locks: list[Any] = []  # lock files a `lock_never_released` fault keeps locked
        self._in_flight = 0
        self.max_in_flight = 0  # the most /v1/completions requests it served at once
        self.compute_seconds = 0.0  # time spent in forwards (the server's own compute, for benchmarks)
        self.died = False

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/version", self._version)
        app.router.add_get("/health", self._health)

    def stop(self) -> None:
        """Stop serving, then let the writer threads finish and release the locks a fault kept."""
        super().stop()
        self._writers.shutdown(wait=True)
        self._compute.shutdown(wait=True)
        for fh in self._stuck_locks:
            fh.close()
        self._stuck_locks.clear()

    # ---- handlers --------------------------------------------------------------------------------------------
    async def _version(self, _request: web.Request) -> web.Response:
        return web.json_response({"version": DOUBLE_VERSION})

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.served_model_name,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "vllm",
                        "root": self.served_model_name,
                        "parent": None,
                        "max_model_len": self.max_model_len,
                        "permission": [_model_permission()],
                    }
                ],
            }
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            return await self._complete(request)
        finally:
            with self._lock:
                self._in_flight -= 1

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except ValueError as exc:
            return _error(400, f"invalid JSON body: {exc}")
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(prompt, list) or not prompt or not all(isinstance(x, int) for x in prompt):
            return _error(400, "prompt must be a non-empty list of token ids")
        model = body.get("model")
        if model and model != self.served_model_name:  # vLLM checks the name first
            message = f"The model `{model}` does not exist. Valid aliases: {self.served_model_name}."
            return _error(404, message, "NotFoundError", param="model")
        if any(not 0 <= x < self.vocab_size for x in prompt):
            return _error(400, f"token id out of vocabulary [0, {self.vocab_size})")
        refused = self._length_refusal(len(prompt), body.get("max_tokens"))
        if refused is not None:
            return refused
        key = ids_key(prompt)
        with self._lock:
            attempt, n_seen = self._count_locked(key)
        f = self.faults
        if f.die_after is not None and n_seen > f.die_after:
            self.died = True
            if request.transport is not None:
                request.transport.close()
            asyncio.get_running_loop().call_soon(asyncio.get_running_loop().stop)
            return web.Response(status=500)  # never delivered: the transport is gone
        hits = f.hits(key, attempt)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if "timeout" in hits:
            await asyncio.sleep(f.timeout_sleep_s)
        if "http_500" in hits:
            return _error(500, "Internal Server Error", "InternalServerError")
        if "http_503" in hits:
            return _error(503, "Service Unavailable", "ServiceUnavailableError")
        ids = ([BOS_ID] if "prompt_ids_mismatch" in hits else []) + list(prompt)
        loop = asyncio.get_running_loop()
        states, next_id = await loop.run_in_executor(self._compute, self._forward, ids)
        request_id = f"cmpl-{uuid.uuid4().hex}-0"
        out: dict[str, Any] = {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or self.served_model_name,
            "choices": [
                {
                    "index": 0,
                    "text": "",
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                    "prompt_logprobs": None,
                }
            ],
            "usage": {"prompt_tokens": len(ids), "total_tokens": len(ids) + 1, "completion_tokens": 1},
            "kv_transfer_params": None,  # what vLLM sends without a connector (the `no_kv_transfer_params` fault)
        }
        if body.get("return_token_ids"):
            out["choices"][0]["prompt_token_ids"] = ids
            out["choices"][0]["token_ids"] = [next_id]
        if "no_kv_transfer_params" not in hits:
            path = self.storage_path / f"{request_id}.safetensors"
            states, token_ids = self._corrupt(states, torch.tensor(ids, dtype=torch.int64), hits)
            lock: Any = open(f"{path}.lock", "w")  # noqa: SIM115 (released by the writer thread)
            fcntl.flock(lock, fcntl.LOCK_EX)
            if "late_file" in hits:
                fcntl.flock(lock, fcntl.LOCK_UN)
                lock.close()
                lock = None
            self._writers.submit(self._write, path, states, token_ids, lock, hits)
            out["kv_transfer_params"] = {"hidden_states_path": str(path)}
        return web.json_response(out)

    def _length_refusal(self, n: int, max_tokens: Any) -> web.Response | None:
        """vLLM 0.32's two length errors: a prompt over max_model_len, and no room left for one output token (the
        output budget is min(max_tokens, max_model_len - prompt), which must be at least 1)."""
        limit = self.max_model_len
        if n > limit:
            message = (
                f"This model's maximum context length is {limit} tokens. However, your prompt contains {n} input "
                "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the "
                f"input prompt. (parameter=input_tokens, value={n})"
            )
            return _error(400, message, param="input_tokens")
        budget = limit - n if max_tokens is None else min(int(max_tokens), limit - n)
        if budget < 1:
            message = f"max_tokens must be at least 1, got {budget}. (parameter=max_tokens, value={budget})"
            return _error(400, message, param="max_tokens")
        return None

    # ---- compute and files -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def _forward(self, ids: list[int]) -> tuple[torch.Tensor, int]:
        t0 = time.perf_counter()
        try:
            return self._states(ids)
        finally:
            self.compute_seconds += time.perf_counter() - t0

    def _states(self, ids: list[int]) -> tuple[torch.Tensor, int]:
        captured: dict[str, torch.Tensor] = {}
        me = threading.get_ident()

        def keep(_m: Any, args: tuple[Any, ...]) -> None:
            # The final norm's input: the last decoder layer's output. Only this thread's forward: doubles serving one
            # model object (tests) run forwards concurrently, and a hook fires for every forward, whoever registered it.
            if threading.get_ident() == me:
                captured["pre_norm"] = args[0]

        handle = self.backbone.norm.register_forward_pre_hook(keep)
        try:
            x = torch.tensor([ids], device=next(self.model.parameters()).device)
            out = self.backbone(input_ids=x, output_hidden_states=True, use_cache=False)
        finally:
            handle.remove()
        hs = out.hidden_states
        per_id = [captured["pre_norm"][0] if k == self.num_layers else hs[k][0] for k in self.layer_ids]
        states = torch.stack(per_id, dim=1).cpu()  # [T, n_ids, H]
        head = getattr(self.model, "lm_head", None)
        next_id = int(head(out.last_hidden_state[0, -1]).argmax()) if head is not None else 0
        return states, next_id

    def _corrupt(self, states: torch.Tensor, token_ids: torch.Tensor, hits: set[str]):
        if "final_layer_missing" in hits and self.num_layers in self.layer_ids:
            keep = [i for i, k in enumerate(self.layer_ids) if k != self.num_layers]
            states = states[:, keep]
        if "zero_states" in hits:
            states = states.clone()
            states[:, 0] = 0
        if "nan_states" in hits:
            states = states.clone()
            states[len(states) // 2, -1, 0] = float("nan")
        if "short_states" in hits and len(states) > 1:
            cut = min(self.faults.block_size, len(states) - 1)
            states, token_ids = states[cut:], token_ids[cut:]
        return states.contiguous(), token_ids.contiguous()

    def _write(self, path: Path, states: torch.Tensor, token_ids: torch.Tensor, lock: Any, hits: set[str]) -> None:
        try:
            if "late_file" in hits:
                time.sleep(self.faults.late_file_s)
                tmp = path.with_name(path.name + ".writing")
                save_file({"hidden_states": states, "token_ids": token_ids}, str(tmp))
                os.replace(tmp, path)
            else:
                save_file({"hidden_states": states, "token_ids": token_ids}, str(path))
        finally:
            if lock is not None:
                if "lock_never_released" in hits:
                    self._stuck_locks.append(lock)
                else:
                    fcntl.flock(lock, fcntl.LOCK_UN)
                    lock.close()


def _error(status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status=status
    )


def _model_permission() -> dict[str, Any]:
    """vLLM's ModelPermission, as each model card lists it."""
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": int(time.time()),
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
