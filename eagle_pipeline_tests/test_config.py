import dataclasses
import re
import typing
from pathlib import Path

import annotated_types
import pytest
import yaml

from eagle_pipeline.audit import AuditSettings
from eagle_pipeline.config import (
    DEFAULT_CONFIG,
    REPO_ROOT,
    ConfigError,
    DatasetConfig,
    PipelineConfig,
    PoolsConfig,
    TargetConfig,
    load_config,
)
from eagle_pipeline.generation.run.options import GenerationSettings
from eagle_pipeline.generation.spec import BackendSpec, SamplingOptions, SamplingSpec
from eagle_pipeline.generation.store.answer_log import DEFAULT_FLUSH_S
from eagle_pipeline.hidden_states.settings import DrafterSpec, HiddenStatesConfig, TorchrunConfig, VLLMEngineConfig
from eagle_pipeline.merge import MergeSettings
from eagle_pipeline.prompts import dataset_prompts_table, load_prompt_file, prompts_table


def test_default_config_loads_with_eight_datasets():
    cfg = load_config(DEFAULT_CONFIG)
    assert cfg.dataset_names == [f"B{i}" for i in range(1, 9)]
    assert {d.backend for d in cfg.datasets.values()} == {"simulated"}
    assert cfg.datasets["B6"].tools and not cfg.datasets["B1"].tools
    assert cfg.backends["openrouter"].api_key_env == "OPENROUTER_API_KEY"
    for ds in cfg.datasets.values():
        assert ds.prompts.is_file()


def test_config_hash_changes_with_content(tmp_path):
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    a = tmp_path / "a" / "pipeline.yaml"
    a.parent.mkdir()
    raw["data_root"] = "x"
    for d in raw["datasets"]:
        d["prompts"] = str(DEFAULT_CONFIG.parent / d["prompts"])
    a.write_text(yaml.safe_dump(raw))
    h1 = load_config(a).config_hash()
    raw["merge"]["seed"] = 7
    a.write_text(yaml.safe_dump(raw))
    assert load_config(a).config_hash() != h1


def test_invalid_config_lists_every_problem_with_its_path(tmp_path):
    bad = {
        "data_root": "out",
        "target": {"tokenizer": "demo", "colour": "blue"},
        "backends": {
            "or": {"kind": "openrouter", "model": "m"},
            "weird": {"kind": "carrier-pigeon", "model": "m", "provider": {"favourite": 1}},
            "files": {"kind": "import", "import_paths": []},
        },
        "datasets": [
            {"name": "B1", "prompts": "missing.jsonl", "domain": "coding", "backend": "nope", "limit": 0},
            {"name": "B1", "prompts": "missing.jsonl", "domain": "coding", "backend": "or", "max_tokens": "many"},
            {"name": "B2", "prompts": "missing.jsonl", "domain": "x", "backend": "files", "regenerate": "all_turns"},
            {"name": "B3", "prompts": "missing.jsonl", "domain": "x", "backend": "or", "regenerate": "sometimes"},
        ],
        "audit": {"actions": {"ends_with_eot": "ignore", "no_such_gate": "block"}},
        "merge": {"eval_fraction": 1.5, "caps": {"B9": 3}},
    }
    p = tmp_path / "pipeline.yaml"
    p.write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    text = str(exc.value)
    expected = [
        "target.colour: unknown key",
        "backends.or.endpoint: required",
        "backends.or.api_key_env: required",
        "backends.weird.kind: must be one of",
        "backends.weird.provider.favourite",
        "datasets[0].backend: unknown backend 'nope'",
        "datasets[0].limit: must be >= 1",
        "datasets[1].name: duplicate dataset name 'B1'",
        "datasets[1].max_tokens: expected int",
        "datasets[2].regenerate: 'all_turns' needs a chat backend",
        "datasets[3].regenerate",
        "audit.actions.ends_with_eot: action 'ignore' for 'ends_with_eot' is not one of",
        "no_such_gate",
        "merge.eval_fraction",
        "merge.caps.B9: unknown dataset",
    ]
    for needle in expected:
        assert needle in text, f"missing {needle!r} in:\n{text}"
    assert str(p) in text
    assert len(exc.value.problems) >= len(expected)


def test_api_key_value_in_place_of_env_name_is_rejected(tmp_path):
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["backends"]["openrouter"]["api_key_env"] = "sk-or-v1-abcdef"
    for d in raw["datasets"]:
        d["prompts"] = str(DEFAULT_CONFIG.parent / d["prompts"])
    p = tmp_path / "pipeline.yaml"
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"backends\.openrouter\.api_key_env: must be the name"):
        load_config(p)


def test_yaml_syntax_error_names_line(tmp_path):
    p = tmp_path / "pipeline.yaml"
    p.write_text("data_root: x\ndatasets: [\n  {name: B1\n")
    with pytest.raises(ConfigError, match=r"line \d+"):
        load_config(p)


def test_env_overrides_config_file_and_data_root(tmp_path, monkeypatch):
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["datasets"] = raw["datasets"][:2]
    for d in raw["datasets"]:
        d["prompts"] = str(DEFAULT_CONFIG.parent / d["prompts"])
    p = tmp_path / "other.yaml"
    p.write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("EAGLE_PIPELINE_CONFIG", str(p))
    monkeypatch.setenv("EAGLE_DATA_ROOT", str(tmp_path / "root"))
    cfg = load_config()
    assert cfg.dataset_names == ["B1", "B2"]
    assert cfg.data_root == Path(tmp_path / "root")


def test_yaml_and_python_api_share_defaults_sample_ids_and_settings(tmp_path):
    """A file that leaves every default out and the Python API with no arguments agree on everything."""
    prompts = DEFAULT_CONFIG.parent / "data/prompts/B1_coding.jsonl"
    p = tmp_path / "pipeline.yaml"
    p.write_text(
        yaml.safe_dump(
            {
                "target": {"tokenizer": "demo"},
                "backends": {
                    "sim": {"kind": "simulated", "model": "m"},
                    "or": {"kind": "openrouter", "endpoint": "https://o/api/v1", "model": "m", "api_key_env": "K"},
                    "v": {"kind": "vllm", "endpoint": "http://h:8000/v1", "model": "m"},
                },
                "datasets": [{"name": "B1", "prompts": str(prompts), "domain": "coding", "backend": "sim", "limit": 5}],
            }
        )
    )
    cfg = load_config(p)
    ds = cfg.datasets["B1"]
    assert ds.sampling == SamplingSpec() and ds.sampling.to_dict() == SamplingSpec().to_dict()
    via_yaml = prompts_table(ds.name, load_prompt_file(ds.prompts, limit=ds.limit), ds.sampling.to_dict())
    via_api = prompts_table("B1", load_prompt_file(prompts, limit=5), SamplingSpec().to_dict())
    assert via_yaml.num_rows == 5 and via_yaml["sample_id"].to_pylist() == via_api["sample_id"].to_pylist()
    for name, spec in cfg.backends.items():
        given = {k: getattr(spec, k) for k in ("kind", "endpoint", "model", "api_key_env")}
        api = BackendSpec(name=name, **given)
        assert spec == api and spec.to_dict() == api.to_dict()
    assert cfg.backends["sim"].effective_concurrency == 256 and cfg.backends["or"].effective_concurrency == 2000
    assert cfg.backends["sim"].max_retries == 8
    # Setting a default explicitly, or to null, changes nothing; another seed is another sample.
    raw = yaml.safe_load(p.read_text())
    raw["datasets"][0]["sampling"] = {"temperature": 0.6, "seed": None, "thinking": True}
    raw["datasets"][0]["max_tokens"] = 2048
    p.write_text(yaml.safe_dump(raw))
    assert load_config(p).datasets["B1"].sampling == SamplingSpec()
    raw["datasets"][0]["sampling"]["seed"] = 1
    p.write_text(yaml.safe_dump(raw))
    other = load_config(p).datasets["B1"].sampling
    assert other == SamplingSpec(seed=1)
    assert prompts_table("B1", load_prompt_file(prompts, limit=5), other.to_dict())["sample_id"].to_pylist() != (
        via_api["sample_id"].to_pylist()
    )


def test_answer_log_interval_is_checked_and_no_part_of_any_sample_id(tmp_path):
    """generation.answer_log_s: > 0 (the file and the line named), 0.05 by default; it changes durability only, so
    neither the sample ids nor the prompts tables (what decides which responses are current) depend on it."""
    assert load_config(DEFAULT_CONFIG).generation.answer_log_s == DEFAULT_FLUSH_S == 0.05
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    for d in raw["datasets"]:
        d["prompts"] = str(DEFAULT_CONFIG.parent / d["prompts"])
    p = tmp_path / "pipeline.yaml"
    for bad, problem in ((0, "must be > 0.0"), (-1, "must be > 0.0"), ("fast", "expected int/float, got str 'fast'")):
        raw["generation"]["answer_log_s"] = bad
        p.write_text(yaml.safe_dump(raw))
        with pytest.raises(ConfigError) as exc:
            load_config(p)
        assert exc.value.problems == [f"generation.answer_log_s: {problem} (line {_line_of(p, 'answer_log_s:')})"]
        assert str(exc.value).startswith(f"{p}: 1 problem(s)")
    raw["generation"]["answer_log_s"] = 0.4
    p.write_text(yaml.safe_dump(raw))
    cfg, base = load_config(p), load_config(DEFAULT_CONFIG)
    assert cfg.generation == dataclasses.replace(base.generation, answer_log_s=0.4)
    for name in cfg.dataset_names:
        assert dataset_prompts_table(cfg.datasets[name]).equals(dataset_prompts_table(base.datasets[name])), name


def test_stream_processes_is_checked_where_it_is_written(tmp_path):
    """backends.<name>.stream_processes: an integer >= 0, only where the backend streams; the file and line named."""
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    for d in raw["datasets"]:
        d["prompts"] = str(DEFAULT_CONFIG.parent / d["prompts"])
    p = tmp_path / "pipeline.yaml"
    for backend, value, problem in (
        ("openrouter", -1, "must be >= 0"),
        ("vllm", 2, "carries streamed answers only; set `stream: true`"),  # vLLM does not stream by default
    ):
        bad = yaml.safe_load(yaml.safe_dump(raw))
        bad["backends"][backend]["stream_processes"] = value
        p.write_text(yaml.safe_dump(bad))
        with pytest.raises(ConfigError) as exc:
            load_config(p)
        assert exc.value.problems == [
            f"backends.{backend}.stream_processes: {problem} (line {_line_of(p, 'stream_processes:')})"
        ]
    raw["backends"]["vllm"].update(stream=True, stream_processes=2)
    p.write_text(yaml.safe_dump(raw))
    assert load_config(p).backends["vllm"].stream_processes_for(8) == 2


def test_a_bad_gate_action_is_reported_once_at_its_path(tmp_path):
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    for d in raw["datasets"]:
        d["prompts"] = str(DEFAULT_CONFIG.parent / d["prompts"])
    raw["audit"] = {"actions": {"round_trip": "drop"}, "billing_aggregate_bound": 2}
    p = tmp_path / "pipeline.yaml"
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    assert [q for q in exc.value.problems if "drop" in q] == [
        "audit.actions.round_trip: action 'drop' for 'round_trip' is not one of block, filter, warn"
        + f" (line {_line_of(p, 'round_trip:')})"
    ]
    assert [q for q in exc.value.problems if "billing_aggregate_bound" in q] == [
        f"audit.billing_aggregate_bound: must be in [0, 1], got 2 (line {_line_of(p, 'billing_aggregate_bound:')})"
    ]
    assert len(exc.value.problems) == 2


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_problems_name_their_line_in_file_order(tmp_path):
    p = tmp_path / "pipeline.yaml"
    p.write_text(
        "target:\n  tokenizer: demo\n"
        "backends:\n  sim:\n    kind: simulated\n    model: m\n    concurrency: 0\n"
        "datasets:\n  - name: B1\n    prompts: nowhere.jsonl\n    domain: coding\n    backend: sim\n"
        "    sampling:\n      temperature: hot\n"
    )
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    assert exc.value.problems == [
        "backends.sim.concurrency: must be >= 1 (line 7)",
        "datasets[0].sampling.temperature: expected int/float, got str 'hot' (line 14)",
    ]


def test_a_missing_prompts_file_is_the_datasets_problem_not_the_files(tmp_path):
    """The file loads (the code location, `plan` and the other datasets need it); the dataset names its problem."""
    p = tmp_path / "pipeline.yaml"
    (tmp_path / "here.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    p.write_text(
        "target:\n  tokenizer: demo\n"
        "backends:\n  sim:\n    kind: simulated\n    model: m\n"
        "datasets:\n  - name: B1\n    prompts: here.jsonl\n    domain: coding\n    backend: sim\n"
        "  - name: B2\n    prompts: nowhere.jsonl\n    domain: coding\n    backend: sim\n"
    )
    cfg = load_config(p)
    assert cfg.prompts_problem("B1") is None
    assert cfg.prompts_problem("B2") == f"datasets[1].prompts: file not found: {tmp_path / 'nowhere.jsonl'} (line 13)"


# docs/configuration.md section heading -> the class whose fields it documents.
DOCUMENTED = {
    "Top level": PipelineConfig,
    "`target`": TargetConfig,
    "`backends.<name>`": BackendSpec,
    "`datasets[i]`": DatasetConfig,
    "`datasets[i].sampling`": SamplingOptions,
    "`generation`": GenerationSettings,
    "`audit`": AuditSettings,
    "`merge`": MergeSettings,
    "`hidden_states`": HiddenStatesConfig,
    "`hidden_states.vllm`": VLLMEngineConfig,
    "`hidden_states.torchrun`": TorchrunConfig,
    "`pools`": PoolsConfig,
    "`hidden_states.drafters[i]`": DrafterSpec,
}


def test_each_stage_owns_its_sections_and_the_configuration_uses_them():
    """The stages' own sections are the very classes the configuration's file holds: one definition each, in its
    stage."""
    sections = _section_classes(PipelineConfig)
    for cls in (GenerationSettings, HiddenStatesConfig, VLLMEngineConfig, TorchrunConfig, DrafterSpec):
        assert cls.__module__ in ("eagle_pipeline.generation.run.options", "eagle_pipeline.hidden_states.settings")
        assert cls in sections, cls


def _section_classes(cls: type, seen: set[type] | None = None) -> set[type]:
    """Every section class reachable from `cls`'s fields (through `X | None`, `tuple[X, ...]`, `dict[str, X]`,
    `Annotated[X, ...]`): what the file can hold, found from the code rather than listed by hand."""
    seen = set() if seen is None else seen
    for hint in typing.get_type_hints(cls, include_extras=True).values():
        stack = [hint]
        while stack:
            t = stack.pop()
            if isinstance(t, type) and dataclasses.is_dataclass(t):
                if t not in seen:
                    seen.add(t)
                    _section_classes(t, seen)
            else:
                stack.extend(typing.get_args(t))
    return seen


def _file_keys(cls) -> dict:
    """Key in the file -> its default (MISSING when required)."""
    if not hasattr(cls, "__pydantic_fields__"):  # a domain's plain dataclass (AuditSettings, MergeSettings)
        return {
            f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
            for f in dataclasses.fields(cls)
        }
    out = {}
    for name, info in cls.__pydantic_fields__.items():
        if info.init is False or (cls is BackendSpec and name == "name"):
            continue
        default = dataclasses.MISSING if info.is_required() else info.get_default(call_default_factory=True)
        out[info.alias or name] = default
    return out


def test_every_section_of_the_file_is_documented():
    """Every section class the configuration holds, found by walking the code, has its table in the docs."""
    assert _section_classes(PipelineConfig) | {PipelineConfig} == set(DOCUMENTED.values())


def _doc_tables(column: int) -> dict[str, dict[str, str]]:
    """docs/configuration.md's tables: section heading -> key -> the text of `column` (1: type, 2: default)."""
    tables: dict[str, dict[str, str]] = {}
    heading = None
    for line in (REPO_ROOT / "docs" / "configuration.md").read_text().splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif (m := re.match(r"\| `([^`]+)` \|([^|]+)\|([^|]*)\|", line)) and heading in DOCUMENTED:
            tables.setdefault(heading, {})[m[1]] = m[1 + column].strip()
    return tables


def _code_bounds(info) -> dict[str, float]:
    """A pydantic field's numeric bounds (ge, gt, le, lt), wherever its type declares them (`Annotated[Int,
    Field(ge=1)] | None` included)."""
    metadata, stack = list(info.metadata), [info.annotation]
    while stack:
        t = stack.pop()
        if typing.get_origin(t) is typing.Annotated:
            metadata += [m for meta in t.__metadata__ for m in getattr(meta, "metadata", [meta])]
        stack.extend(typing.get_args(t))
    kinds = {"ge": annotated_types.Ge, "gt": annotated_types.Gt, "le": annotated_types.Le, "lt": annotated_types.Lt}
    return {k: float(getattr(m, k)) for m in metadata for k, kind in kinds.items() if isinstance(m, kind)}


def _doc_bounds(text: str) -> dict[str, float]:
    """The bounds a type cell states: `≥ 1`, `> 0`, `in [0, 1]`, `in (0, 1]`, `in [0, 1)`."""
    out = {}
    if m := re.search(r"(?:≥|>=)\s*(-?[\d.]+)", text):
        out["ge"] = float(m[1])
    if m := re.search(r"(?<![≥>])>\s*(-?[\d.]+)", text):
        out["gt"] = float(m[1])
    if m := re.search(r"in ([\[(])\s*(-?[\d.]+),\s*(-?[\d.]+)\s*([\])])", text):
        out["ge" if m[1] == "[" else "gt"] = float(m[2])
        out["le" if m[4] == "]" else "lt"] = float(m[3])
    return out


def test_docs_state_every_bound_of_a_key():
    """The type column states exactly the bounds the code checks (`int ≥ 1` where the field has ge=1, none where
    it has none), for every section whose class declares its bounds on the field."""
    assert _doc_bounds("number in (0, 1]") == {"gt": 0.0, "le": 1.0} and _doc_bounds("integer >= 0") == {"ge": 0.0}
    types = _doc_tables(column=1)
    drift = []
    for heading, cls in DOCUMENTED.items():
        for name, info in getattr(cls, "__pydantic_fields__", {}).items():
            key = info.alias or name
            if key in types[heading] and _code_bounds(info) != _doc_bounds(types[heading][key]):
                drift.append(f"{heading} {key}: code {_code_bounds(info)}, docs {types[heading][key]!r}")
    assert not drift, drift


def test_docs_list_every_key_with_its_default():
    tables = _doc_tables(column=2)
    assert set(tables) == set(DOCUMENTED)
    for heading, cls in DOCUMENTED.items():
        keys = _file_keys(cls)
        assert set(tables[heading]) == set(keys), heading
        for key, documented in tables[heading].items():
            default = keys[key]
            if default is dataclasses.MISSING:
                assert documented == "", f"{heading} {key}: required, documented default {documented!r}"
            elif dataclasses.is_dataclass(default):
                assert documented == "`{}`", f"{heading} {key}: a section"
            elif documented.startswith("`"):
                value = yaml.safe_load(documented.strip("`"))
                actual = (
                    str(default)
                    if isinstance(default, Path)
                    else list(default)
                    if isinstance(default, tuple)
                    else default
                )
                assert value == actual, f"{heading} {key}"
            else:
                assert default is None, f"{heading} {key}: a default other than null must be given in backticks"


def test_target_references_are_checked_and_paths_resolve_against_the_file(tmp_path):
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    for d in raw["datasets"]:
        d["prompts"] = str(DEFAULT_CONFIG.parent / d["prompts"])
    (tmp_path / "tok").mkdir()
    raw["target"] = {"tokenizer": "../tok", "profile": "kimi-k2.5", "model_config": "target.json"}
    p = tmp_path / "conf" / "pipeline.yaml"
    p.parent.mkdir()
    p.write_text(yaml.safe_dump(raw))
    target = load_config(p).target
    assert target.tokenizer == str(tmp_path / "tok") and target.model_config == str(p.parent / "target.json")
    raw["target"]["tokenizer"] = "moonshotai/Kimi-K2.5"  # a hub id stays as it is
    p.write_text(yaml.safe_dump(raw))
    assert load_config(p).target.tokenizer == "moonshotai/Kimi-K2.5"
    raw["target"] = {"tokenizer": str(tmp_path / "absent"), "profile": "kimi"}
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    assert exc.value.problems == [  # in file order (safe_dump sorts the keys)
        f"target.profile: unknown model profile 'kimi'; known: ['kimi-k2.5', 'qwen3'] (line {_line_of(p, 'profile:')})",
        f"target.tokenizer: directory not found: {tmp_path / 'absent'} (line {_line_of(p, 'tokenizer:')})",
    ]


def test_on_settings_change_takes_refuse_or_redo(tmp_path):
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    for d in raw["datasets"]:
        d["prompts"] = str(DEFAULT_CONFIG.parent / d["prompts"])
    assert load_config(DEFAULT_CONFIG).hidden_states.on_settings_change == "refuse"  # the safe default
    raw["hidden_states"]["on_settings_change"] = "overwrite"
    p = tmp_path / "pipeline.yaml"
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"hidden_states\.on_settings_change") as exc:
        load_config(p)
    assert len(exc.value.problems) == 1
    raw["hidden_states"]["on_settings_change"] = "redo"
    p.write_text(yaml.safe_dump(raw))
    assert load_config(p).hidden_states.on_settings_change == "redo"


def _with_hidden_states(tmp_path: Path, hidden_states: dict) -> Path:
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    for d in raw["datasets"]:
        d["prompts"] = str(DEFAULT_CONFIG.parent / d["prompts"])
    raw["hidden_states"].update(hidden_states)
    p = tmp_path / "pipeline.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def test_vllm_engine_keys_parse_with_defaults(tmp_path):
    assert load_config(DEFAULT_CONFIG).hidden_states.engine == "in_process"
    cfg = load_config(
        _with_hidden_states(tmp_path, {"engine": "vllm", "vllm": {"endpoints": ["http://gpu-node-0:8000"]}})
    )
    v = cfg.hidden_states.vllm
    assert cfg.hidden_states.engine == "vllm" and v.endpoints == ("http://gpu-node-0:8000",)
    assert (v.storage_path, v.concurrency, v.timeout_s, v.max_retries) == ("/dev/shm/hidden_states", 8, 600.0, 4)
    rel = load_config(
        _with_hidden_states(tmp_path, {"engine": "vllm", "vllm": {"endpoints": ["simulated"], "storage_path": "st"}})
    )
    assert rel.hidden_states.vllm.storage_path == str((tmp_path / "st").resolve())


def test_vllm_engine_problems_name_their_paths(tmp_path):
    bad = {
        "engine": "vllm",
        "vllm": {"endpoints": [], "concurrency": 0, "timeout_s": -1, "max_retries": -2, "colour": 1},
    }
    with pytest.raises(ConfigError) as exc:
        load_config(_with_hidden_states(tmp_path, bad))
    text = str(exc.value)
    for expected in (
        "hidden_states.vllm.endpoints: required for engine 'vllm'",
        "hidden_states.vllm.concurrency: must be >= 1",
        "hidden_states.vllm.timeout_s: must be > 0",  # 0.0
        "hidden_states.vllm.max_retries: must be >= 0",
        "hidden_states.vllm.colour: unknown key",
    ):
        assert expected in text
    with pytest.raises(ConfigError, match=r"hidden_states.vllm.endpoints: expected http\(s\):// base URLs"):
        load_config(_with_hidden_states(tmp_path, {"engine": "vllm", "vllm": {"endpoints": ["gpu-node-0:8000"]}}))
    with pytest.raises(
        ConfigError, match=r"hidden_states.engine: must be one of 'in_process', 'vllm' or 'torchrun', got 'sglang'"
    ):
        load_config(_with_hidden_states(tmp_path, {"engine": "sglang"}))
    t = load_config(_with_hidden_states(tmp_path, {"engine": "torchrun", "torchrun": {"tp_size": 4, "ep_size": 4}}))
    assert (t.hidden_states.torchrun.tp_size, t.hidden_states.torchrun.ep_size) == (4, 4)
    for ep in (2, 3):  # transformers 5.24 refuses DistributedConfig(tp_size=4, ep_size=2) at load, on every rank
        with pytest.raises(ConfigError, match=r"hidden_states.torchrun.ep_size: must be 1 or tp_size \(4\)"):
            load_config(
                _with_hidden_states(tmp_path, {"engine": "torchrun", "torchrun": {"tp_size": 4, "ep_size": ep}})
            )


def test_hidden_states_layout_and_audit_keys(tmp_path):
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    for d in raw["datasets"]:
        d["prompts"] = str(DEFAULT_CONFIG.parent / d["prompts"])
    p = tmp_path / "pipeline.yaml"
    cfg = load_config(DEFAULT_CONFIG).hidden_states
    assert (cfg.layout, cfg.trainer_layouts, cfg.texts_by_extraction_model, cfg.teacher_min_top1) == (
        "shards",
        ("specforge", "speculators"),
        None,
        None,
    )
    raw["hidden_states"].update(layout="speculators", trainer_layouts=["specforge"], texts_by_extraction_model=False)
    p.write_text(yaml.safe_dump(raw))
    cfg = load_config(p).hidden_states
    assert (cfg.layout, cfg.trainer_layouts, cfg.texts_by_extraction_model) == ("speculators", ("specforge",), False)
    raw["hidden_states"].update(layout="tarball", trainer_layouts=["megatron"], teacher_min_top1=1.5)
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    for needle in ("hidden_states.layout", "hidden_states.trainer_layouts", "hidden_states.teacher_min_top1"):
        assert needle in str(exc.value)


def test_settings_defaults_are_the_cores():
    """A setting's default is the core's own where the core has one: the file and the Python API agree."""
    from eagle_pipeline.generation.summary import DEFAULT_PROGRESS_EVERY_S
    from eagle_pipeline.hidden_states.engines.engine_torchrun import TorchrunShard
    from eagle_pipeline.hidden_states.run import extract_shard
    from eagle_pipeline.hidden_states.settings import DEFAULT_MAX_TOKENS_PER_BATCH

    assert HiddenStatesConfig().max_tokens_per_batch == DEFAULT_MAX_TOKENS_PER_BATCH == 8192
    assert extract_shard.__kwdefaults__["max_tokens_per_batch"] == DEFAULT_MAX_TOKENS_PER_BATCH
    assert TorchrunShard.__dataclass_fields__["max_tokens_per_batch"].default == DEFAULT_MAX_TOKENS_PER_BATCH
    assert GenerationSettings().progress_every_s == DEFAULT_PROGRESS_EVERY_S == 30.0
    assert PipelineConfig.__pydantic_fields__["merge"].get_default(call_default_factory=True) == MergeSettings()
