"""The `TargetTokenizer` interface: one object for the target's tokenizer, whatever encodes underneath.

Everything downstream (rendering, reconstruction, audits, merge) talks to `TargetTokenizer`. The encodings live
elsewhere: the Kimi tiktoken encoding (and the demo tokenizer built on it) in `kimi.py`, any transformers tokenizer
in `transformers_backend.py`; `loading.py` chooses one from a path, a hub id or `demo`.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import regex


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


class TokenizerBackend:
    """What an encoding must provide to sit behind `TargetTokenizer` (ids are plain ints or int32 arrays)."""

    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def encode_ordinary_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int32) for ids in self.encode_ordinary_batch(texts)]

    def encode_ordinary_arrays_flagged(
        self, texts: list[str], flag: Callable[[str], bool]
    ) -> tuple[list[np.ndarray], list[bool]]:
        """`encode_ordinary_arrays` plus `flag(text)` per text; a backend may compute both in its worker threads."""
        return self.encode_ordinary_arrays(texts), [flag(t) for t in texts]

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
        backend: TokenizerBackend,
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
        return self._backend.encode_ordinary_arrays_flagged(texts, self.contains_special_string)

    def encode_with_specials(self, text: str) -> list[int]:
        """Encode text with every special-token string mapped to its special id (for rendered prompts), as the
        target's own tokenizer does (Kimi: `tokenizer(text)`, which splits at special tokens before anything else)."""
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


class EncodingMemo:
    """The ordinary encodings one step has made, by text, so that encoding an equal text again returns them.

    `encode_ordinary` is a pure function of its text, so a remembered encoding is exactly what a fresh one would give.
    The token-samples step makes one: reconstruction encodes every text piece of every answer (`remember`), and the
    audit's round trip then re-encodes the decoding of each span between structural ids, which for a reconstructed
    row is one of those pieces: with the memo that second encode is a dictionary lookup (a string hash and compare),
    not a second BPE pass. A decoding that differs from every piece (ids that are not what reconstruction made) is
    encoded afresh. It holds the texts and their ids until it is dropped: one dataset's answers, for one step.
    """

    def __init__(self) -> None:
        self._ids: dict[str, np.ndarray] = {}
        self.hits = 0  # texts answered from the memo
        self.encoded = 0  # texts encoded afresh

    def __len__(self) -> int:
        return len(self._ids)

    def remember(self, texts: Sequence[str], arrays: Sequence[np.ndarray]) -> None:
        """Record that each of `texts` encodes ordinarily to the matching array of `arrays`."""
        self._ids.update(zip(texts, arrays))

    def encode_ordinary_arrays(self, tokenizer: TargetTokenizer, texts: Sequence[str]) -> list[np.ndarray]:
        """`tokenizer.encode_ordinary_arrays(texts)`, each remembered text taken from the memo."""
        found = [self._ids.get(t) for t in texts]
        missing = [i for i, ids in enumerate(found) if ids is None]
        self.hits += len(found) - len(missing)
        self.encoded += len(missing)
        fresh = tokenizer.encode_ordinary_arrays([texts[i] for i in missing])
        for i, ids in zip(missing, fresh):
            found[i] = ids
        return found  # type: ignore[return-value]  # every None was filled


def _as_int_list(ids: Iterable[int]) -> list[int]:
    if isinstance(ids, np.ndarray):
        return ids.astype(np.int64, copy=False).tolist()
    return [int(i) for i in ids]


_NUM_THREADS = max(1, min(8, os.cpu_count() or 1))
# Below this many characters a batch is encoded in the calling thread: handing work to threads costs more.
_SERIAL_CHARS = 32_768
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def map_chunked(fn: Callable[[str], Any], texts: list[str]) -> list[Any]:
    """fn over texts, in order, on a shared thread pool (for encoders that release the GIL, as tiktoken does)."""
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
