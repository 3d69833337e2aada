"""The Kimi-K2/K2.5 encoding: tiktoken built from the files in a tokenizer directory, with Kimi's own pre-splitting.

The encoding is built directly with tiktoken from `tiktoken.model`, the special-token names in
`tokenizer_config.json` and the pre-tokenizer regex (FACTS.md), so Moonshot's Python tokenizer code (and
trust_remote_code) is never needed. The tiktoken backend here also serves the demo tokenizer, which shares Kimi's
structure (`demo.py`).
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tiktoken

from .tokenizer import TargetTokenizer, TokenizerBackend, TokenizerLoadError, literal_alternation, map_chunked

# The Kimi pre-tokenizer regex (FACTS.md §1). tiktoken's Rust engine (fancy-regex on top of the `regex` crate) accepts
# the `&&` class intersection natively, so this string is given to tiktoken unchanged; the test suite proves that its
# pieces equal those of the Python `regex` module with the V1 flag.
KIMI_PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

KIMI_NUM_SPECIAL = 256
KIMI_RANKS_COUNT = 163_584
KIMI_VOCAB_SIZE = KIMI_RANKS_COUNT + KIMI_NUM_SPECIAL

# Named Kimi special tokens by offset from the first special id (163584); FACTS.md §2. Unnamed offsets are reserved.
KIMI_NAMED_SPECIALS: dict[int, str] = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    22: "<think>",
    23: "</think>",
    254: "[UNK]",
    255: "[PAD]",
}


def kimi_special_names() -> list[str]:
    """The 256 Kimi special-token names in id order; reserved slots are named by their *Kimi* id (163584 + i)."""
    return [KIMI_NAMED_SPECIALS.get(i, f"<|reserved_token_{KIMI_RANKS_COUNT + i}|>") for i in range(KIMI_NUM_SPECIAL)]


# Kimi's Python tokenizer cuts text before calling tiktoken (400k-char windows, and runs of more than 25k whitespace or
# non-whitespace chars). We mirror it so ids equal Moonshot's even on pathological inputs; it also keeps tiktoken's
# BPE away from its slow path on huge single pieces. The cut applies to each piece of text between special tokens
# on its own (see TiktokenBackend.encode_with_specials), never across one.
_WINDOW_CHARS = 400_000
_MAX_RUN = 25_000
# `re`'s \s on str patterns is exactly str.isspace (tested), which is what Kimi's splitter uses. The lookbehinds make
# each run be tried only from its start, so the scan is linear.
_LONG_RUN_RE = re.compile(rf"(?<!\S)\S{{{_MAX_RUN + 1}}}|(?<!\s)\s{{{_MAX_RUN + 1}}}")
_RUN_END_S = re.compile(r"\s*")
_RUN_END_NS = re.compile(r"\S*")


def split_like_kimi(text: str) -> list[str]:
    """Cut `text` the way Kimi's HF tokenizer does before tiktoken; concatenating the result gives `text` back."""
    if len(text) <= _MAX_RUN:
        return [text]
    out: list[str] = []
    for w in range(0, len(text), _WINDOW_CHARS):
        window = text[w : w + _WINDOW_CHARS]
        start = 0
        for m in _LONG_RUN_RE.finditer(window):
            run_start = m.start()
            end_re = _RUN_END_S if window[run_start].isspace() else _RUN_END_NS
            run_end = m.end()
            if (rest := end_re.match(window, run_end)) is not None:  # `*` always matches; None is for the type checker
                run_end = rest.end()
            for cut in range(run_start + _MAX_RUN, run_end, _MAX_RUN):
                out.append(window[start:cut])
                start = cut
        out.append(window[start:])
    return out


def _fix_surrogates(text: str) -> str:
    # Lone surrogates cannot be UTF-8 encoded; tiktoken's encode_ordinary replaces them the same way.
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


class TiktokenBackend(TokenizerBackend):
    """tiktoken with Kimi's pre-splitting of long texts.

    `added_tokens` are the special strings Moonshot's tokenizer registers as added tokens (`added_tokens_decoder`);
    like it, `encode_with_specials` splits at them before anything else (default: every special).
    """

    def __init__(
        self,
        enc: Any,
        pat_str: str,
        tokens_by_rank: list[bytes],
        specials: Mapping[str, int],
        added_tokens: Sequence[str] | None = None,
    ) -> None:
        self.enc = enc
        self.pat_str = pat_str
        self.tokens_by_rank = tokens_by_rank
        self._special_ids = dict(specials)
        self._special_split = re.compile("(" + literal_alternation(self._special_ids) + ")") if specials else None
        added = self._special_ids if added_tokens is None else added_tokens
        self._added_split = re.compile("(" + literal_alternation(added) + ")") if added else None

    # Each text is cut like Kimi's tokenizer does (a no-op below 25k chars) and the pieces' ids concatenated.
    def _ordinary_list(self, text: str) -> list[int]:
        if len(text) <= _MAX_RUN:
            return self.enc.encode_ordinary(text)
        ids: list[int] = []
        for part in split_like_kimi(text):
            ids.extend(self.enc.encode_ordinary(part))
        return ids

    def _ordinary_array(self, text: str) -> np.ndarray:
        if len(text) > _MAX_RUN:
            parts = split_like_kimi(text)
            if len(parts) > 1:
                return np.concatenate([self._ordinary_array(p) for p in parts])
        try:
            # The numpy buffer skips building a Python int per token; an empty allowed set = ordinary encoding.
            ids = self.enc.encode_to_numpy(text, allowed_special=frozenset(), disallowed_special=())
        except UnicodeEncodeError:
            ids = self.enc.encode_to_numpy(_fix_surrogates(text), allowed_special=frozenset(), disallowed_special=())
        return ids.view(np.int32)  # ids < 2**31: reinterpreting the uint32 buffer is exact and free

    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
        return map_chunked(self._ordinary_list, texts)

    def encode_ordinary_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return map_chunked(self._ordinary_array, texts)

    def encode_ordinary_arrays_flagged(
        self, texts: list[str], flag: Callable[[str], bool]
    ) -> tuple[list[np.ndarray], list[bool]]:
        pairs = map_chunked(lambda t: (self._ordinary_array(t), flag(t)), texts)
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def _encode_all_specials(self, text: str) -> list[int]:
        # Same ids as tiktoken's encode(text, allowed_special="all") (split at specials, ordinary encoding of the
        # pieces; no Kimi special is a prefix of another, and where one is, the longest wins), without handing
        # tiktoken the 256-string set on every call, which dominated the cost of short prompts.
        assert self._special_split is not None
        out: list[int] = []
        for i, piece in enumerate(self._special_split.split(text)):
            if i % 2:
                out.append(self._special_ids[piece])
            elif piece:
                out.extend(self.enc.encode_ordinary(piece))
        return out

    def encode_with_specials(self, text: str) -> list[int]:
        """Moonshot's `tokenizer(text)` / `apply_chat_template`: split at the added tokens first, then cut each
        piece between them like Kimi does and encode every part with all specials allowed. Cutting the whole text
        first (Moonshot's bare `encode(text)`) could cut a special token in two, which would then be plain text."""
        if self._special_split is None:
            return self._ordinary_list(text)
        if len(text) <= _MAX_RUN:
            return self._encode_all_specials(text)
        out: list[int] = []
        for i, piece in enumerate(self._added_split.split(text) if self._added_split else [text]):
            if i % 2:
                out.append(self._special_ids[piece])
            elif piece:
                for part in split_like_kimi(piece):
                    out.extend(self._encode_all_specials(part))
        return out

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids, errors="replace")

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self.enc.decode_bytes(ids)

    def single_token(self, token: str) -> int | None:
        try:
            return self.enc.encode_single_token(token.encode("utf-8"))
        except KeyError:
            return None

    def hash_into(self, h: Any) -> None:
        h.update(b"tiktoken\n")
        h.update(self.pat_str.encode())
        h.update(b"\n")
        # Ranks are contiguous from 0 (checked at load), so hashing tokens in rank order identifies the mapping.
        for tok in self.tokens_by_rank:
            h.update(len(tok).to_bytes(2, "little"))
            h.update(tok)


def _sorted_token_bytes(ranks: Mapping[bytes, int]) -> list[bytes]:
    out: list[bytes] = [b""] * len(ranks)
    for tok, r in ranks.items():
        out[r] = tok
    return out


def tiktoken_tokenizer(
    *,
    name: str,
    kind: str,
    source: str,
    ranks: Mapping[bytes, int],
    special_names: Sequence[str],
    pat_str: str,
    chat_template: str | None,
    template_vars: Mapping[str, str] | None = None,
    added_tokens: Sequence[str] | None = None,
) -> TargetTokenizer:
    """Build a TargetTokenizer on a tiktoken Encoding; specials get ids len(ranks) + i in `special_names` order.

    `added_tokens`: the specials a prompt is split at before Kimi's long-text cuts (see TiktokenBackend); default all.
    """
    specials = {s: len(ranks) + i for i, s in enumerate(special_names)}
    if len(specials) != len(special_names):
        raise TokenizerLoadError(f"{source}: duplicate special-token names")
    enc = tiktoken.Encoding(name=name, pat_str=pat_str, mergeable_ranks=dict(ranks), special_tokens=specials)
    return TargetTokenizer(
        name=name,
        kind=kind,
        source=source,
        vocab_size=len(ranks) + len(specials),
        special_tokens=specials,
        chat_template=chat_template,
        backend=TiktokenBackend(enc, pat_str, _sorted_token_bytes(ranks), specials, added_tokens),
        template_vars=template_vars,
    )


# -- Kimi loader ------------------------------------------------------------------------------------------------------


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken rank file (`base64 SP rank` per line); ranks must be unique and contiguous from 0."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TokenizerLoadError(f"{path}: cannot read rank file ({exc})") from exc
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), start=1):
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TokenizerLoadError(f"{path}:{lineno}: expected 'base64 rank', got {line[:60]!r}")
        try:
            tok = base64.b64decode(parts[0], validate=True)
            rank = int(parts[1])
        except (binascii.Error, ValueError) as exc:
            raise TokenizerLoadError(f"{path}:{lineno}: malformed entry {line[:60]!r} ({exc})") from exc
        if tok in ranks:
            raise TokenizerLoadError(f"{path}:{lineno}: duplicate token {tok!r}")
        ranks[tok] = rank
    if not ranks:
        raise TokenizerLoadError(f"{path}: empty rank file")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerLoadError(f"{path}: ranks are not unique and contiguous from 0")
    return ranks


def _read_kimi_specials(config_path: Path, first_id: int) -> tuple[list[str], list[str]]:
    """The 256 special names in id order, and the names `added_tokens_decoder` registers (HF's added tokens)."""
    names = [f"<|reserved_token_{first_id + i}|>" for i in range(KIMI_NUM_SPECIAL)]
    if not config_path.exists():
        raise TokenizerLoadError(f"{config_path}: missing (needed for the special-token names)")
    try:
        cfg = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerLoadError(f"{config_path}: unreadable or invalid JSON ({exc})") from exc
    decoder = cfg.get("added_tokens_decoder") if isinstance(cfg, dict) else None
    if not isinstance(decoder, dict):
        raise TokenizerLoadError(f"{config_path}: no 'added_tokens_decoder' object")
    added: list[str] = []
    for key, entry in decoder.items():
        try:
            tid = int(key)
            content = entry["content"]
        except (ValueError, TypeError, KeyError) as exc:
            raise TokenizerLoadError(f"{config_path}: bad added_tokens_decoder entry {key!r}") from exc
        if not first_id <= tid < first_id + KIMI_NUM_SPECIAL:
            raise TokenizerLoadError(
                f"{config_path}: added token {content!r} has id {tid}, outside the special range "
                f"{first_id}..{first_id + KIMI_NUM_SPECIAL - 1}"
            )
        names[tid - first_id] = content
        added.append(content)
    return names, added


def _read_template(directory: Path, config_path: Path) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    if config_path.exists():
        cfg = json.loads(config_path.read_text(encoding="utf-8"))
        tpl = cfg.get("chat_template")
        if isinstance(tpl, list):  # HF's named-template form
            named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
            tpl = named.get("default") or next(iter(named.values()), None)
        if isinstance(tpl, str):
            return tpl
    return None


@functools.lru_cache(maxsize=4)
def _load_kimi_cached(directory: str, _stamp: tuple[int, int]) -> TargetTokenizer:
    d = Path(directory)
    ranks = read_tiktoken_ranks(d / "tiktoken.model")
    config_path = d / "tokenizer_config.json"
    names, added = _read_kimi_specials(config_path, len(ranks))
    template_vars: dict[str, str] = {}
    try:
        cfg = json.loads(config_path.read_text(encoding="utf-8"))
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            if isinstance(cfg.get(key), str):
                template_vars[key] = cfg[key]
    except (OSError, json.JSONDecodeError):  # already reported by _read_kimi_specials
        pass
    return tiktoken_tokenizer(
        name=d.name or "kimi",
        kind="kimi-tiktoken",
        source=str(d),
        ranks=ranks,
        special_names=names,
        pat_str=KIMI_PAT_STR,
        chat_template=_read_template(d, config_path),
        template_vars=template_vars,
        added_tokens=added,
    )


def load_kimi_directory(directory: Path) -> TargetTokenizer:
    """The Kimi encoding of a directory holding `tiktoken.model` and `tokenizer_config.json` (cached until the rank
    file changes)."""
    st = (directory / "tiktoken.model").stat()
    return _load_kimi_cached(str(directory.resolve()), (st.st_mtime_ns, st.st_size))
