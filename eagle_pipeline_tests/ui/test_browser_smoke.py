"""Headless-browser smoke test of the Dagster UI: the pages an operator uses render the pipeline's data.

Uses Debian's chromium (`apt-get install -y chromium`) through its command line: one call per page writes a
screenshot and dumps the rendered DOM after `--virtual-time-budget` (the UI is a JavaScript app that loads its data
over GraphQL). Screenshots go to $EAGLE_SCREENSHOT_DIR when set (docs/img/ holds the ones in docs/ui.md), else to the
test's temporary directory.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest

from eagle_pipeline.audit import GATES
from eagle_pipeline_tests.ui.conftest import FAILING

pytestmark = pytest.mark.slow

CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "/usr/bin/chromium")
SCREENSHOT_ENV = "EAGLE_SCREENSHOT_DIR"
WIDTH, HEIGHT = 1600, 1000
VIRTUAL_TIME_BUDGET_MS = 15000
CHROMIUM_TIMEOUT_S = 120
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ASSETS = (
    "prompts", "responses", "token_samples", "merged_dataset", "draft_vocab", "hidden_state_plan", "hidden_states",
    "trainer_exports",
)
GROUPS = ("generation", "tokens", "merge", "hidden_states", "exports")


@pytest.fixture(scope="session")
def chromium() -> str:
    for candidate in CHROMIUM_CANDIDATES:
        found = shutil.which(candidate)
        if found:
            return found
    pytest.skip("chromium not installed (CI installs it with `apt-get install -y chromium`); UI screenshots skipped")


@pytest.fixture(scope="session")
def screenshot_dir(tmp_path_factory) -> Path:
    configured = os.environ.get(SCREENSHOT_ENV)
    path = Path(configured) if configured else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="package")
def ui_without_welcome(dagster_ui):
    """The first visit on 127.0.0.1 opens a 'Join the Dagster community' dialog over the page: mark it seen."""
    assert dagster_ui.gql("mutation { setNuxSeen }")["setNuxSeen"] is True
    assert dagster_ui.gql("{ shouldShowNux }")["shouldShowNux"] is False
    return dagster_ui


@dataclass(frozen=True)
class Page:
    name: str  # the screenshot is ui_<name>.png
    path: str  # URL path and query; {failed_run} is filled in
    expected: tuple[str, ...]  # text the rendered DOM must contain
    height: int = HEIGHT


# The lineage page collapses asset groups unless they are listed in `expanded` (ids are global@global:<group>).
_EXPANDED = ",".join(f"global@global:{g}" for g in GROUPS)
_N = len(GATES)

PAGES = (
    Page("asset_graph", f"/asset-groups?expanded={quote(_EXPANDED, safe=',')}",
         ("Global asset lineage", *(f">{a}<" for a in ASSETS))),
    Page("token_samples_lineage", "/assets/token_samples?view=lineage&lineageScope=upstream&lineageDepth=2",
         (">prompts<", ">responses<", ">token_samples<", f"{_N - 1} / {_N} Passed", "2 partitions")),
    # The checks tab: every gate, billing_agreement failed, and its latest evaluation (B6, launched last).
    Page("token_samples_checks", "/assets/token_samples?view=checks",
         (*(f">{g.name}<" for g in GATES), ">Failed<", "FAIL (blocks)", "rows_failing", f">{FAILING}<")),
    Page("check_billing_agreement", "/assets/token_samples?view=checks&checkDetail=billing_agreement",
         ("billing_agreement", "blocking", "FAIL (blocks)", "failure_examples", "Plots"), height=1600),
    Page("failed_run", "/runs/{failed_run}",
         (f"partition: {FAILING}", "DagsterAssetCheckFailedError", "billing_agreement", ">Failure<")),
)


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC, "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _assert_not_blank(path: Path) -> None:
    import matplotlib.image

    pixels = matplotlib.image.imread(path)[..., :3]
    colours = np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3)[::5], axis=0)
    # A blank or still-loading page is one flat colour (std 0); the rendered pages measured 0.08..0.14, 800+ colours.
    assert float(pixels.std()) > 0.03, f"{path.name}: nearly uniform image (std {pixels.std():.4f})"
    assert len(colours) > 200, f"{path.name}: only {len(colours)} colours"


def _render(chromium: str, url: str, png: Path, profile: Path, height: int) -> str:
    cmd = [
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
        "--no-proxy-server", "--hide-scrollbars", f"--user-data-dir={profile}", f"--window-size={WIDTH},{height}",
        f"--virtual-time-budget={VIRTUAL_TIME_BUDGET_MS}", f"--screenshot={png}", "--dump-dom", url,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHROMIUM_TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"chromium exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_ui_page_renders_the_pipeline(chromium, ui_without_welcome, screenshot_dir, tmp_path, page):
    ui = ui_without_welcome
    url = ui.base_url + page.path.format(failed_run=ui.runs[FAILING]["runId"])
    png = screenshot_dir / f"ui_{page.name}.png"
    png.unlink(missing_ok=True)
    dom = _render(chromium, url, png, tmp_path / "chromium-profile", page.height)
    (tmp_path / f"ui_{page.name}.html").write_text(dom)

    assert png.exists(), f"no screenshot written for {url}"
    assert _png_size(png.read_bytes()) == (WIDTH, page.height)
    _assert_not_blank(png)
    missing = [text for text in page.expected if text not in dom]
    assert not missing, f"{url}: rendered DOM lacks {missing} (DOM saved in {tmp_path})"
