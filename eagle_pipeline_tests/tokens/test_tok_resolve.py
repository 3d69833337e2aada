"""resolve_tokenizer: 'demo', None, 'env:VAR' (with and without the variable), and explicit paths."""

from __future__ import annotations

import pytest

from eagle_pipeline.tokens import TokenizerLoadError, resolve_tokenizer


def test_demo_specs(demo):
    assert resolve_tokenizer(None) is resolve_tokenizer("demo")
    assert resolve_tokenizer("demo").kind == "demo"
    assert resolve_tokenizer("demo").fingerprint() == demo.fingerprint()


def test_env_spec_unset_or_missing_falls_back_to_demo(monkeypatch, tmp_path):
    monkeypatch.delenv("EAGLE_TEST_TOK_DIR", raising=False)
    assert resolve_tokenizer("env:EAGLE_TEST_TOK_DIR").kind == "demo"
    monkeypatch.setenv("EAGLE_TEST_TOK_DIR", str(tmp_path / "absent"))
    assert resolve_tokenizer("env:EAGLE_TEST_TOK_DIR").kind == "demo"
    with pytest.raises(TokenizerLoadError, match="variable name"):
        resolve_tokenizer("env:")


def test_env_spec_set(monkeypatch, kimi_dir, kimi):
    monkeypatch.setenv("EAGLE_TEST_TOK_DIR", str(kimi_dir))
    tok = resolve_tokenizer("env:EAGLE_TEST_TOK_DIR")
    assert tok.kind == "kimi-tiktoken" and tok.vocab_size == 163840
    assert tok is kimi  # loads are cached per directory and file stamp
    assert resolve_tokenizer(str(kimi_dir)) is kimi


def test_file_instead_of_directory(tmp_path):
    f = tmp_path / "tiktoken.model"
    f.write_text("")
    with pytest.raises(TokenizerLoadError, match="expected a tokenizer directory"):
        resolve_tokenizer(str(f))
