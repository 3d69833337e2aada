"""Prompt sets as users have them: the rows of a prompt file or folder, whatever its layout, in the project's shape.

Formats (a dataset's `format`; `auto`, the default, decides by the path, see `detect_format`):
- `jsonl`: the project's prompt file, one `{"id", "messages", "tools"?}` object per line (`data/prompts/README.md`).
- `sharegpt`: rows `{"id"?, "conversations": [{"from", "value"}], "system"?, "tools"?}` in a JSON array or one
  per line (JSONL); `from` is `human`, `gpt`, `system` or `tool` (`user`/`assistant` are taken too).
- `parquet`: a Parquet file, or a folder of them, with a `messages` column (OpenAI-style messages, or their JSON)
  or a `conversations` column (ShareGPT, with an optional `system` column), and optional `id` and `tools` columns.
- `arrow`: a `datasets` `save_to_disk` folder (`data-*.arrow` Arrow IPC streams, `state.json`, `dataset_info.json`),
  the same columns as Parquet; read with pyarrow, no `datasets` needed.

`iter_prompt_rows` yields every row as (location, default id, row or None, problem or None), the location naming
the file and line (`file:line`) or row (`file, row N`, counted from 0 as `datasets` indexes them); the caller
(`prompts.load_prompt_file`) validates the rows and raises on the first problem. Rows of the project's JSONL are
passed on unchanged (their sample ids never change). Rows of the other formats are brought to the project's shape:
ShareGPT turns become messages, a conversation's trailing assistant turns (the dataset's own answer, which the target
rewrites) are cut, nulls Arrow fills into struct columns are dropped, and tools given as JSON text or as bare
function definitions become OpenAI-style tool definitions.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, get_args

import pyarrow as pa
import pyarrow.parquet as pq

from eagle_pipeline.shared.storage import iter_jsonl_objects

PromptFormat = Literal["auto", "jsonl", "sharegpt", "parquet", "arrow"]
PROMPT_FORMATS: tuple[str, ...] = get_args(PromptFormat)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
SHAREGPT_ROLES.update(system="system", tool="tool")
_COLUMNS = ("id", "messages", "conversations", "tools", "system")

Row = tuple[str, str, dict[str, Any] | None, str | None]


def detect_format(path: str | Path) -> str:
    """The format `auto` means for `path`: a folder of `.arrow` files or with `state.json` is `arrow`, one of
    Parquet files `parquet`; `.parquet` is `parquet`, `.arrow` `arrow`, `.json` `sharegpt`; `.jsonl` is `sharegpt`
    when its first row has `conversations` and no `messages`, else `jsonl`."""
    p = Path(path)
    if p.is_dir():
        if (p / "state.json").exists() or any(p.glob("*.arrow")):
            return "arrow"
        if any(p.rglob("*.parquet")):
            return "parquet"
        return "arrow"  # the error names what a save_to_disk folder holds
    suffix = p.suffix.lower()
    if suffix in (".parquet", ".arrow"):
        return suffix[1:]
    if suffix == ".json":
        return "sharegpt"
    for _, _, obj, _ in iter_jsonl_objects(p):
        return "sharegpt" if obj is not None and "conversations" in obj and "messages" not in obj else "jsonl"
    return "jsonl"


def iter_prompt_rows(path: str | Path, fmt: str = "auto") -> Iterator[Row]:
    """(location, default id, row as {"id"?, "messages", "tools"?} or None, problem or None) for every row.

    Raises FileNotFoundError, or ValueError naming the file for one that cannot be read at all.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: prompt file not found")
    if fmt not in PROMPT_FORMATS:
        raise ValueError(f"{p}: unknown prompt format {fmt!r} (one of {', '.join(PROMPT_FORMATS)})")
    if fmt == "auto":
        fmt = detect_format(p)
    if fmt == "jsonl":
        _not_a_folder(p, fmt)
        for lineno, where, obj, problem in iter_jsonl_objects(p):
            yield where, f"{p.stem}:{lineno}", obj, problem
    elif fmt == "sharegpt":
        _not_a_folder(p, fmt)
        for where, default_id, obj, problem in _sharegpt_objects(p):
            yield (where, default_id, *_from_sharegpt(obj)) if obj is not None else (where, default_id, None, problem)
    else:
        for where, default_id, obj in _table_rows(p, fmt):
            yield where, default_id, *_from_table_row(obj)


# ---- files and folders -------------------------------------------------------------------------------------


def _not_a_folder(p: Path, fmt: str) -> None:
    if p.is_dir():
        raise ValueError(f"{p}: a folder; format {fmt!r} reads one file (folders: 'parquet' or 'arrow')")


def _sharegpt_objects(p: Path) -> Iterator[Row]:
    with p.open(encoding="utf-8") as fh:
        array = fh.read(4096).lstrip()[:1] == "["  # a JSON array, else one object per line, whatever the extension
    if not array:
        for lineno, where, obj, problem in iter_jsonl_objects(p):
            yield where, f"{p.stem}:{lineno}", obj, problem
        return
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}:{exc.lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    for i, obj in enumerate(data):
        where = f"{p}, row {i}"
        if isinstance(obj, dict):
            yield where, f"{p.stem}:{i}", obj, None
        else:
            yield where, f"{p.stem}:{i}", None, f"expected a JSON object, got {type(obj).__name__}"


def _table_files(p: Path, fmt: str) -> list[Path]:
    if fmt == "parquet":
        files = sorted(p.rglob("*.parquet")) if p.is_dir() else [p]
        if not files:
            raise ValueError(f"{p}: no .parquet files in the folder")
        return files
    if p.is_file():
        return [p]
    if (p / "dataset_dict.json").exists():
        splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
        raise ValueError(
            f"{p}: a DatasetDict folder (splits {', '.join(splits)}); point `prompts` at one split's folder"
        )
    state = p / "state.json"
    if state.exists():
        try:
            names = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{state}: not a datasets state file ({type(exc).__name__}: {exc})") from None
        files = [p / n for n in names]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise ValueError(f"{state}: lists data files that are missing: {', '.join(missing)}")
    else:
        files = sorted(p.glob("*.arrow"))
    if not files:
        raise ValueError(f"{p}: not a datasets save_to_disk folder (no state.json, no .arrow files)")
    return files


def _batches(f: Path, fmt: str) -> Iterator[pa.RecordBatch]:
    """The record batches of one file, reading only the columns a prompt uses."""
    try:
        if fmt == "parquet":
            pf = pq.ParquetFile(f)
            yield from pf.iter_batches(batch_size=4096, columns=_columns(f, pf.schema_arrow.names))
            return
        with pa.memory_map(str(f)) as source:
            try:
                reader: Any = pa.ipc.open_stream(source)  # what save_to_disk writes
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_file(source)
            if isinstance(reader, pa.ipc.RecordBatchFileReader):
                batches: Iterator[pa.RecordBatch] = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                batches = iter(reader)
            for batch in batches:
                yield batch.select(_columns(f, batch.schema.names))
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{f}: not a readable {fmt} file ({type(exc).__name__}: {exc})") from None


def _columns(f: Path, names: list[str]) -> list[str]:
    if "messages" not in names and "conversations" not in names:
        raise ValueError(f"{f}: needs a 'messages' or a 'conversations' column (has {', '.join(names)})")
    return [c for c in _COLUMNS if c in names]


def _table_rows(p: Path, fmt: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    row = 0
    for f in _table_files(p, fmt):
        in_file = 0
        for batch in _batches(f, fmt):
            for obj in batch.to_pylist():
                yield f"{f}, row {in_file}", f"{p.stem}:{row}", obj
                in_file += 1
                row += 1


# ---- rows --------------------------------------------------------------------------------------------------


def _from_table_row(obj: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    if obj.get("messages") is None and obj.get("conversations") is not None:
        return _from_sharegpt(obj, table=True)
    messages = obj.get("messages")
    if isinstance(messages, str):
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError as exc:
            return None, f"'messages' is text but not JSON ({exc.msg} at column {exc.colno})"
    elif isinstance(messages, list):  # a struct column: Arrow gave every message every field
        messages = [_without_nulls(m, keep=("content",)) if isinstance(m, dict) else m for m in messages]
    return _row(obj, _without_answer(messages) if isinstance(messages, list) else messages, table=True)


def _from_sharegpt(obj: dict[str, Any], *, table: bool = False) -> tuple[dict[str, Any] | None, str | None]:
    turns = obj.get("conversations")
    if not isinstance(turns, list) or not turns:
        return None, "'conversations' must be a non-empty list"
    messages: list[dict[str, Any]] = []
    if isinstance(obj.get("system"), str) and obj["system"]:
        messages.append({"role": "system", "content": obj["system"]})
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return None, f"conversations[{i}] must be an object with 'from' and 'value'"
        role = SHAREGPT_ROLES.get(turn["from"]) if isinstance(turn.get("from"), str) else None
        if role is None:
            return None, f"conversations[{i}]: unknown role {turn.get('from')!r} (one of {', '.join(SHAREGPT_ROLES)})"
        if not isinstance(turn.get("value"), str):
            return None, f"conversations[{i}].value must be a string"
        messages.append({"role": role, "content": turn["value"]})
    return _row(obj, _without_answer(messages), table=table)


def _row(obj: dict[str, Any], messages: Any, *, table: bool) -> tuple[dict[str, Any] | None, str | None]:
    """The row in the project's shape; `table`: from a Parquet/Arrow column, where struct nulls are dropped."""
    out: dict[str, Any] = {"messages": messages}
    if obj.get("id") is not None:
        out["id"] = obj["id"]
    tools = obj.get("tools")
    struct = table and isinstance(tools, list)
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as exc:
            return None, f"'tools' is text but not JSON ({exc.msg} at column {exc.colno})"
    if isinstance(tools, list):
        tools = [_openai_tool(_without_nulls(t) if struct else t) if isinstance(t, dict) else t for t in tools]
        tools = tools or None
    if tools is not None:
        out["tools"] = tools
    return out, None


def _without_answer(messages: list[Any]) -> list[Any]:
    """The conversation before its trailing assistant turns: the target writes that answer itself."""
    end = len(messages)
    while end and isinstance(messages[end - 1], dict) and messages[end - 1].get("role") == "assistant":
        end -= 1
    return messages[:end] if end else messages  # only assistant turns: left for the validator to name


def _openai_tool(t: dict[str, Any]) -> dict[str, Any]:
    """A bare function definition ({"name", "description"?, "parameters"?}) as an OpenAI-style tool."""
    return {"type": "function", "function": t} if "type" not in t and "name" in t else t


def _without_nulls(value: Any, keep: tuple[str, ...] = ()) -> Any:
    """`value` without the null members an Arrow struct column gives every field a row lacks (nested too)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None or k in keep}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value
