"""Prompt sets: loading prompt files and giving every prompt a stable sample id.

The project's prompt file has one JSON object per line:
    {"id": "b1-001", "messages": [{"role": "user", "content": "..."}], "tools": [...]}   # tools optional
ShareGPT files, Parquet files and `datasets` save_to_disk folders are read too (`formats`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from eagle_pipeline.prompts.formats import iter_prompt_rows

VALID_ROLES = {"system", "user", "assistant", "tool"}

PROMPTS_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("source_id", pa.string()),
        ("messages_json", pa.string()),
        ("tools_json", pa.string()),
    ]
)


class PromptFileError(ValueError):
    """A prompt file is malformed; the message names the file and line."""


@dataclass(frozen=True)
class Prompt:
    source_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: the form hashed into sample ids."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def make_sample_id(dataset: str, messages: Sequence[Mapping[str, Any]], tools: Any, sampling: Mapping[str, Any]) -> str:
    """Stable id of one generation request: a hash of dataset, prompt content and sampling config.

    The same prompt under another sampling config (temperature, seed, max_tokens, thinking) is another sample.
    """
    payload = canonical_json(
        {"dataset": dataset, "messages": list(messages), "tools": tools, "sampling": dict(sampling)}
    )
    return f"{dataset}-{hashlib.sha256(payload.encode()).hexdigest()[:20]}"


def load_prompt_file(path: str | Path, *, limit: int | None = None, format: str = "auto") -> list[Prompt]:
    """Read a prompt set in `format` (`formats.PROMPT_FORMATS`); raise PromptFileError naming the file and
    line or row of the first problem."""
    p = Path(path)
    try:
        prompts = _load(p, limit, format)
    except PromptFileError:
        raise
    except (FileNotFoundError, ValueError) as exc:  # a file or folder that cannot be read at all
        raise PromptFileError(str(exc)) from None
    if not prompts:
        raise PromptFileError(f"{p}: no prompts")
    return prompts


def _load(p: Path, limit: int | None, fmt: str) -> list[Prompt]:
    prompts: list[Prompt] = []
    seen: dict[str, str] = {}
    for where, default_id, obj, problem in iter_prompt_rows(p, fmt):
        if problem or obj is None:
            raise PromptFileError(f"{where}: {problem}")
        messages = obj.get("messages")
        if not isinstance(messages, list) or not messages:
            raise PromptFileError(f"{where}: 'messages' must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in VALID_ROLES:
                raise PromptFileError(f"{where}: messages[{i}] needs a role in {sorted(VALID_ROLES)}")
            if not isinstance(m.get("content"), str) and not m.get("tool_calls"):
                raise PromptFileError(f"{where}: messages[{i}].content must be a string")
        if messages[-1]["role"] not in ("user", "tool"):
            raise PromptFileError(f"{where}: the last message must be from the user or a tool")
        tools = obj.get("tools")
        if tools is not None and (not isinstance(tools, list) or not all(_is_tool(t) for t in tools)):
            raise PromptFileError(f"{where}: 'tools' must be a list of OpenAI-style function definitions")
        source_id = str(obj.get("id", default_id))
        if source_id in seen:
            raise PromptFileError(f"{where}: duplicate id {source_id!r} (first {seen[source_id]})")
        seen[source_id] = f"on line {where[len(str(p)) + 1 :]}" if where.startswith(f"{p}:") else f"at {where}"
        prompts.append(Prompt(source_id=source_id, messages=messages, tools=tools))
        if limit is not None and len(prompts) >= limit:
            break
    return prompts


def _is_tool(t: Any) -> bool:
    return (
        isinstance(t, dict)
        and t.get("type") == "function"
        and isinstance(t.get("function"), dict)
        and "name" in t["function"]
    )


def prompts_table(
    dataset: str, prompts: Sequence[Prompt], sampling: Mapping[str, Any], regenerate: str = "last_turn"
) -> pa.Table:
    """The prompts asset's table: one row per prompt with its stable sample id.

    Under `regenerate='all_turns'` a prompt is a whole conversation to regenerate, another sample than its last
    turn alone: the mode is hashed into its id (which the turns' ids derive from); `last_turn` ids are unchanged.
    """
    if regenerate != "last_turn":
        sampling = {**sampling, "regenerate": regenerate}
    rows: dict[str, list[Any]] = {name: [] for name in PROMPTS_SCHEMA.names}
    for pr in prompts:
        rows["sample_id"].append(make_sample_id(dataset, pr.messages, pr.tools, sampling))
        rows["dataset"].append(dataset)
        rows["source_id"].append(pr.source_id)
        rows["messages_json"].append(canonical_json(pr.messages))
        rows["tools_json"].append(canonical_json(pr.tools) if pr.tools is not None else None)
    return pa.table(rows, schema=PROMPTS_SCHEMA)


def dataset_prompts_table(ds: Any) -> pa.Table:
    """The prompts table of a configured dataset (`config.DatasetConfig`) under its current limit and sampling."""
    prompts = load_prompt_file(ds.prompts, limit=ds.limit, format=ds.prompts_format)
    return prompts_table(ds.name, prompts, ds.sampling.to_dict(), ds.regenerate)


def normalized_prompt_key(messages: Sequence[Mapping[str, Any]]) -> str:
    """Hash of the prompt's text, case-folded with whitespace collapsed: the key for cross-dataset dedup."""
    text = "\n".join(f"{m.get('role')}:{' '.join(str(m.get('content') or '').split()).casefold()}" for m in messages)
    return hashlib.sha256(text.encode()).hexdigest()[:24]
