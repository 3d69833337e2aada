"""The target's final RMSNorm and lm_head, recorded once beside the shards.

The project stores the final hidden state **pre-norm** (the last decoder layer's output, what vLLM's
`extract_hidden_states` gives). The post-norm state a SpecForge trainer wants is `final_norm(pre)`, and the audit's
teacher check needs `lm_head(final_norm(pre))`; both need only these two weights and the norm's epsilon, never the
model. Any engine records them with `save_target_head` (the transformers engine takes them from the loaded model;
the vLLM engine, without the model in process, reads only those two tensors from the checkpoint's safetensors files:
`checkpoint_head`; a head recorded under the checkpoint's current key is only verified, the checkpoint not opened:
`save_target_head_from_checkpoint`).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle_pipeline.drafter_types import PRE_NORM
from eagle_pipeline.hidden_states.models.layers import get_backbone
from eagle_pipeline.hidden_states.store.fingerprint import FINAL_STATES
from eagle_pipeline.hidden_states.store.format import StreamingSafetensorsWriter
from eagle_pipeline.shared.storage import atomic_path, file_sha256

TARGET_HEAD_FILE = "target_head.safetensors"
NORM_TENSOR, HEAD_TENSOR = "final_norm.weight", "lm_head.weight"  # its two tensors


@dataclass(frozen=True)
class TargetHead:
    norm_weight: torch.Tensor  # [H]
    eps: float
    lm_head: torch.Tensor  # [V, H]
    meta: dict[str, Any]

    def prepared(self, device: str | torch.device) -> TargetHead:
        """This head on `device` with the lm_head in fp32 once (not per call): 4.7 GB for Kimi's 163,840 x 7,168."""
        return TargetHead(
            self.norm_weight.to(device),
            self.eps,
            self.lm_head.to(device=device, dtype=torch.float32),
            self.meta,
        )

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm exactly as transformers' Llama/DeepSeek-V3 norm computes it: fp32 statistics, weight applied
        to the result cast back to the input dtype (bit-equal to the model's own `norm` on the same dtype)."""
        x32 = x.to(torch.float32)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm_weight.to(x.dtype) * normed.to(x.dtype)

    def logits(self, final: torch.Tensor, convention: str) -> torch.Tensor:
        """fp32 logits of final states stored under `convention` ('pre_norm' gets the final norm first)."""
        if convention not in FINAL_STATES:
            raise ValueError(f"unknown final-state convention {convention!r}; expected one of {FINAL_STATES}")
        post = self.final_norm(final) if convention == PRE_NORM else final
        return post.to(torch.float32) @ self.lm_head.to(device=final.device, dtype=torch.float32).T  # no-op if prepared

    def top1(self, final: torch.Tensor, convention: str, *, chunk: int = 256) -> torch.Tensor:
        """argmax of `logits` per position, `chunk` positions at a time (a [T, V] fp32 block is 0.65 MB per
        position at Kimi's vocabulary)."""
        return (
            torch.cat([self.logits(final[i : i + chunk], convention).argmax(-1) for i in range(0, len(final), chunk)])
            if len(final)
            else torch.zeros(0, dtype=torch.int64)
        )


def save_target_head(
    out_dir: str | Path,
    *,
    norm_weight: torch.Tensor,
    eps: float,
    lm_head: torch.Tensor,
    source: dict[str, Any],
    checkpoint_key: str | None = None,
) -> tuple[Path, str]:
    """Write `{out_dir}/target_head.safetensors` atomically; returns (path, sha256). Idempotent: a file holding the
    same eps and tensors is left alone, even one recorded without `checkpoint_key` or under another (its bytes,
    whose sha256 earlier shards recorded, are never rewritten only to change a key); a different one is replaced
    (the shards' metadata records the sha256 of the one they were cut with). `checkpoint_key`: the
    `checkpoint_head_key` of the checkpoint the tensors were read from, recorded in the file's metadata."""
    path = Path(out_dir) / TARGET_HEAD_FILE
    norm, head = norm_weight.detach().cpu(), lm_head.detach().cpu()
    if path.exists():
        try:
            old = load_target_head(path.parent)
            if old.eps == float(eps) and torch.equal(old.norm_weight, norm) and torch.equal(old.lm_head, head):
                return path, file_sha256(path)
        except Exception:  # an unreadable file is simply rewritten
            pass
    return _write_target_head(path, norm, float(eps), head, source, checkpoint_key)


def _write_target_head(
    path: Path, norm: torch.Tensor, eps: float, head: torch.Tensor, source: dict[str, Any], key: str | None
) -> tuple[Path, str]:
    """The file `save_target_head` describes, with each tensor's sha256 in its metadata (`verified_head_sha256`).
    Written by the shards' own writer, whose header keeps the metadata in the order given: safetensors' `save_file`
    orders it by a hash map, so two runs of the same extraction wrote different bytes (and recorded different
    `target_head_sha256` in the shards' indexes)."""
    tensors = {NORM_TENSOR: norm.contiguous(), HEAD_TENSOR: head.contiguous()}
    meta = {
        "final_norm_eps": repr(eps),
        "source": json.dumps(source, sort_keys=True),
        "tensors_sha256": json.dumps({name: _tensor_sha256(t) for name, t in tensors.items()}, sort_keys=True),
        **({"checkpoint_head_key": key} if key is not None else {}),
    }
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        writer = StreamingSafetensorsWriter(fh, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], meta)
        for name, t in tensors.items():
            writer.write(name, t)
        sha = writer.finish()
    return path, sha


def _tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a contiguous CPU tensor's bytes, as safetensors stores them."""
    return hashlib.sha256(t.view(torch.uint8).numpy().data).hexdigest()


def save_target_head_from_model(
    model: torch.nn.Module, out_dir: str | Path, source: dict[str, Any]
) -> tuple[Path, str]:
    """Record a transformers *ForCausalLM's final norm and lm_head."""
    norm: Any = get_backbone(model).norm
    head: Any = getattr(model, "lm_head", None)
    if head is None:
        raise TypeError(f"{type(model).__name__}: no lm_head to record")
    return save_target_head(
        out_dir,
        norm_weight=_full(norm.weight),
        eps=final_norm_eps(model),
        lm_head=_full(head.weight),
        source=source,
    )


def _full(weight: Any) -> torch.Tensor:
    """The whole tensor of a tensor-parallel (DTensor) weight; every rank must call this (it gathers)."""
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight


# Where checkpoints keep the final norm, the lm_head and the (tied) input embedding: a plain *ForCausalLM, Kimi-K2.5's
# remote-code VLM wrapper (`language_model.`), transformers 5's VLM layout (`model.language_model.`).
NORM_KEYS = ("model.norm.weight", "language_model.model.norm.weight", "model.language_model.norm.weight")
LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight")
EMBED_KEYS = (
    "model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
)
SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class CheckpointHead:
    """Where a checkpoint directory holds its final norm and lm_head (found and shape-checked; nothing read yet)."""

    model_dir: Path
    norm_key: str
    norm_file: Path
    head_key: str  # the lm_head, or the input embedding when the config ties them
    head_file: Path
    eps: float
    hidden_size: int
    vocab_size: int

    def source(self) -> dict[str, Any]:
        return {
            "checkpoint": str(self.model_dir),
            "final_norm": f"{self.norm_file.name}:{self.norm_key}",
            "lm_head": f"{self.head_file.name}:{self.head_key}",
        }

    def load(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(final norm weight [H], lm_head [V, H]) as stored: only these two tensors are read."""
        from safetensors import safe_open

        out = []
        for key, file in ((self.norm_key, self.norm_file), (self.head_key, self.head_file)):
            with safe_open(str(file), framework="pt") as f:
                out.append(f.get_tensor(key))
        return out[0], out[1]


def _checkpoint_files(model_dir: Path) -> tuple[dict[str, Path], str]:
    """Every tensor name of the checkpoint -> the file holding it, and what was read to know it (for errors)."""
    from safetensors import safe_open

    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        return {k: model_dir / f for k, f in weight_map.items()}, str(index)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{model_dir}: no {SAFETENSORS_INDEX} and no *.safetensors file. The vllm engine records the target's "
            f"final norm and lm_head for the shards' audit from its checkpoint: put the checkpoint there (or at "
            f"least {SAFETENSORS_INDEX} and the files holding {NORM_KEYS[0]} and {LM_HEAD_KEYS[0]})"
        )
    keys: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys.update(dict.fromkeys(f.keys(), file))
    return keys, ", ".join(str(f) for f in files)


def checkpoint_head(model_dir: str | Path) -> CheckpointHead:
    """Find the final norm weight and lm_head (or the tied embedding) in a local checkpoint's safetensors files,
    sharded (`model.safetensors.index.json`) or not, under the plain or a VLM wrapper's names, and the norm's
    epsilon in its config. Raises FileNotFoundError naming the file when a tensor or a file is absent, and
    ValueError when a shape disagrees with the config."""
    from safetensors import safe_open

    from eagle_pipeline.hidden_states.models.model import load_text_config

    d = Path(model_dir)
    config_path = d / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{d} is not a local transformers model directory (no config.json)")
    top = json.loads(config_path.read_text())
    text = load_text_config(d)
    keys, where = _checkpoint_files(d)
    tied = bool(text.get("tie_word_embeddings", top.get("tie_word_embeddings", False)))
    norm_key = next((k for k in NORM_KEYS if k in keys), None)
    head_key = next((k for k in (*LM_HEAD_KEYS, *(EMBED_KEYS if tied else ())) if k in keys), None)
    for what, key, wanted in (
        ("final norm", norm_key, NORM_KEYS),
        ("lm_head", head_key, LM_HEAD_KEYS + (EMBED_KEYS if tied else ())),
    ):
        if key is None:
            raise FileNotFoundError(f"{where}: no {what} tensor (looked for {', '.join(wanted)})")
    assert norm_key is not None and head_key is not None
    eps = text.get("rms_norm_eps")
    if eps is None:
        raise FileNotFoundError(f"{config_path}: no rms_norm_eps (the final norm's epsilon)")
    hidden, vocab = int(text["hidden_size"]), int(text["vocab_size"])
    shapes = {}
    for key in (norm_key, head_key):
        file = keys[key]
        if not file.is_file():
            raise FileNotFoundError(f"{file}: named by {where} for {key}, but absent")
        with safe_open(str(file), framework="pt") as f:
            if key not in set(f.keys()):  # a safe_open handle has no __contains__
                raise FileNotFoundError(f"{file}: has no tensor {key} ({where} says it does)")
            shapes[key] = tuple(f.get_slice(key).get_shape())
    if shapes[norm_key] != (hidden,) or shapes[head_key] != (vocab, hidden):
        raise ValueError(
            f"{d}: {norm_key} {shapes[norm_key]} and {head_key} {shapes[head_key]} do not match the config's "
            f"hidden_size {hidden} / vocab_size {vocab}"
        )
    return CheckpointHead(d, norm_key, keys[norm_key], head_key, keys[head_key], float(eps), hidden, vocab)


def checkpoint_head_key(found: CheckpointHead) -> str:
    """What identifies the head tensors of a checkpoint without reading them: its resolved directory, the sha256 of
    its safetensors index, the norm's epsilon, and each head tensor's name, shape and file (resolved path, size,
    mtime and ctime: a file rewritten, replaced or copied over changes its ctime even when its mtime is restored)."""
    index = found.model_dir / SAFETENSORS_INDEX
    files = {}
    for key, file in ((found.norm_key, found.norm_file), (found.head_key, found.head_file)):
        st = file.stat()
        files[key] = [os.path.realpath(file), st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    ident = {
        "checkpoint": str(found.model_dir.resolve()),
        "index_sha256": file_sha256(index) if index.is_file() else None,
        "tensors": files,
        "eps": found.eps,
        "hidden_size": found.hidden_size,
        "vocab_size": found.vocab_size,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


_CHUNK = 16 << 20


def verified_head_sha256(path: str | Path, key: str) -> str | None:
    """The sha256 of the head file recorded at `path` when its metadata holds the checkpoint key `key`
    (`checkpoint_head_key`), from one read of the file that also checks each tensor's bytes against the sha256
    recorded with it. None when the file holds another key or none (recorded from the checkpoint as it was then, by
    the in-process engine, or by a version before keys); only its header is read then. Raises ValueError naming
    the file when it is unreadable, truncated or altered."""
    file_hash = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            prefix = fh.read(8)
            header_bytes = fh.read(int.from_bytes(prefix, "little"))
            header = json.loads(header_bytes)
            meta = header.get("__metadata__") or {}
            if meta.get("checkpoint_head_key") != key:
                return None
            file_hash.update(prefix + header_bytes)
            wanted = json.loads(meta["tensors_sha256"])
            done = 0
            for (begin, end), name in sorted(
                (header[name]["data_offsets"], name) for name in (NORM_TENSOR, HEAD_TENSOR)
            ):
                if begin != done:
                    raise ValueError(f"{name} starts at data offset {begin}, not {done}")
                tensor_hash, left = hashlib.sha256(), end - begin
                while left:
                    block = fh.read(min(left, _CHUNK))
                    if not block:
                        raise ValueError(f"the file ends inside {name} (truncated)")
                    file_hash.update(block)
                    tensor_hash.update(block)
                    left -= len(block)
                if tensor_hash.hexdigest() != wanted[name]:
                    raise ValueError(f"{name} does not match its recorded sha256")
                done = end
            if fh.read(1):
                raise ValueError("bytes after the last tensor")
    except Exception as exc:  # a truncated or overwritten file: the errors above or json's, none naming the file
        raise ValueError(f"{path}: damaged recorded target head ({type(exc).__name__}: {exc})") from exc
    return file_hash.hexdigest()


class DamagedHeadWarning(UserWarning):
    """A recorded target head was unreadable or damaged (it is rewritten from the checkpoint)."""


def save_target_head_from_checkpoint(
    found: CheckpointHead, out_dir: str | Path, *, log: Callable[[str], None] | None = None
) -> tuple[Path, str]:
    """Record the head `checkpoint_head` found, under its `checkpoint_head_key`. A head already recorded in
    `out_dir` under the checkpoint's current key is only verified (`verified_head_sha256`: one read of it; the
    checkpoint's files are not opened). Otherwise the two tensors are read from the checkpoint (never the whole
    model) and recorded as `save_target_head` records them; a damaged recorded head is named in a
    `DamagedHeadWarning` (and a `warning:` log line) and rewritten from the checkpoint."""
    path, key = Path(out_dir) / TARGET_HEAD_FILE, checkpoint_head_key(found)
    damaged = False
    if path.exists():
        try:
            sha = verified_head_sha256(path, key)
        except ValueError as exc:
            message = f"{exc}; rewriting it from {found.model_dir}"
            warnings.warn(message, DamagedHeadWarning, stacklevel=2)
            if log is not None:
                log(f"warning: {message}")
            damaged, sha = True, None
        if sha is not None:
            return path, sha
    norm, head = found.load()
    if log is not None:
        log(f"target head read from {found.model_dir} for {path}")
    if damaged:  # whatever it holds, it is not what this checkpoint gives
        return _write_target_head(path, norm, found.eps, head, found.source(), key)
    return save_target_head(
        out_dir, norm_weight=norm, eps=found.eps, lm_head=head, source=found.source(), checkpoint_key=key
    )


def final_norm_eps(model: torch.nn.Module) -> float:
    """The epsilon of a transformers model's final RMSNorm (`variance_epsilon` in Llama/DeepSeek, `eps` elsewhere)."""
    norm = get_backbone(model).norm
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None)
    if eps is None:
        raise TypeError(f"{type(norm).__name__}: the final norm has no epsilon to record")
    return float(eps)


_SHA_CACHE: dict[str, tuple[tuple[int, ...], str]] = {}


def recorded_head_sha256(out_dir: str | Path) -> str | None:
    """The sha256 of the head recorded in `out_dir` (None: none is), hashed once per process for each version of
    the file (device, inode, size, mtime, ctime: an atomic rewrite is a new inode)."""
    path = Path(out_dir) / TARGET_HEAD_FILE
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    version = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    cached = _SHA_CACHE.get(str(path))
    if cached is not None and cached[0] == version:
        return cached[1]
    sha = file_sha256(path)
    _SHA_CACHE[str(path)] = (version, sha)
    return sha


def head_changed(out_dir: str | Path, shard_head_sha256: str | None) -> str | None:
    """The sha256 of the head recorded in `out_dir` now when it is not the one a shard was cut with
    (`shard_head_sha256`, from its index): the shard's states and checks belong to another final norm / lm_head
    (a checkpoint rewritten in place, another checkpoint), so it is stale. None when they agree, or when the shard
    recorded no head or none is recorded now (nothing to compare)."""
    if not shard_head_sha256:
        return None
    current = recorded_head_sha256(out_dir)
    return current if current is not None and current != shard_head_sha256 else None


def stale_head_note(out_dir: str | Path, shard_head_sha256: str | None) -> str | None:
    """What the head checks of a shard cut with another head than the one recorded now say (None: same head)."""
    current = head_changed(out_dir, shard_head_sha256)
    if current is None:
        return None
    return (
        f"STALE: the shard was cut with target head {str(shard_head_sha256)[:12]}..., the head recorded beside the "
        f"shards is now {current[:12]}... (its checkpoint changed): extract the shard again "
        "(hidden_states.on_settings_change: redo)"
    )


def load_target_head(out_dir: str | Path, *, device: str = "cpu") -> TargetHead:
    from safetensors import safe_open

    path = Path(out_dir) / TARGET_HEAD_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"{path}: no recorded final norm / lm_head; re-extract the shards (extraction writes it) or record it "
            "with eagle_pipeline.hidden_states.store.head.save_target_head"
        )
    with safe_open(str(path), framework="pt", device=device) as f:
        meta = f.metadata() or {}
        return TargetHead(
            norm_weight=f.get_tensor(NORM_TENSOR),
            eps=float(meta["final_norm_eps"]),
            lm_head=f.get_tensor(HEAD_TENSOR),
            meta={"source": json.loads(meta.get("source", "{}")), "path": str(path)},
        )
