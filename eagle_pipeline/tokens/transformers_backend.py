"""Any transformers tokenizer (Qwen3 and others) behind `TargetTokenizer`.

Importing this module imports transformers, which takes seconds: `loading.py` imports it only when a tokenizer
directory without `tiktoken.model`, or a hub id, asks for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from transformers import AutoTokenizer

from .tokenizer import TargetTokenizer, TokenizerBackend, TokenizerLoadError


def _byte_decoder() -> dict[str, int]:
    # GPT-2 byte-level alphabet: printable latin-1 bytes stand for themselves, the rest are shifted to U+0100 and up.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping: dict[str, int] = {chr(b): b for b in keep}
    n = 0
    for b in range(256):
        if b not in keep:
            mapping[chr(256 + n)] = b
            n += 1
    return mapping


class TransformersBackend(TokenizerBackend):
    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.added = {int(i): t.content for i, t in tok.added_tokens_decoder.items()}
        backend = getattr(tok, "backend_tokenizer", None)
        self.fast = backend
        self.ordinary = None
        self.byte_level = False
        if backend is not None:
            spec = json.loads(backend.to_str())
            # Without its added tokens the backend encodes every string, specials included, as plain text.
            spec["added_tokens"] = []
            self.ordinary = Tokenizer.from_str(json.dumps(spec))
            self.byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
            self._spec_text = backend.to_str()
        self._bytes_of = _byte_decoder()

    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
        if self.ordinary is not None:
            return [e.ids for e in self.ordinary.encode_batch(texts, add_special_tokens=False)]
        return [self.tok.encode(t, add_special_tokens=False, split_special_tokens=True) for t in texts]

    def encode_with_specials(self, text: str) -> list[int]:
        if self.fast is not None:
            return self.fast.encode(text, add_special_tokens=False).ids
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def decode_bytes(self, ids: list[int]) -> bytes:
        if not self.byte_level:
            return self.decode(ids).encode("utf-8")
        out = bytearray()
        pieces = self.tok.convert_ids_to_tokens(ids)
        for i, piece in zip(ids, pieces):
            if i in self.added:
                out += self.added[i].encode("utf-8")
            else:
                try:
                    out += bytes(self._bytes_of[c] for c in piece)
                except KeyError:
                    out += piece.encode("utf-8")
        return bytes(out)

    def single_token(self, token: str) -> int | None:
        ids = self.encode_ordinary_batch([token])[0]
        return ids[0] if len(ids) == 1 else None

    def hash_into(self, h: Any) -> None:
        h.update(b"transformers\n")
        if self.fast is not None:
            h.update(self._spec_text.encode())
        else:
            h.update(json.dumps(sorted(self.tok.get_vocab().items()), ensure_ascii=False).encode())


def load_transformers(spec: str, *, allow_download: bool) -> TargetTokenizer:
    """A transformers AutoTokenizer behind TargetTokenizer (local files only unless allow_download=True)."""
    try:
        tok = AutoTokenizer.from_pretrained(spec, local_files_only=not allow_download)
    except Exception as exc:  # transformers raises many types (OSError, ValueError, EnvironmentError, ...)
        hint = "" if allow_download else " (offline: only local directories and the local HF cache are used)"
        raise TokenizerLoadError(f"{spec}: cannot load a transformers tokenizer{hint}: {exc}") from exc
    template = tok.chat_template
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    template_vars = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tok, key, None)
        if isinstance(value, str):
            template_vars[key] = value
    specials = {t.content: int(i) for i, t in tok.added_tokens_decoder.items()}
    return TargetTokenizer(
        name=Path(spec).name if Path(spec).exists() else str(spec),
        kind="transformers",
        source=str(spec),
        vocab_size=len(tok),
        special_tokens=specials,
        chat_template=template,
        backend=TransformersBackend(tok),
        template_vars=template_vars,
    )
