"""Headless-browser smoke test of the Dagster UI: the pages an operator uses render the pipeline's data.

Uses Debian's chromium (`apt-get install -y chromium`) through its command line: one call per page writes a
screenshot and dumps the rendered DOM after `--virtual-time-budget` (the UI is a JavaScript app that loads its data
over GraphQL). The token-length histogram opens in a dialog on a click, so that test drives chromium through the
DevTools protocol instead (cdp.py, with aiohttp). Screenshots go to $EAGLE_SCREENSHOT_DIR when set (docs/img/ holds
the ones in docs/ui.md), else to the test's temporary directory.
"""

from __future__ import annotations

import asyncio
import re
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest

from eagle_pipeline.audit import GATES
from eagle_pipeline_tests.ui.conftest import FAILING, PASSING, ROWS

pytestmark = pytest.mark.slow

WIDTH, HEIGHT = 1600, 1000
VIRTUAL_TIME_BUDGET_MS = 15000
CHROMIUM_TIMEOUT_S = 120
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ASSETS = (
    "prompts",
    "responses",
    "token_samples",
    "audit_overview",
    "merged_dataset",
    "draft_vocab",
    "hidden_state_plan",
    "hidden_states",
    "trainer_exports",
)
GROUPS = ("generation", "tokens", "merge", "hidden_states", "exports")


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
    Page(
        "asset_graph",
        f"/asset-groups?expanded={quote(_EXPANDED, safe=',')}",
        ("Global asset lineage", *(f">{a}<" for a in ASSETS)),
    ),
    Page(
        "token_samples_lineage",
        "/assets/token_samples?view=lineage&lineageScope=upstream&lineageDepth=2",
        (">prompts<", ">responses<", ">token_samples<", f"{_N - 1} / {_N} Passed", "2 partitions"),
    ),
    # The checks tab: every gate, billing_agreement failed, and its latest evaluation (B6, launched last).
    Page(
        "token_samples_checks",
        "/assets/token_samples?view=checks",
        (*(f">{g.name}<" for g in GATES), ">Failed<", "FAIL (blocks)", f"{FAILING}: rows failing", f">{FAILING}<"),
    ),
    Page(
        "check_billing_agreement",
        "/assets/token_samples?view=checks&checkDetail=billing_agreement",
        ("billing_agreement", "blocking", "FAIL (blocks)", "failure_examples", "Plots"),
        height=1600,
    ),
    Page(
        "failed_run",
        "/runs/{failed_run}",
        (
            f"partition: {FAILING}",
            f"Audit failed: billing_agreement blocks {FAILING}",
            "billing_agreement",
            ">Failure<",
        ),
    ),
    # Partition status: the refused dataset is Failed (its blocking audit failed; nothing was materialized), B6 shown.
    Page(
        "token_samples_failed_partition",
        f"/assets/token_samples?view=partitions&partition={FAILING}",
        (
            "Materialized (1)",
            "Failed (1)",
            f">{PASSING}<",
            f">{FAILING}<",
            "did not materialize this asset",  # the partition page's banner on the failed run
        ),
    ),
    # The schedule and the declarative-automation sensor the daemon evaluates (both stopped by default).
    Page(
        "automation",
        "/automation",
        (
            "resume_incomplete_datasets",
            "default_automation_condition_sensor",
            "audit_view_sensor",  # running from the start: it refreshes the audit view
            "Automation condition sensor",
            "every 6 hours",
        ),
    ),
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
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--no-proxy-server",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        f"--window-size={WIDTH},{height}",
        f"--virtual-time-budget={VIRTUAL_TIME_BUDGET_MS}",
        f"--screenshot={png}",
        "--dump-dom",
        url,
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


# The histogram: token_samples' `token_lengths` metadata is Markdown holding an inline base64 PNG; the UI shows it
# behind "[Show Markdown]" in the metadata table of the materialization (Events tab, one partition's latest).
HISTOGRAM_URL = f"/assets/token_samples?view=events&partition={PASSING}"
HISTOGRAM_TIMEOUT_S = 180  # the whole browser session
PAGE_TIMEOUT_S = 60  # each wait inside it
_TOKEN_LENGTHS_ROW = """Array.from(document.querySelectorAll('tr')).find(
    r => r.cells.length > 1 && r.cells[0].innerText.trim() === 'token_lengths')"""
_SHOW_MARKDOWN = f"""(() => {{
    const row = {_TOKEN_LENGTHS_ROW};
    if (!row) return null;
    return Array.from(row.querySelectorAll('a, button')).find(e => e.textContent.includes('Show Markdown'));
}})()"""
_DIALOG_IMAGE = """(() => {
    for (const dialog of document.querySelectorAll('[role=dialog]')) {
        for (const img of dialog.querySelectorAll('img')) {
            const box = img.getBoundingClientRect();
            if (img.src.startsWith('data:image/png;base64,') && img.complete && img.naturalWidth > 0
                && box.width > 100 && box.height > 50) {
                return {title: dialog.innerText.split('\\n')[0], width: img.naturalWidth, height: img.naturalHeight,
                        shown: [Math.round(box.width), Math.round(box.height)], src: img.src};
            }
        }
    }
    return null;
})()"""


async def _open_histogram(chromium: str, url: str, png: Path, profile: Path) -> tuple[dict, str]:
    from eagle_pipeline_tests.ui.cdp import chromium_tab

    async with chromium_tab(chromium, profile, WIDTH, HEIGHT) as tab:
        await tab.navigate(url)
        await tab.wait_for(
            f"!!{_SHOW_MARKDOWN}",
            timeout=PAGE_TIMEOUT_S,
            what="the [Show Markdown] link in the token_lengths metadata row",
        )
        partition = await tab.evaluate("document.body.innerText")
        assert f"Partition {PASSING} materialized" in partition, f"{url} does not show {PASSING}'s materialization"
        await tab.evaluate(f"{_SHOW_MARKDOWN}.click()")
        image = await tab.wait_for(
            _DIALOG_IMAGE, timeout=PAGE_TIMEOUT_S, what="a data:image/png <img> shown in the token_lengths dialog"
        )
        await asyncio.sleep(0.5)  # the dialog's opening transition
        await tab.screenshot(png)
        return image, await tab.dom()


LATEST_MARKDOWN = """
query Latest($partition: String!) {
  assetOrError(assetKey: {path: ["token_samples"]}) {
    ... on Asset {
      assetMaterializations(partitions: [$partition], limit: 1) {
        metadataEntries { label ... on MarkdownMetadataEntry { mdStr } }
      }
    }
  }
}
"""


def _token_lengths_png_url(ui) -> str:
    """The data: URL of the PNG in the latest B1 materialization's token_lengths Markdown, through GraphQL."""
    materializations = ui.gql(LATEST_MARKDOWN, {"partition": PASSING})["assetOrError"]["assetMaterializations"]
    assert len(materializations) == 1, materializations
    md = next(e["mdStr"] for e in materializations[0]["metadataEntries"] if e["label"] == "token_lengths")
    found = re.search(r"\((data:image/png;base64,[A-Za-z0-9+/=]+)\)", md)
    assert found, f"token_lengths holds no inline PNG: {md[:300]}"
    return found.group(1)


def test_ui_token_lengths_histogram(chromium, ui_without_welcome, screenshot_dir, tmp_path):
    """Clicks [Show Markdown] next to token_lengths and checks that the dialog shows the histogram image."""
    pytest.importorskip("aiohttp", reason="the DevTools-protocol driver needs aiohttp")
    url = ui_without_welcome.base_url + HISTOGRAM_URL
    png = screenshot_dir / "ui_token_lengths_histogram.png"
    png.unlink(missing_ok=True)

    async def run() -> tuple[dict, str]:
        return await asyncio.wait_for(
            _open_histogram(chromium, url, png, tmp_path / "chromium-profile"), HISTOGRAM_TIMEOUT_S
        )

    image, dom = asyncio.run(run())
    (tmp_path / "ui_token_lengths_histogram.html").write_text(dom)

    src = image.pop("src")
    assert image["title"] == "token_lengths", image
    assert image["width"] >= 200 and image["height"] >= 100, image
    # The image shown is the very PNG the materialization carries (same data: URL), not some other picture.
    assert src == _token_lengths_png_url(ui_without_welcome), f"dialog shows another image ({len(src)} chars)"
    assert 'src="data:image/png;base64,' in dom
    assert _png_size(png.read_bytes()) == (WIDTH, HEIGHT)
    _assert_not_blank(png)


# --- The audit view, check summaries and failure summaries, read as a person sees them (issue 16, items 1 and 3) ---

NARROW_WIDTH = 1280  # the audit view's tables must fit a 1280 px window
AUDIT_VIEW_URL = "/assets/audit_overview?view=events&time={timestamp}"  # the view made after both dataset runs
# Every <table> on the page: where its right edge is, and whether it scrolls (a cut-off table is wider than its box).
_TABLE_BOXES = """Array.from(document.querySelectorAll('table')).map(t => {
    const box = t.getBoundingClientRect();
    return {right: Math.round(box.right), width: Math.round(box.width), scroll: t.scrollWidth,
            parent: t.parentElement ? t.parentElement.clientWidth : 0, text: t.innerText.slice(0, 80)};
})"""
_TEXT = "(document.body ? document.body.innerText : '')"


async def _visible_text(chromium: str, url: str, png: Path, profile: Path, ready: str, width: int, height: int):
    """Opens `url`, waits until the visible text holds `ready`, screenshots; returns (innerText, table boxes)."""
    from eagle_pipeline_tests.ui.cdp import chromium_tab

    async with chromium_tab(chromium, profile, width, height) as tab:
        await tab.navigate(url)
        await tab.wait_for(f"{_TEXT}.includes({ready!r})", timeout=PAGE_TIMEOUT_S, what=repr(ready))
        await asyncio.sleep(1.0)  # let the remaining queries settle
        text = await tab.evaluate(_TEXT)
        boxes = await tab.evaluate(_TABLE_BOXES)
        scroll_width = await tab.evaluate("document.documentElement.scrollWidth")
        await tab.screenshot(png)
        return text, boxes, scroll_width


def _open(chromium, ui, path, png, profile, ready, width=WIDTH, height=HEIGHT):
    pytest.importorskip("aiohttp", reason="the DevTools-protocol driver needs aiohttp")

    async def run():
        return await asyncio.wait_for(
            _visible_text(chromium, ui.base_url + path, png, profile, ready, width, height), HISTOGRAM_TIMEOUT_S
        )

    png.unlink(missing_ok=True)
    result = asyncio.run(run())
    _assert_not_blank(png)
    return result


def test_ui_audit_view_marks_the_failing_dataset_unfit_and_fits_1280_px(
    chromium, ui_without_welcome, audit_view, screenshot_dir, tmp_path
):
    png = screenshot_dir / "ui_audit_overview.png"
    fit = f"1 of 2 datasets fit to merge: {PASSING} yes; {FAILING} NO (billing_agreement)"
    url = AUDIT_VIEW_URL.format(timestamp=audit_view["timestamp"])
    text, boxes, scroll_width = _open(
        chromium, ui_without_welcome, url, png, tmp_path / "profile", fit, NARROW_WIDTH, 1400
    )
    (tmp_path / "audit_view.txt").write_text(text)
    assert _png_size(png.read_bytes()) == (NARROW_WIDTH, 1400)
    # What a person reads, without a click: the verdict per dataset, the gate, its counts and the first failing row.
    for expected in (
        fit,
        "fit_to_merge",
        "billing_agreement",
        f"{ROWS} of {ROWS}",
        "FAIL (blocks)",
        f"first_failure {FAILING}",
        f"billing_agreement: {FAILING}-",
        "rows over the per-row tolerance",
    ):
        assert expected in text, f"{expected!r} not visible on {url} (text in {tmp_path})"
    datasets_table = [b for b in boxes if "reason" in b["text"]]
    assert datasets_table, boxes
    for box in boxes:
        assert box["right"] <= NARROW_WIDTH and box["scroll"] <= max(box["width"], box["parent"]) + 1, box
    assert scroll_width <= NARROW_WIDTH


def test_ui_check_names_the_dataset_and_shows_its_first_failure(chromium, ui_without_welcome, tmp_path):
    png = tmp_path / "ui_check_billing_agreement_summary.png"  # docs/img has the full check page from PAGES
    summary = f"{FAILING}: FAIL (blocks): {ROWS} of {ROWS} rows over the per-row tolerance; aggregate "
    text, _, _ = _open(
        chromium,
        ui_without_welcome,
        "/assets/token_samples?view=checks&checkDetail=billing_agreement",
        png,
        tmp_path / "profile",
        summary,
    )
    (tmp_path / "check.txt").write_text(text)
    assert "first_failure_example" in text
    assert re.search(rf"{FAILING}-\S+: len\(output_ids\)=\d+ usage_completion_tokens=\d+", text), text[:3000]


def test_ui_failed_run_shows_the_summary_before_the_traceback(chromium, ui_without_welcome, tmp_path):
    ui = ui_without_welcome
    png = tmp_path / "ui_failed_run_summary.png"  # docs/img/ui_failed_run.png comes from PAGES
    ready = f"Audit failed: billing_agreement blocks {FAILING}: {ROWS} of {ROWS} rows over the per-row tolerance"
    text, _, _ = _open(chromium, ui, f"/runs/{ui.runs[FAILING]['runId']}", png, tmp_path / "profile", ready)
    (tmp_path / "run.txt").write_text(text)
    assert "Stack Trace" in text
    assert text.index(ready) < text.index("Stack Trace")
    assert f"rerun EAGLE_dataset for {FAILING}" in text[: text.index("Stack Trace")]


def test_ui_refused_merge_run_starts_with_its_summary(
    chromium, ui_without_welcome, refused_merge, screenshot_dir, tmp_path
):
    ui = ui_without_welcome
    png = screenshot_dir / "ui_refused_merge_run.png"
    ready = "Merge refused: 1 of 2 datasets are not fit to merge."
    text, _, _ = _open(chromium, ui, f"/runs/{refused_merge['runId']}", png, tmp_path / "profile", ready, height=1600)
    (tmp_path / "merge_run.txt").write_text(text)
    assert f"{FAILING}: billing_agreement: {ROWS} of {ROWS} rows over the per-row tolerance" in text
    assert "Stack Trace" in text and text.index(ready) < text.index("Stack Trace")
