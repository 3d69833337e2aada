"""The vLLM engine as the configuration sets it up: the `vllm serve` command for extraction (one source for the CLI,
the docs and deploy/k8s), the endpoints (a loopback double for `simulated`), and the engine (`VLLMEngine`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle_pipeline.hidden_states.engines.engine import EngineResult, ExtractionPaths, RunFacts, ShardJob
from eagle_pipeline.hidden_states.engines.vllm.engine_vllm import EngineModel, extract_shard_vllm, left_out_rows
from eagle_pipeline.hidden_states.engines.vllm.vllm_files import SIMULATED, vllm_layer_ids
from eagle_pipeline.hidden_states.engines.vllm.vllm_served import MAX_MODEL_LEN_KEY
from eagle_pipeline.hidden_states.models.layers import resolve_aux_layers

if TYPE_CHECKING:
    from eagle_pipeline.hidden_states.settings import HiddenStatesConfig

# The vLLM release the command's flags and environment are written for (docs/hidden_states.md §10: why each flag).
PINNED_VLLM_VERSION = "0.32.0"
# Model-Optimizer's Kimi-K2.5 recipe: cold MoE kernels stall the first steps past vLLM's default timeouts. Its
# VLLM_ENGINE_ITERATION_TIMEOUT_S is not read by vLLM 0.32 (not in vllm/envs.py: "Unknown vLLM environment variable
# detected" at start, then ignored), so only the execute-model RPC timeout is set.
COLD_START_ENV = {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1200"}
_DEEPSEEK_BACKBONE = {"deepseek_v3", "deepseek_v2", "kimi_k2", "kite_text"}


@dataclass(frozen=True)
class ServeCommand:
    """`vllm serve` for extraction: the environment and the argument vector (one source for the CLI and deploy/)."""

    env: dict[str, str]
    argv: list[str]
    comments: tuple[str, ...] = ()  # printed first as `# ...` lines: the command stays pasteable

    def shell(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        args = " \\\n  ".join(_pairs(self.argv))
        head = "".join(f"# {c}\n" for c in self.comments)
        return head + (f"{env} \\\n{args}" if env else args)


def _pairs(argv: list[str]) -> list[str]:
    """Shell-quoted lines: `vllm serve MODEL` on the first, then each `--flag [value]` on its own."""
    import shlex

    out: list[str] = [" ".join(shlex.quote(a) for a in argv[:3])]
    for a in argv[3:]:
        if a.startswith("--"):
            out.append(a)
        else:
            out[-1] += " " + shlex.quote(a)
    return out


def vllm_serve_command(
    served_model: str,
    *,
    layer_ids: Sequence[int],
    storage_path: str,
    tensor_parallel_size: int = 8,
    port: int = 8000,
    model_type: str = "",
    max_model_len: int | None = None,
) -> ServeCommand:
    """The exact server command for vLLM `PINNED_VLLM_VERSION`: the extract_hidden_states speculative config with
    `layer_ids`, the connector writing to `storage_path`, prefix caching off (short states otherwise), remote code
    on, `--max-model-len` when given, and, for the DeepSeek/Kimi backbone, Model-Optimizer's cold-start knobs.
    Chunked prefill keeps 0.32's default (on): its connector fills the file from the KV cache once the whole prompt
    is in, and 0.32 warns that turning it off may crash the engine or give incorrect outputs."""
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [int(k) for k in layer_ids]}},
    }
    kv = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": storage_path},
    }
    argv = [
        "vllm",
        "serve",
        served_model,
        "--tensor-parallel-size",
        str(tensor_parallel_size),
        "--port",
        str(port),
        "--trust-remote-code",
        "--speculative-config",
        json.dumps(spec),
        "--kv-transfer-config",
        json.dumps(kv),
        "--no-enable-prefix-caching",
    ]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    deepseek = model_type in _DEEPSEEK_BACKBONE
    if deepseek:
        argv += ["--enforce-eager", "--no-enable-flashinfer-autotune"]
    return ServeCommand(env=dict(COLD_START_ENV) if deepseek else {}, argv=argv)


def serve_command_from_config(
    h: HiddenStatesConfig,
    *,
    served_model: str | None,
    vocab_size: int,
    tensor_parallel_size: int = 8,
    port: int = 8000,
    served_config: str | None = None,
) -> ServeCommand:
    """`vllm_serve_command` for the `hidden_states` config section: the layer ids of the model the server loads
    (`vllm_served.served_model`: its config.json), which must be the extraction model (`hidden_states.model`, else
    refused naming the key), the aux layers, the storage path and `--max-model-len`. Its comments name the vLLM
    version, the served model, its layer count and where its shape was read."""
    from eagle_pipeline.hidden_states.engines.vllm.vllm_served import check_same_model, server_max_model_len
    from eagle_pipeline.hidden_states.engines.vllm.vllm_served import served_model as find_served
    from eagle_pipeline.hidden_states.models.model import TINY_RANDOM

    model = served_model or (h.model if h.model != TINY_RANDOM else None)
    if model is None:
        raise ValueError("hidden_states.model is tiny-random: name the model the server loads (--served-model)")
    served = find_served(h, served_model=served_model, served_config=served_config, vocab_size=vocab_size)
    check_same_model(h, served, describe_engine_model(h.model, family=h.family, vocab_size=vocab_size))
    desc = served.description
    n_layers = int(desc["num_layers"])
    aux = resolve_aux_layers(h.aux_layers, n_layers)
    ids = vllm_layer_ids(aux, n_layers)
    max_len = server_max_model_len(h, served)
    command = vllm_serve_command(
        model,
        layer_ids=ids,
        storage_path=h.vllm.storage_path,
        tensor_parallel_size=tensor_parallel_size,
        port=port,
        model_type=str(desc["model_type"]),
        max_model_len=max_len,
    )
    comments = (
        f"vLLM {PINNED_VLLM_VERSION} (the flags and environment below are for this release; check a server with "
        "`eagle-pipeline vllm-smoke`)",
        f"serves {model}: {served.shape()}, {desc['model_type']} (shape read from {served.source})",
        f"layer ids {list(ids)}: aux layers {list(aux)} + 1, and the final id {n_layers} (pre-norm)",
        f"rows of up to {max_len - 1} tokens (--max-model-len {max_len}; one output token is asked for)"
        if max_len is not None
        else "no --max-model-len: the served config has no max_position_embeddings (hidden_states.vllm.max_model_len)",
    )
    return ServeCommand(command.env, command.argv, comments)


@contextlib.contextmanager
def resolved_endpoints(
    endpoints: Sequence[str],
    *,
    storage_path: str | Path,
    model: str,
    family: str,
    seed: int,
    vocab_size: int,
    layer_ids: Sequence[int],
    max_model_len: int | None = None,
) -> Iterator[list[str]]:
    """`endpoints` with `simulated` replaced by a loopback double of the vLLM server (the demo and tests) serving
    the tiny model `hidden_states.model: tiny-random` would build in process, started with `max_model_len` (None:
    the model's max_position_embeddings, as vLLM)."""
    if SIMULATED not in endpoints:
        yield list(endpoints)
        return
    from eagle_pipeline.hidden_states.engines.runtime import load_extraction_model
    from eagle_pipeline.hidden_states.models.model import TINY_RANDOM
    from eagle_pipeline.simulation.vllm_hidden_states import VLLMHiddenStatesDouble

    if model != TINY_RANDOM:
        raise ValueError(f"hidden_states.vllm.endpoints: 'simulated' serves tiny-random only, model is {model!r}")
    tiny = load_extraction_model(model, family=family, seed=seed, vocab_size=vocab_size, device="cpu")
    with VLLMHiddenStatesDouble(
        tiny, layer_ids=layer_ids, storage_path=storage_path, max_model_len=max_model_len
    ) as double:
        yield [double.url if e == SIMULATED else e for e in endpoints]


def describe_engine_model(model: str, *, family: str, vocab_size: int) -> dict[str, Any]:
    """Shape of the model the servers run, from its config only (no weights): `tiny-random` or a directory (or
    config.json) of the target."""
    from eagle_pipeline.hidden_states.models.model import (
        TINY_RANDOM,
        describe_model_config,
        load_text_config,
        tiny_config,
    )

    if model == TINY_RANDOM:
        return describe_model_config(tiny_config(vocab_size, family=family))
    return describe_model_config(load_text_config(model))


class VLLMEngine:
    """`hidden_states.engine: vllm` (the `ShardEngine` interface): shard runs are HTTP clients of the running
    servers `hidden_states.vllm.endpoints` names, never model loads. `model`: the model the servers run when it is
    not the one `hidden_states.model` names (a test's server double of a model in memory); `backoff_base_s`: the
    first retry's wait, doubled per retry."""

    def __init__(self, model: EngineModel | None = None, *, backoff_base_s: float = 2.0):
        self.model = model
        self.backoff_base_s = backoff_base_s

    def facts(self, settings: HiddenStatesConfig, paths: ExtractionPaths, shard: int, vocab_size: int) -> RunFacts:
        """The servers' `max_model_len` (GET /v1/models; for `simulated`, the limit the double is started with) and,
        under `too_long_rows: drop`, the shard's rows at or over it: what the shard leaves out."""
        # The shape only: the checkpoint (for tiny-random, a model saved to disk) is the extraction's business.
        if self.model is not None:
            identity, num_layers = self.model.identity, self.model.num_layers
        else:
            desc = describe_engine_model(settings.model, family=settings.family, vocab_size=vocab_size)
            identity, num_layers = None, int(desc["num_layers"])
        limit = _served_limit(settings, vocab_size)
        drop = settings.vllm.too_long_rows == "drop"
        return RunFacts(
            model_identity=identity,
            num_layers=num_layers,
            left_out=left_out_rows(paths.merged_dir, shard, settings.shard_size, limit) if drop else (),
            max_model_len=limit,
        )

    def extract(self, job: ShardJob) -> EngineResult:
        """Where it ran: the endpoints. The target head is read from the model's checkpoint (for `tiny-random`, the
        seeded model the double serves, saved once beside the shards)."""
        h, v = job.settings, job.settings.vllm
        model = self._model(h, job.paths, job.vocab_size)
        ids = vllm_layer_ids(tuple(job.wanted.aux_layers), model.num_layers)
        with resolved_endpoints(
            v.endpoints,
            storage_path=v.storage_path,
            model=h.model,
            family=h.family,
            seed=h.seed,
            vocab_size=job.vocab_size,
            layer_ids=ids,
            max_model_len=job.facts.max_model_len,
        ) as endpoints:
            summary = extract_shard_vllm(job, model, endpoints, backoff_base_s=self.backoff_base_s)
        return EngineResult(summary, "vllm: " + ", ".join(v.endpoints))

    def _model(self, h: HiddenStatesConfig, paths: ExtractionPaths, vocab_size: int) -> EngineModel:
        if self.model is not None:
            return self.model
        from eagle_pipeline.hidden_states.engines.runtime import materialized_model_dir

        desc = describe_engine_model(h.model, family=h.family, vocab_size=vocab_size)
        checkpoint = materialized_model_dir(
            h.model, family=h.family, seed=h.seed, vocab_size=vocab_size, cache_dir=paths.cache_dir
        )
        return EngineModel(desc, checkpoint)


def _served_limit(h: HiddenStatesConfig, vocab_size: int) -> int:
    """The smallest `max_model_len` of the endpoints: each real one's answer to GET /v1/models, and for `simulated`
    the limit `resolved_endpoints` starts the double with (`vllm_served.server_max_model_len`)."""
    from eagle_pipeline.hidden_states.engines.vllm.vllm_served import (
        endpoints_max_model_len,
        served_model,
        server_max_model_len,
    )

    v = h.vllm
    limits = []
    real = [e for e in v.endpoints if e != SIMULATED]
    if real:
        limits.append(endpoints_max_model_len(real, timeout_s=v.timeout_s))
    if SIMULATED in v.endpoints:
        served = served_model(h, served_model=None, served_config=None, vocab_size=vocab_size, simulated=True)
        limit = server_max_model_len(h, served)
        if limit is None:
            raise ValueError(f"the simulated server's model has no max_position_embeddings; set {MAX_MODEL_LEN_KEY}")
        limits.append(limit)
    return min(limits)
