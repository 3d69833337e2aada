"""Prompt sets as users have them (eagle_pipeline/prompts/formats.py): ShareGPT JSON/JSONL, Parquet files and
folders, `datasets` save_to_disk folders; real files written here, the same prompts from every layout."""

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from eagle_pipeline.config import DEFAULT_CONFIG, ConfigError, load_config
from eagle_pipeline.prompts import PromptFileError, dataset_prompts_table, load_prompt_file, prompts_table
from eagle_pipeline.prompts.formats import detect_format

SAMPLING = {"seed": 1, "temperature": 0.6}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
# The project's JSONL rows; every other layout below holds the same conversations.
ROWS = [
    {"id": "a", "messages": [{"role": "user", "content": "Explain recursion."}]},
    {
        "id": "b",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
        ],
        "tools": TOOLS,
    },
    {
        "id": "c",
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
    },
]
ANSWERS = {"a": "Recursion is ...", "b": "It is sunny.", "c": "Why did ..."}  # the datasets' own answers
SHAREGPT_ROLE = {"user": "human", "assistant": "gpt", "system": "system", "tool": "tool"}


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _sharegpt_rows():
    out = []
    for r in ROWS:
        turns = [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in r["messages"]]
        row = {"id": r["id"], "conversations": turns + [{"from": "gpt", "value": ANSWERS[r["id"]]}]}
        if "tools" in r:
            row["tools"] = json.dumps([t["function"] for t in r["tools"]])  # LLaMA-Factory style: bare functions
        out.append(row)
    return out


def _messages_rows():
    """Rows with a `messages` column ending on the dataset's answer, tools as JSON text (as HF datasets keep them)."""
    return [
        {
            "id": r["id"],
            "messages": r["messages"] + [{"role": "assistant", "content": ANSWERS[r["id"]]}],
            "tools": json.dumps(r["tools"]) if "tools" in r else None,
        }
        for r in ROWS
    ]


def _table(path, fmt="auto"):
    return prompts_table("D", load_prompt_file(path, format=fmt), SAMPLING)


def test_every_layout_gives_the_prompts_and_sample_ids_of_the_projects_jsonl(tmp_path):
    expected = _table(_jsonl(tmp_path / "p.jsonl", ROWS))
    assert expected.column("source_id").to_pylist() == ["a", "b", "c"]

    (tmp_path / "sg.json").write_text(json.dumps(_sharegpt_rows()))
    _jsonl(tmp_path / "sg.jsonl", _sharegpt_rows())
    pq.write_table(pa.Table.from_pylist(_messages_rows()), tmp_path / "m.parquet")
    # messages as JSON text, and ShareGPT conversations, in Parquet
    text_rows = [{**r, "messages": json.dumps(r["messages"])} for r in _messages_rows()]
    pq.write_table(pa.Table.from_pylist(text_rows), tmp_path / "mtext.parquet")
    conv_rows = [{"tools": None, **r} for r in _sharegpt_rows()]  # from_pylist takes its columns from row 0
    pq.write_table(pa.Table.from_pylist(conv_rows), tmp_path / "conv.parquet")
    # a folder of Parquet shards (the hub's data/train-0000N-of-0000M.parquet layout)
    (tmp_path / "pqdir" / "data").mkdir(parents=True)
    rows = _messages_rows()
    pq.write_table(pa.Table.from_pylist(rows[:2]), tmp_path / "pqdir" / "data" / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[2:]), tmp_path / "pqdir" / "data" / "train-00001-of-00002.parquet")
    # the real datasets library's save_to_disk, in two shards
    datasets.Dataset.from_list(_messages_rows()).save_to_disk(str(tmp_path / "saved"), num_shards=2)
    assert len(list((tmp_path / "saved").glob("data-*.arrow"))) == 2 and (tmp_path / "saved" / "state.json").exists()

    layouts = {
        "sg.json": "sharegpt",
        "sg.jsonl": "sharegpt",
        "m.parquet": "parquet",
        "mtext.parquet": "parquet",
        "conv.parquet": "parquet",
        "pqdir": "parquet",
        "saved": "arrow",
    }
    for name, fmt in layouts.items():
        assert detect_format(tmp_path / name) == fmt, name
        assert _table(tmp_path / name).equals(expected), name
        assert _table(tmp_path / name, fmt).equals(expected), name
    assert detect_format(tmp_path / "p.jsonl") == "jsonl"
    # an extension that says nothing: declared, and JSON array or JSONL told apart by the content
    _jsonl(tmp_path / "sg_lines.txt", _sharegpt_rows())
    assert _table(tmp_path / "sg_lines.txt", "sharegpt").equals(expected)


def test_tool_calls_in_a_struct_column_keep_working(tmp_path):
    # A multi-turn tool conversation: Arrow gives every message every field of the struct (tool_calls: null on
    # the others, tool_call_id: null on all but the tool result); the prompts equal the JSONL's.
    row = {
        "id": "t",
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "content": '{"sky": "clear"}', "tool_call_id": "call_1"},
        ],
        "tools": TOOLS,
    }
    expected = _table(_jsonl(tmp_path / "t.jsonl", [row]))
    datasets.Dataset.from_list([row]).save_to_disk(str(tmp_path / "saved"))
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "t.parquet")
    for path in (tmp_path / "saved", tmp_path / "t.parquet"):
        got = _table(path)
        assert got.equals(expected), path
        assert json.loads(got.column("tools_json")[0].as_py()) == TOOLS


def test_a_hand_written_save_to_disk_folder_reads_its_shards_in_state_json_order(tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    rows = _messages_rows()
    names = ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    for name, part in zip(names, (rows[2:], rows[:2])):  # state.json lists the second file first
        table = pa.Table.from_pylist(part)
        with pa.OSFile(str(d / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": names[1]}, {"filename": names[0]}]}))
    (d / "dataset_info.json").write_text("{}")
    t = _table(d)
    assert t.column("source_id").to_pylist() == ["a", "b", "c"]
    assert t.equals(_table(_jsonl(tmp_path / "p.jsonl", ROWS)))
    # rows without an id are named by the folder and their row in the dataset
    no_ids = [{k: v for k, v in r.items() if k != "id"} for r in rows]
    pq.write_table(pa.Table.from_pylist(no_ids), tmp_path / "noid.parquet")
    assert _table(tmp_path / "noid.parquet").column("source_id").to_pylist() == ["noid:0", "noid:1", "noid:2"]


def _raises(path, *parts, fmt="auto"):
    with pytest.raises(PromptFileError) as exc:
        load_prompt_file(path, format=fmt)
    for part in parts:
        assert part in str(exc.value), (part, str(exc.value))
    return str(exc.value)


def test_bad_sharegpt_rows_name_the_file_and_row(tmp_path):
    good = _sharegpt_rows()[0]
    cases = [
        ({"conversations": [{"from": "bing", "value": "hi"}]}, "conversations[0]: unknown role 'bing'"),
        ({"conversations": [{"from": ["human"], "value": "hi"}]}, "conversations[0]: unknown role ['human']"),
        ({"conversations": [{"from": "human", "value": 3}]}, "conversations[0].value must be a string"),
        ({"conversations": []}, "'conversations' must be a non-empty list"),
        ({"conversations": ["hi"]}, "conversations[0] must be an object"),
        ({"conversations": [{"from": "gpt", "value": "only an answer"}]}, "the last message must be from the user"),
        ({**good, "tools": "[{"}, "'tools' is text but not JSON"),
        ({**good, "tools": json.dumps([{"description": "no name"}])}, "OpenAI-style function definitions"),
    ]
    for row, message in cases:
        (tmp_path / "s.json").write_text(json.dumps([good | {"id": "ok"}, row]))
        _raises(tmp_path / "s.json", f"{tmp_path / 's.json'}, row 1: ", message)
        _jsonl(tmp_path / "s.jsonl", [good | {"id": "ok"}, row])
        _raises(tmp_path / "s.jsonl", f"{tmp_path / 's.jsonl'}:2: ", message, fmt="sharegpt")
    (tmp_path / "s.jsonl").write_text(json.dumps(good) + "\n{not json\n")
    _raises(tmp_path / "s.jsonl", f"{tmp_path / 's.jsonl'}:2: invalid JSON")
    (tmp_path / "s.json").write_text('[{"conversations": [}')
    _raises(tmp_path / "s.json", f"{tmp_path / 's.json'}:1: invalid JSON")
    (tmp_path / "s.json").write_text(json.dumps({"conversations": []}))  # not an array: one object per line
    _raises(tmp_path / "s.json", f"{tmp_path / 's.json'}:1: 'conversations' must be a non-empty list")
    (tmp_path / "s.json").write_text(json.dumps([good, good]))
    _raises(tmp_path / "s.json", f"row 1: duplicate id 'a' (first at {tmp_path / 's.json'}, row 0)")
    # a project-format file declared as ShareGPT: told what is missing, not read as something else
    _raises(_jsonl(tmp_path / "p.jsonl", ROWS), "p.jsonl:1: 'conversations' must be a non-empty list", fmt="sharegpt")


def test_bad_tables_name_the_file_and_row(tmp_path):
    rows = _messages_rows()
    p = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "x", "prompt": "hi"}]), p)
    _raises(p, str(p), "needs a 'messages' or a 'conversations' column (has id, prompt)")
    pq.write_table(pa.Table.from_pylist([{"messages": json.dumps(rows[0]["messages"])}, {"messages": "[{"}]), p)
    _raises(p, f"{p}, row 1: 'messages' is text but not JSON")
    wizard = [{**rows[0], "id": "w", "messages": [{"role": "wizard", "content": "x"}]}]
    pq.write_table(pa.Table.from_pylist(rows[:1] + wizard), p)
    _raises(p, f"{p}, row 1: messages[0] needs a role")
    pq.write_table(pa.Table.from_pylist([{"messages": [{"role": "user", "content": None}]}]), p)
    _raises(p, f"{p}, row 0: messages[0].content must be a string")
    # duplicate ids across the shards of a folder name both places
    (tmp_path / "dir").mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "dir" / "part-0.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "dir" / "part-1.parquet")
    _raises(
        tmp_path / "dir",
        f"{tmp_path / 'dir' / 'part-1.parquet'}, row 0: duplicate id 'a' (first at {tmp_path / 'dir' / 'part-0.parquet'}, row 0)",
    )
    (tmp_path / "dir" / "part-1.parquet").write_bytes(b"PAR1 not really")
    _raises(tmp_path / "dir", f"{tmp_path / 'dir' / 'part-1.parquet'}: not a readable parquet file")


def test_bad_save_to_disk_folders_are_named(tmp_path):
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(_messages_rows()).save_to_disk(str(saved))
    (arrow,) = saved.glob("data-*.arrow")
    arrow.write_bytes(arrow.read_bytes()[:200])  # cut mid-stream
    _raises(saved, str(arrow), "not a readable arrow file")
    arrow.unlink()
    _raises(saved, f"{saved / 'state.json'}: lists data files that are missing: {arrow}")
    (saved / "state.json").write_text("{}")
    _raises(saved, f"{saved / 'state.json'}: not a datasets state file")
    empty = tmp_path / "empty"
    empty.mkdir()
    _raises(empty, "not a datasets save_to_disk folder")
    dd = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(_messages_rows())}).save_to_disk(str(dd))
    _raises(dd, "a DatasetDict folder (splits train); point `prompts` at one split's folder")
    assert len(load_prompt_file(dd / "train")) == 3
    _raises(dd / "train", "a folder; format 'jsonl' reads one file", fmt="jsonl")
    _raises(tmp_path / "absent.parquet", "prompt file not found")
    _raises(_jsonl(tmp_path / "p.jsonl", ROWS), "unknown prompt format 'csv'", fmt="csv")


def test_the_format_is_declared_per_dataset_in_the_configuration(tmp_path):
    datasets.Dataset.from_list(_messages_rows()).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "sg.txt").write_text(json.dumps(_sharegpt_rows()))  # an extension auto cannot place
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    base = {k: v for k, v in raw["datasets"][0].items() if k not in ("prompts", "limit")}
    raw["datasets"] = [
        {**base, "name": "S", "prompts": str(tmp_path / "saved")},
        {**base, "name": "G", "prompts": str(tmp_path / "sg.txt"), "format": "sharegpt"},
    ]
    p = tmp_path / "pipeline.yaml"
    p.write_text(yaml.safe_dump(raw))
    cfg = load_config(p)
    assert [cfg.datasets[n].prompts_format for n in ("S", "G")] == ["auto", "sharegpt"]
    assert dataset_prompts_table(cfg.datasets["S"]).column("source_id").to_pylist() == ["a", "b", "c"]
    assert dataset_prompts_table(cfg.datasets["G"]).column("source_id").to_pylist() == ["a", "b", "c"]
    raw["datasets"][1]["format"] = "csv"
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    assert any(pr.startswith("datasets[1].format:") for pr in exc.value.problems), exc.value.problems


def test_sample_ids_of_the_projects_jsonl_are_unchanged():
    # Pinned from the release before other layouts were read: a change here re-buys every committed answer.
    cfg = load_config(DEFAULT_CONFIG)
    t = prompts_table("B1", load_prompt_file(cfg.datasets["B1"].prompts), SAMPLING)
    assert t.column("sample_id")[0].as_py() == PINNED_B1_FIRST


PINNED_B1_FIRST = "B1-9326f49225d730284bdb"
