"""The model a vLLM extraction server loads, read from its config.json and checked against the extraction model
(`vllm-command`, `vllm-smoke`), and the server's length limit read before a shard starts (the length pre-flight).

Layer ids computed from one model and sent to a server running another return states of the wrong layers with the
right shapes: nothing downstream can tell. So the ids always come from the served model's own config.json, and a
configuration whose extraction model (`hidden_states.model`: the shard runs' config, final norm and lm_head)
differs from it is refused, naming the key to set.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle_pipeline.hidden_states.engines.vllm.vllm_files import EngineShardError
from eagle_pipeline.hidden_states.store.merged import MergedRows

SERVED_CONFIG_KEY = "hidden_states.vllm.served_model_config"
MAX_MODEL_LEN_KEY = "hidden_states.vllm.max_model_len"
TOO_LONG_ROWS_KEY = "hidden_states.vllm.too_long_rows"
MAX_NAMED_ROWS = 10  # rows named in a refusal (all are counted)


@dataclass(frozen=True)
class ServedModel:
    """What `vllm serve` loads: its name (None when unknown, e.g. to vllm-smoke), where its shape was read, the
    shape (`model.describe_model_config`) and its config's `max_position_embeddings` (None when absent)."""

    name: str | None
    source: str
    description: dict[str, Any]
    max_position_embeddings: int | None

    @property
    def label(self) -> str:
        return self.name or self.source

    def shape(self) -> str:
        d = self.description
        return f"{d['num_layers']} layers, H {d['hidden_size']}"


def _config_file(path: str | Path) -> Path | None:
    p = Path(path)
    if p.is_dir() and (p / "config.json").is_file():
        return p / "config.json"
    return p if p.is_file() else None


def _from_config(name: str | None, config_path: Path) -> ServedModel:
    from eagle_pipeline.hidden_states.models.model import describe_model_config, load_text_config

    cfg = load_text_config(config_path)
    mpe = cfg.get("max_position_embeddings")
    return ServedModel(name, str(config_path), describe_model_config(cfg), int(mpe) if mpe else None)


def served_model(
    h: Any, *, served_model: str | None, served_config: str | None, vocab_size: int, simulated: bool = False
) -> ServedModel:
    """The model the server loads (`h` is the `hidden_states` section). Its config.json is, in order: `served_config`
    (`--served-model-config`), `hidden_states.vllm.served_model_config`, `served_model` itself when it is a local
    directory or config.json, `hidden_states.model` when no served model is named (the server loads it), the tiny
    model for the simulated double. A hub id alone cannot be read offline: refused, saying what to give."""
    from eagle_pipeline.hidden_states.models.model import TINY_RANDOM

    explicit = served_config or h.vllm.served_model_config
    if explicit:
        found = _config_file(explicit)
        if found is None:
            raise FileNotFoundError(f"{explicit}: no config.json there (the served model's, {SERVED_CONFIG_KEY})")
        return _from_config(served_model, found)
    if served_model is not None:
        found = _config_file(served_model)
        if found is not None:
            return _from_config(served_model, found)
    elif h.model != TINY_RANDOM:
        return _from_config(h.model, Path(h.model) / "config.json" if Path(h.model).is_dir() else Path(h.model))
    elif simulated:
        from eagle_pipeline.hidden_states.models.model import describe_model_config, tiny_config

        cfg = tiny_config(vocab_size, family=h.family)
        desc = describe_model_config(cfg)
        return ServedModel(TINY_RANDOM, "tiny-random (the simulated server)", desc, cfg.max_position_embeddings)
    what = f"the served model {served_model!r}" if served_model else "the model the server loads"
    raise ValueError(
        f"cannot read the config.json of {what} (hidden_states.model is {h.model!r}; nothing is fetched from a hub): "
        f"pass --served-model-config PATH (its config.json or a local snapshot) or set {SERVED_CONFIG_KEY}"
    )


def check_same_model(h: Any, served: ServedModel, extraction: dict[str, Any]) -> None:
    """Refuse when the extraction model (`hidden_states.model`, described by `extraction`) and the served model
    differ in layer count or hidden size: layer ids and every shard check would follow the wrong model."""
    a, b = extraction, served.description
    if (a["num_layers"], a["hidden_size"]) == (b["num_layers"], b["hidden_size"]):
        return
    raise ValueError(
        f"hidden_states.model is {h.model!r} ({a['num_layers']} layers, H {a['hidden_size']}) but the server loads "
        f"{served.label} ({served.shape()}, from {served.source}): layer ids for one model sent to a server of the "
        "other give states of the wrong layers. Set hidden_states.model to the served model's checkpoint directory "
        "(the shard runs read its config.json, final norm and lm_head)"
    )


def server_max_model_len(h: Any, served: ServedModel) -> int | None:
    """The `--max-model-len` to start the server with: `hidden_states.vllm.max_model_len`, else the served model's
    `max_position_embeddings` (vLLM's own default); refused above the latter (vLLM would not start)."""
    setting, mpe = h.vllm.max_model_len, served.max_position_embeddings
    if setting is not None and mpe is not None and setting > mpe:
        raise ValueError(
            f"{MAX_MODEL_LEN_KEY} {setting} is over the served model's max_position_embeddings {mpe} "
            f"({served.source}): vLLM refuses to start with it"
        )
    return setting if setting is not None else mpe


def fetch_server_version(endpoint: str, *, timeout_s: float) -> str:
    """The version a vLLM server reports on `GET /version`."""
    with urllib.request.urlopen(endpoint.rstrip("/") + "/version", timeout=timeout_s) as r:
        return str(json.loads(r.read()).get("version"))


# ---- the length pre-flight -------------------------------------------------------------------------------------


def fetch_max_model_len(endpoint: str, *, timeout_s: float) -> int:
    """The `max_model_len` a vLLM server reports on `GET /v1/models` (one per served name, all equal)."""
    url = endpoint.rstrip("/") + "/v1/models"
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        body = json.loads(r.read())
    cards = [card for card in body.get("data") or [] if isinstance(card, dict)]
    lens = {int(card["max_model_len"]) for card in cards if card.get("max_model_len") is not None}
    if len(lens) != 1:
        raise ValueError(f"GET {url}: expected one max_model_len in data[], got {sorted(lens) or 'none'}")
    return lens.pop()


def endpoints_max_model_len(
    endpoints: Sequence[str], *, timeout_s: float, log: Callable[[str], None] | None = None
) -> int:
    """The smallest `max_model_len` of the endpoints that answer (a row must fit every server that may take it);
    an endpoint that does not answer is left to the shard's retries; none answering stops the shard."""
    found: list[int] = []
    problems: list[str] = []
    for e in endpoints:
        try:
            found.append(fetch_max_model_len(e, timeout_s=min(timeout_s, 60.0)))
        except (OSError, ValueError, urllib.error.URLError) as exc:
            problems.append(f"{e}: {type(exc).__name__}: {exc}")
            if log is not None:
                log(f"warning: length pre-flight: {e} did not answer GET /v1/models ({exc})")
    if not found:
        raise EngineShardError("no endpoint answered GET /v1/models (the length pre-flight): " + "; ".join(problems))
    return min(found)


def too_long(n_tokens: int, max_model_len: int) -> bool:
    """A row a server of `max_model_len` cannot extract (the request asks for one output token)."""
    return n_tokens >= max_model_len


def target_without_too_long(target: Any, merged_dir: str | Path, max_model_len: int) -> Any:
    """`target` (a `trainer_layouts.LayoutTarget`) renumbered without every merged row the servers cannot take, in
    every shard (they all apply this limit under `too_long_rows: drop`), so speculators' `hs_{i}` stay dense over
    the rows that get states whichever shard drops one (`plan_layout_target`'s `left_out`)."""
    import pyarrow.parquet as pq

    from eagle_pipeline.hidden_states.layouts.trainer_layouts import plan_layout_target
    from eagle_pipeline.hidden_states.store.merged import merged_parts

    gone: set[str] = set()
    for part in merged_parts(merged_dir):
        t = pq.read_table(part, columns=["sample_id", "n_tokens"])
        gone.update(
            s for s, n in zip(t["sample_id"].to_pylist(), t["n_tokens"].to_pylist()) if too_long(n, max_model_len)
        )
    if not gone:
        return target
    return plan_layout_target(target.name, target.root, merged_dir, left_out=gone, quantize=target.quantize)


def apply_length_limit(
    rows: MergedRows,
    max_model_len: int,
    *,
    shard_index: int,
    too_long_rows: str,
    log: Callable[[str], None] | None = None,
) -> tuple[MergedRows, list[dict[str, Any]]]:
    """Rows a server of `max_model_len` can extract: at most max_model_len - 1 tokens, because the request asks for
    one output token (a row of exactly max_model_len fails in vLLM with "max_tokens must be at least 1, got 0", a
    longer one with "maximum context length"). Over it: refused before any request, naming the rows, or, with
    `too_long_rows: drop`, left out and returned as records (row, sample_id, n_tokens, reason) for the shard's
    metadata, each logged as a warning."""
    lengths = rows.lengths
    over = [i for i, n in enumerate(lengths) if too_long(n, max_model_len)]
    if not over:
        return rows, []
    dropped = [{"row": rows.global_row(i), "sample_id": rows.sample_ids[i], "n_tokens": lengths[i]} for i in over]
    if too_long_rows != "drop":
        named = ", ".join(f"{d['row']} ({d['sample_id']}, {d['n_tokens']} tokens)" for d in dropped[:MAX_NAMED_ROWS])
        more = f" and {len(over) - MAX_NAMED_ROWS} more" if len(over) > MAX_NAMED_ROWS else ""
        raise EngineShardError(
            f"shard {shard_index:05d}: {len(over)} merged rows have max_model_len {max_model_len} tokens or more, "
            f"the servers' limit (a row may have at most max_model_len - 1 tokens: the request asks for one output "
            f"token): rows {named}{more}. Nothing was requested. Restart the servers with a larger --max-model-len "
            f"({MAX_MODEL_LEN_KEY}, printed by `eagle-pipeline vllm-command`; the longest row needs "
            f"{max(lengths) + 1}), or set {TOO_LONG_ROWS_KEY}: drop to leave them out (recorded in the shard's metadata)"
        )
    keep = [i for i, n in enumerate(lengths) if not too_long(n, max_model_len)]
    if not keep:
        raise EngineShardError(
            f"shard {shard_index:05d}: every one of its {len(lengths)} merged rows has max_model_len {max_model_len} "
            f"tokens or more: nothing to extract. Restart the servers with a larger --max-model-len ({MAX_MODEL_LEN_KEY})"
        )
    for d in dropped:
        d["reason"] = f"{d['n_tokens']} tokens >= the servers' max_model_len {max_model_len} (too_long_rows: drop)"
        if log is not None:
            log(f"warning: shard {shard_index:05d}: merged row {d['row']} ({d['sample_id']}) dropped: {d['reason']}")
    return rows.select(keep), dropped
