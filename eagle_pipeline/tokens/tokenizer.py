"""Target tokenizers: the real Kimi-K2/K2.5 tiktoken encoding, the built-in demo tokenizer, or any transformers tokenizer.

Everything downstream (rendering, reconstruction, audits, merge) talks to one `TargetTokenizer` interface, whatever
the backend. The Kimi encoding is built directly with tiktoken from the files in the tokenizer directory, so Moonshot's
Python tokenizer code (and trust_remote_code) is never needed.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import regex

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
# non-whitespace chars). We mirror it so ids equal HF `encode` even on pathological inputs; it also keeps tiktoken's
# BPE away from its slow path on huge single pieces.
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
            run_end = end_re.match(window, run_start).end()
            for cut in range(run_start + _MAX_RUN, run_end, _MAX_RUN):
                out.append(window[start:cut])
                start = cut
        out.append(window[start:])
    return out


def literal_alternation(words: Iterable[str]) -> str:
    """A regex matching any of `words` (longest first at a position), factored as a trie so matching at a position
    costs one pass over the candidate instead of one comparison per word (Python's `re` does no such factoring)."""
    trie: dict[str, Any] = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: dict[str, Any]) -> str:
        # Branches start with distinct characters, so at most one can match; a word ending here makes the
        # continuation optional (greedy), so the longest special wins.
        branches = [re.escape(ch) + emit(child) for ch, child in sorted(node.items()) if ch]
        optional = "" in node
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if optional else body

    return emit(trie) if trie else r"(?!x)x"


class TokenizerLoadError(ValueError):
    """A tokenizer could not be loaded; the message names the path or hub id and the problem."""


class TargetTokenizer:
    """The target model's tokenizer behind one interface (tiktoken-based Kimi/demo, or transformers).

    Attributes: name, kind ('kimi-tiktoken' | 'demo' | 'transformers'), vocab_size, special_tokens (string -> id),
    chat_template, source (path or hub id), template_vars (bos_token, eos_token, ... passed to the chat template).
    """

    def __init__(
        self,
        *,
        name: str,
        kind: str,
        source: str,
        vocab_size: int,
        special_tokens: Mapping[str, int],
        chat_template: str | None,
        backend: _Backend,
        template_vars: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.kind = kind
        self.source = source
        self.vocab_size = int(vocab_size)
        self.special_tokens: dict[str, int] = dict(special_tokens)
        self.chat_template = chat_template
        self.template_vars: dict[str, str] = dict(template_vars or {})
        self._backend = backend
        self._id_to_special = {v: k for k, v in self.special_tokens.items()}
        ids = np.array(sorted(self._id_to_special), dtype=np.int64)
        self.special_ids: np.ndarray = ids
        # A contiguous block of special ids (tiktoken layouts) allows a range test instead of np.isin.
        self._special_range = (int(ids[0]), int(ids[-1]) + 1) if len(ids) and ids[-1] - ids[0] + 1 == len(ids) else None
        # Compiled up front: worker threads use it (see encode_ordinary_arrays_flagged).
        self._special_re: Any = regex.compile(literal_alternation(self.special_tokens))
        self._fingerprint: str | None = None

    def __repr__(self) -> str:
        return f"TargetTokenizer(name={self.name!r}, kind={self.kind!r}, vocab_size={self.vocab_size}, source={self.source!r})"

    # -- encoding -------------------------------------------------------------------------------------------------
    def encode_ordinary(self, text: str) -> list[int]:
        """Encode text with every special-token string treated as plain text."""
        return self._backend.encode_ordinary_batch([text])[0]

    def encode_ordinary_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode_ordinary` over many texts at once (threaded / Rust-parallel)."""
        if not texts:
            return []
        return self._backend.encode_ordinary_batch(list(texts))

    def encode_ordinary_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode_ordinary_batch` returning one integer numpy array per text (no Python int per token)."""
        if not texts:
            return []
        return self._backend.encode_ordinary_arrays(list(texts))

    def encode_ordinary_arrays_flagged(self, texts: Sequence[str]) -> tuple[list[np.ndarray], list[bool]]:
        """`encode_ordinary_arrays` plus, per text, `contains_special_string` (computed in the same worker threads)."""
        texts = list(texts)
        if not texts:
            return [], []
        be = self._backend
        if isinstance(be, _TiktokenBackend):
            check = self.contains_special_string
            pairs = _map_chunked(lambda t: (be._ordinary_array(t), check(t)), texts)
            return [p[0] for p in pairs], [p[1] for p in pairs]
        return be.encode_ordinary_arrays(texts), [self.contains_special_string(t) for t in texts]

    def encode_with_specials(self, text: str) -> list[int]:
        """Encode text with every special-token string mapped to its special id (for rendered prompts)."""
        return self._backend.encode_with_specials(text)

    # -- decoding -------------------------------------------------------------------------------------------------
    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids to text; special ids become their strings, invalid UTF-8 becomes U+FFFD."""
        return self._backend.decode(_as_int_list(ids))

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Decode ids to raw bytes (specials as their UTF-8 strings)."""
        return self._backend.decode_bytes(_as_int_list(ids))

    # -- lookups --------------------------------------------------------------------------------------------------
    def token_id(self, token: str) -> int:
        """The id of a special token or of a string that is exactly one ordinary token; KeyError otherwise."""
        if token in self.special_tokens:
            return self.special_tokens[token]
        found = self._backend.single_token(token)
        if found is None:
            raise KeyError(f"{token!r} is not a single token of tokenizer {self.name!r} ({self.kind}, {self.source})")
        return found

    def is_special_id(self, ids: Any) -> np.ndarray:
        """Boolean mask: which of `ids` are special-token ids."""
        a = np.asarray(ids)
        if self._special_range is not None:
            lo, hi = self._special_range
            return (a >= lo) & (a < hi)
        return np.isin(a, self.special_ids)

    def special_string_pattern(self) -> Any:
        """A compiled `regex` pattern matching any special-token string (longest first)."""
        return self._special_re

    def contains_special_string(self, text: str | None) -> bool:
        """True when `text` contains a literal special-token string."""
        # `regex` with concurrent=True releases the GIL, so scans in worker threads overlap with encoding.
        return bool(text) and self.special_string_pattern().search(text, concurrent=True) is not None

    def fingerprint(self) -> str:
        """sha256 over the vocabulary, the special tokens and the pre-tokenizer: identifies the encoding for provenance."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            self._backend.hash_into(h)
            for name, i in sorted(self.special_tokens.items(), key=lambda kv: kv[1]):
                h.update(f"special {i} {name}\n".encode())
            self._fingerprint = h.hexdigest()
        return self._fingerprint


def _as_int_list(ids: Iterable[int]) -> list[int]:
    if isinstance(ids, np.ndarray):
        return ids.astype(np.int64, copy=False).tolist()
    return [int(i) for i in ids]


class _Backend:
    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def encode_ordinary_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int32) for ids in self.encode_ordinary_batch(texts)]

    def encode_with_specials(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def decode_bytes(self, ids: list[int]) -> bytes:
        raise NotImplementedError

    def single_token(self, token: str) -> int | None:
        raise NotImplementedError

    def hash_into(self, h: Any) -> None:
        raise NotImplementedError


_NUM_THREADS = max(1, min(8, os.cpu_count() or 1))
# Below this many characters a batch is encoded in the calling thread: handing work to threads costs more.
_SERIAL_CHARS = 32_768
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _map_chunked(fn: Callable[[str], Any], texts: list[str]) -> list[Any]:
    """fn over texts, in order, on a shared thread pool (tiktoken releases the GIL while encoding)."""
    global _pool
    if _NUM_THREADS == 1 or len(texts) < 2 or sum(map(len, texts)) < _SERIAL_CHARS:
        return [fn(t) for t in texts]
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_NUM_THREADS, thread_name_prefix="eagle-tok")
    # A few chunks per thread: few futures (cheap) yet balanced when text lengths vary.
    n_chunks = min(len(texts), 4 * _NUM_THREADS)
    step = -(-len(texts) // n_chunks)
    chunks = [texts[i : i + step] for i in range(0, len(texts), step)]
    out: list[Any] = []
    for part in _pool.map(lambda chunk: [fn(t) for t in chunk], chunks):
        out.extend(part)
    return out


def _fix_surrogates(text: str) -> str:
    # Lone surrogates cannot be UTF-8 encoded; tiktoken's encode_ordinary replaces them the same way.
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


class _TiktokenBackend(_Backend):
    def __init__(self, enc: Any, pat_str: str, tokens_by_rank: list[bytes], specials: Mapping[str, int]) -> None:
        self.enc = enc
        self.pat_str = pat_str
        self.tokens_by_rank = tokens_by_rank
        self._all_special = enc.special_tokens_set
        self._special_ids = dict(specials)
        self._special_split = re.compile("(" + literal_alternation(self._special_ids) + ")") if specials else None

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
        return _map_chunked(self._ordinary_list, texts)

    def encode_ordinary_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return _map_chunked(self._ordinary_array, texts)

    def encode_with_specials(self, text: str) -> list[int]:
        if len(text) > _MAX_RUN or self._special_split is None:
            allowed = self._all_special
            ids: list[int] = []
            for part in split_like_kimi(text):
                ids.extend(self.enc.encode(part, allowed_special=allowed, disallowed_special=()))
            return ids
        # Same ids as tiktoken with allowed_special="all" (splitting at specials, then ordinary encoding of the
        # pieces; no Kimi special is a prefix of another, and where one is, the longest wins), without handing
        # tiktoken the 256-string set on every call, which dominated the cost of short prompts.
        out: list[int] = []
        for i, piece in enumerate(self._special_split.split(text)):
            if i % 2:
                out.append(self._special_ids[piece])
            elif piece:
                out.extend(self.enc.encode_ordinary(piece))
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
) -> TargetTokenizer:
    """Build a TargetTokenizer on a tiktoken Encoding; specials get ids len(ranks) + i in `special_names` order."""
    import tiktoken

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
        backend=_TiktokenBackend(enc, pat_str, _sorted_token_bytes(ranks), specials),
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


def _read_kimi_specials(config_path: Path, first_id: int) -> list[str]:
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
    return names


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
    names = _read_kimi_specials(config_path, len(ranks))
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
    )


# -- transformers backend -----------------------------------------------------------------------------------------------


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


class _HFBackend(_Backend):
    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.added = {int(i): t.content for i, t in tok.added_tokens_decoder.items()}
        backend = getattr(tok, "backend_tokenizer", None)
        self.fast = backend
        self.ordinary = None
        self.byte_level = False
        if backend is not None:
            from tokenizers import Tokenizer

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


def _load_transformers(spec: str, *, allow_download: bool) -> TargetTokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - transformers is a dependency
        raise TokenizerLoadError(f"{spec}: transformers is not installed") from exc
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
        backend=_HFBackend(tok),
        template_vars=template_vars,
    )


# -- public loaders ---------------------------------------------------------------------------------------------------


def load_tokenizer(spec: str | os.PathLike, *, allow_download: bool = False) -> TargetTokenizer:
    """Load a tokenizer: a directory holding `tiktoken.model` -> the Kimi tiktoken encoding; any other directory or
    a hub id -> transformers AutoTokenizer (local files only unless allow_download=True)."""
    spec_str = str(spec)
    path = Path(spec_str).expanduser()
    if path.is_dir():
        model = path / "tiktoken.model"
        if model.exists():
            st = model.stat()
            return _load_kimi_cached(str(path.resolve()), (st.st_mtime_ns, st.st_size))
        return _load_transformers(str(path), allow_download=False)
    if path.exists():
        raise TokenizerLoadError(f"{path}: expected a tokenizer directory, got a file")
    # A hub id is 'name' or 'org/name'; anything else that does not exist is a missing directory.
    if spec_str.startswith((".", "/", "~")) or spec_str.count("/") > 1 or "\\" in spec_str:
        raise TokenizerLoadError(f"{path}: tokenizer directory not found")
    return _load_transformers(spec_str, allow_download=allow_download)


def resolve_tokenizer(spec: str | os.PathLike | None, *, allow_download: bool = False) -> TargetTokenizer:
    """None or 'demo' -> the demo tokenizer; 'env:VAR' -> the directory in $VAR if set and present, else demo;
    anything else -> load_tokenizer(spec). Check `.kind` to see which was chosen."""
    from .demo import build_demo_tokenizer

    if spec is None or str(spec) == "demo":
        return build_demo_tokenizer()
    spec_str = str(spec)
    if spec_str.startswith("env:"):
        var = spec_str[4:]
        if not var:
            raise TokenizerLoadError("tokenizer spec 'env:' needs a variable name, e.g. env:EAGLE_KIMI_TOKENIZER_DIR")
        value = os.environ.get(var)
        if value and Path(value).expanduser().is_dir():
            return load_tokenizer(Path(value).expanduser(), allow_download=allow_download)
        return build_demo_tokenizer()
    return load_tokenizer(spec_str, allow_download=allow_download)
