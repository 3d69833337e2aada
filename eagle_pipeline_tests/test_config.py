from pathlib import Path

import pytest
import yaml

from eagle_pipeline.config import DEFAULT_CONFIG, ConfigError, load_config


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
        },
        "datasets": [
            {"name": "B1", "prompts": "missing.jsonl", "domain": "coding", "backend": "nope", "limit": 0},
            {"name": "B1", "prompts": "missing.jsonl", "domain": "coding", "backend": "or", "max_tokens": "many"},
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
        "datasets[0].prompts: file not found",
        "datasets[0].backend: unknown backend 'nope'",
        "datasets[0].limit: must be >= 1",
        "datasets[1].name: duplicate dataset name 'B1'",
        "datasets[1].max_tokens: expected int",
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
