"""One `dagster dev` (webserver + daemon) on a small two-dataset configuration, shared by the UI tests.

The `dagster_ui` fixture (one per test package) starts `dagster dev -w workspace.yaml` as `make ui` does (the
project's dagster.yaml copied into a temporary $DAGSTER_HOME), bound to 127.0.0.1 on a free port, and launches two
`EAGLE_dataset` runs through the GraphQL API, the way the UI's launchpad does: B1 on the clean simulated backend, then
B6 on a copy of it whose simulated provider over-bills every response (`billing_mismatch: 1.0`), so B6's blocking
`billing_agreement` audit fails and B1's passes. The server and everything it started are always stopped when the
package's tests are done.

Runs are queued (the default QueuedRunCoordinator), so they need the daemon that `dagster dev` starts; the webserver
alone would leave them QUEUED. They run with the in-process executor (run config), which takes about 10 s a dataset
on 2 cores instead of about 50 s with the default multiprocess executor (one Python process per audit check).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from eagle_pipeline_tests.defs.conftest import REPO, write_config

PASSING = "B1"  # clean simulated backend: every audit gate passes
FAILING = "B6"  # backend that over-bills every response: billing_agreement fails and blocks
FAULTY_BACKEND = "simulated_faulty"
ROWS = 4
JOB = "EAGLE_dataset"
START_TIMEOUT_S = 240
RUN_TIMEOUT_S = 300
STOP_TIMEOUT_S = 60
TERMINAL = {"SUCCESS", "FAILURE", "CANCELED"}
CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "/usr/bin/chromium")
SCREENSHOT_ENV = "EAGLE_SCREENSHOT_DIR"
RUN_CONFIG: dict = {}  # EAGLE_dataset already runs in one process (its executor)


class GraphQLError(AssertionError):
    pass


class GraphQL:
    """POSTs to the webserver's /graphql; proxies are bypassed (loopback only). Raises on GraphQL errors."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def __call__(self, query: str, variables: dict | None = None, *, timeout: float = 60) -> dict:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        with self._opener.open(request, timeout=timeout) as response:
            payload = json.load(response)
        if payload.get("errors"):
            raise GraphQLError(f"GraphQL errors: {json.dumps(payload['errors'])[:2000]}")
        return payload["data"]


@dataclass
class DagsterUI:
    base_url: str
    gql: GraphQL
    home: Path
    config: Path
    data_root: Path
    log: Path
    location: str = ""
    repository: str = ""
    runs: dict[str, dict] = field(default_factory=dict)  # partition -> run (runId, status, tags, stepStats)

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


WORKSPACE_QUERY = """
query Workspace {
  workspaceOrError {
    __typename
    ... on Workspace {
      locationEntries {
        name
        loadStatus
        locationOrLoadError {
          __typename
          ... on RepositoryLocation { repositories { name jobs { name } } }
          ... on PythonError { message }
        }
      }
    }
    ... on PythonError { message }
  }
}
"""

LAUNCH_RUN = """
mutation LaunchRun($params: ExecutionParams!) {
  launchRun(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId status } }
    ... on PythonError { message }
    ... on InvalidSubsetError { message }
    ... on PipelineNotFoundError { message }
    ... on RunConfigValidationInvalid { errors { message } }
  }
}
"""

RUN_QUERY = """
query Run($runId: ID!) {
  runOrError(runId: $runId) {
    __typename
    ... on Run { runId status tags { key value } stepStats { stepKey status } }
    ... on RunNotFoundError { message }
    ... on PythonError { message }
  }
}
"""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_ui_config(directory: Path) -> Path:
    """write_config's small B1 + B6 configuration, with B6 on a copy of the simulated backend that over-bills."""
    path = write_config(directory, datasets=(PASSING, FAILING), limit=ROWS)
    cfg = yaml.safe_load(path.read_text())
    faulty = copy.deepcopy(cfg["backends"]["simulated"])
    faulty["simulated"] = {**(faulty.get("simulated") or {}), "faults": {"billing_mismatch": 1.0}}
    cfg["backends"][FAULTY_BACKEND] = faulty
    for ds in cfg["datasets"]:
        if ds["name"] == FAILING:
            ds["backend"] = FAULTY_BACKEND
    assert {d["name"] for d in cfg["datasets"]} == {PASSING, FAILING}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _reset_sigint() -> None:
    # `dagster dev` shuts down on SIGTERM by mapping it to its SIGINT handler; a SIGINT ignored by whoever started
    # pytest (a background job, nohup) would be inherited and make it ignore SIGTERM too.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for_location(ui: DagsterUI, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    last = "no answer yet"
    while True:
        if proc.poll() is not None:
            pytest.fail(f"dagster dev exited with {proc.returncode} before serving:\n{ui.log_tail()}")
        try:
            data = ui.gql(WORKSPACE_QUERY, timeout=10)["workspaceOrError"]
            assert data["__typename"] == "Workspace", data
            for entry in data["locationEntries"]:
                loc = entry["locationOrLoadError"] or {}
                if loc.get("__typename") == "PythonError":
                    pytest.fail(f"code location {entry['name']} failed to load: {loc['message']}")
                if entry["loadStatus"] == "LOADED" and loc.get("__typename") == "RepositoryLocation":
                    for repo in loc["repositories"]:
                        if JOB in {j["name"] for j in repo["jobs"]}:
                            ui.location, ui.repository = entry["name"], repo["name"]
                            return
            last = json.dumps(data)[:500]
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            last = repr(exc)
        if time.monotonic() > deadline:
            pytest.fail(f"webserver not ready after {START_TIMEOUT_S}s (last: {last}):\n{ui.log_tail()}")
        time.sleep(1)


def launch_dataset_run(ui: DagsterUI, partition: str) -> str:
    return launch_job_run(ui, JOB, {"dagster/partition": partition})


def launch_job_run(ui: DagsterUI, job: str, tags: dict[str, str] | None = None, run_config: dict | None = None) -> str:
    params = {
        "selector": {"repositoryLocationName": ui.location, "repositoryName": ui.repository, "pipelineName": job},
        "runConfigData": RUN_CONFIG if run_config is None else run_config,
        "executionMetadata": {"tags": [{"key": k, "value": v} for k, v in (tags or {}).items()]},
    }
    result = ui.gql(LAUNCH_RUN, {"params": params})["launchRun"]
    assert result["__typename"] == "LaunchRunSuccess", result
    return result["run"]["runId"]


def wait_for_run(ui: DagsterUI, run_id: str, timeout_s: float = RUN_TIMEOUT_S) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        run = ui.gql(RUN_QUERY, {"runId": run_id})["runOrError"]
        assert run["__typename"] == "Run", run
        if run["status"] in TERMINAL:
            return run
        if time.monotonic() > deadline:
            pytest.fail(f"run {run_id} still {run['status']} after {timeout_s}s:\n{ui.log_tail()}")
        time.sleep(1)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM lets `dagster dev` stop its webserver and daemon; then the server's own session is killed outright."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session started below holds only processes this fixture started
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


@contextlib.contextmanager
def running_dagster_dev(tmp: Path, config: Path) -> Iterator[DagsterUI]:
    """`dagster dev` as `make ui` starts it, on `config`, in a temporary $DAGSTER_HOME under `tmp`; always stopped."""
    home = tmp / "dagster_home"
    home.mkdir()
    shutil.copyfile(REPO / "dagster.yaml", home / "dagster.yaml")
    port = free_port()
    ui = DagsterUI(
        base_url=f"http://127.0.0.1:{port}",
        gql=GraphQL(f"http://127.0.0.1:{port}/graphql"),
        home=home,
        config=config,
        data_root=Path(yaml.safe_load(config.read_text())["data_root"]),
        log=tmp / "dagster_dev.log",
    )
    env = {**os.environ, "DAGSTER_HOME": str(home), "EAGLE_PIPELINE_CONFIG": str(config)}
    env.pop("EAGLE_DATA_ROOT", None)  # it would override the temporary data root
    workspace = str(REPO / "workspace.yaml")
    cmd = [sys.executable, "-m", "dagster", "dev", "-w", workspace, "-h", "127.0.0.1", "-p", str(port)]
    with open(ui.log, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_reset_sigint,
        )
    try:
        _wait_for_location(ui, proc)
        yield ui
    finally:
        _stop(proc)


@pytest.fixture(scope="package")
def dagster_ui(tmp_path_factory) -> Iterator[DagsterUI]:
    """A running `dagster dev` with B1 (passing) and B6 (failing audit) materialised through GraphQL."""
    tmp = tmp_path_factory.mktemp("dagster_ui")
    with running_dagster_dev(tmp, write_ui_config(tmp)) as ui:
        # One dataset after the other, so the latest billing_agreement evaluation (shown first in the UI) is B6's.
        for partition in (PASSING, FAILING):
            ui.runs[partition] = wait_for_run(ui, launch_dataset_run(ui, partition))
        yield ui


@pytest.fixture(scope="package")
def ui_without_welcome(dagster_ui):
    """The first visit on 127.0.0.1 opens a 'Join the Dagster community' dialog over the page: mark it seen."""
    assert dagster_ui.gql("mutation { setNuxSeen }")["setNuxSeen"] is True
    assert dagster_ui.gql("{ shouldShowNux }")["shouldShowNux"] is False
    return dagster_ui


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium, for the browser tests (skipped, with the reason, when it is absent)."""
    for candidate in CHROMIUM_CANDIDATES:
        found = shutil.which(candidate)
        if found:
            return found
    pytest.skip("chromium not installed (CI installs it with `apt-get install -y chromium`); UI screenshots skipped")


@pytest.fixture(scope="session")
def screenshot_dir(tmp_path_factory) -> Path:
    """$EAGLE_SCREENSHOT_DIR when set (docs/img/ holds the screenshots of docs/ui.md), else a temporary directory."""
    configured = os.environ.get(SCREENSHOT_ENV)
    path = Path(configured) if configured else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


# --- The audit view and a refused merge (issue 16, items 1 and 3) ---

AUDIT_VIEW_TIMEOUT_S = 240  # the audit_view sensor ticks every 30 s; its run then starts and materialises the view
AUDIT_VIEW_QUERY = """
query AuditView {
  assetOrError(assetKey: {path: ["audit_overview"]}) {
    __typename
    ... on Asset {
      assetMaterializations(limit: 5) {
        runId
        timestamp
        metadataEntries {
          label
          ... on TextMetadataEntry { text }
          ... on IntMetadataEntry { intValue }
          ... on MarkdownMetadataEntry { mdStr }
          ... on TableMetadataEntry { table { records schema { columns { name description } } } }
        }
      }
    }
  }
}
"""


RUN_END_QUERY = "query End($runId: ID!) { runOrError(runId: $runId) { ... on Run { endTime } } }"


def _entries(materialization: dict) -> dict:
    return {e["label"]: e for e in materialization["metadataEntries"]}


@pytest.fixture(scope="package")
def audit_view(dagster_ui) -> dict:
    """The audit_overview materialization that judged both datasets' runs: launched by the audit_view sensor, with
    no click, after both dataset runs. Returns {"runId", "timestamp" (ms), "metadata": label -> entry}."""
    ended = dagster_ui.gql(RUN_END_QUERY, {"runId": dagster_ui.runs[FAILING]["runId"]})["runOrError"]["endTime"]
    deadline = time.monotonic() + AUDIT_VIEW_TIMEOUT_S
    while True:
        data = dagster_ui.gql(AUDIT_VIEW_QUERY)["assetOrError"]
        mats = data.get("assetMaterializations", []) if data["__typename"] == "Asset" else []
        for m in mats:
            # A refresh may come between the two dataset runs (or during B6's); wait for one made after B6's run.
            if int(m["timestamp"]) > ended * 1000:
                return {"runId": m["runId"], "timestamp": m["timestamp"], "metadata": _entries(m)}
        if time.monotonic() > deadline:
            pytest.fail(f"no audit_overview judged {FAILING} within {AUDIT_VIEW_TIMEOUT_S}s:\n{dagster_ui.log_tail()}")
        time.sleep(2)


@pytest.fixture(scope="package")
def refused_merge(dagster_ui) -> dict:
    """EAGLE_merge launched after the two dataset runs: it refuses, because B6's blocking audit failed."""
    if "merge" not in dagster_ui.runs:
        dagster_ui.runs["merge"] = wait_for_run(dagster_ui, launch_job_run(dagster_ui, "EAGLE_merge"))
    return dagster_ui.runs["merge"]
