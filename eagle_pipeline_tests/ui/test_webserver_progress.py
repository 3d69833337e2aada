"""Live progress in the real UI: while a slow simulated generation runs under `dagster dev`, the figures advance
through GraphQL (observations of the running partition, the run's progress tag) and on the pages a person opens
(the partition's metadata on the asset page, the run page's header).

Its own `dagster dev` (not the package's B1 + B6 instance, whose pages the other tests describe): one dataset on a
simulated server that answers one request at a time in SLOW_LATENCY_S, progress reported every second.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
import yaml

from eagle_pipeline_tests.defs.conftest import write_config
from eagle_pipeline_tests.ui.conftest import launch_dataset_run, running_dagster_dev, wait_for_run
from eagle_pipeline_tests.ui.test_browser_smoke import WIDTH, _assert_not_blank, _png_size

pytestmark = pytest.mark.slow

DATASET = "B1"
EARLIER_ROWS = 3  # answered by a first, fast run
SLOW_ROWS = 20
SLOW_LATENCY_S = 2.0  # one request at a time: about 34 s for the 17 new prompts
PROGRESS_EVERY_S = 1.0
PROGRESS_TAG = "eagle/progress"
WAIT_S = 120
PAGE_HEIGHT = 1300  # the partition page's progress rows down to spend_usd_ledger
PARTITION_URL = f"/assets/responses?view=partitions&partition={DATASET}"

OBSERVATIONS = """
query Observations($partition: String!) {
  assetOrError(assetKey: {path: ["responses"]}) {
    ... on Asset {
      assetObservations(partitions: [$partition], limit: 200) {
        runId
        timestamp
        metadataEntries {
          label
          ... on IntMetadataEntry { intValue }
          ... on FloatMetadataEntry { floatValue }
        }
      }
    }
  }
}
"""
RUN = """
query Run($runId: ID!) { runOrError(runId: $runId) { ... on Run { status tags { key value } } } }
"""


def _write_slow_config(path, *, limit: int, latency_s: float) -> None:
    """Read at run time: the next run uses it (the dataset, hence the partitions, stays the same)."""
    write_config(path.parent, datasets=(DATASET,), limit=limit, simulated={"latency_s": latency_s})
    cfg = yaml.safe_load(path.read_text())
    cfg["backends"]["simulated"]["concurrency"] = 1
    cfg["generation"]["progress_every_s"] = PROGRESS_EVERY_S
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


@pytest.fixture(scope="module")
def slow_ui(tmp_path_factory):
    """`dagster dev` after a first, fast run of EARLIER_ROWS prompts; the configuration then asks for SLOW_ROWS."""
    tmp = tmp_path_factory.mktemp("dagster_ui_progress")
    path = tmp / "pipeline.yaml"
    _write_slow_config(path, limit=EARLIER_ROWS, latency_s=0.0)
    with running_dagster_dev(tmp, path) as ui:
        assert ui.gql("mutation { setNuxSeen }")["setNuxSeen"] is True
        assert wait_for_run(ui, launch_dataset_run(ui, DATASET))["status"] == "SUCCESS"
        _write_slow_config(path, limit=SLOW_ROWS, latency_s=SLOW_LATENCY_S)
        yield ui


def _answered(ui, run_id: str) -> list[int]:
    """current_prompts_answered of every observation of the run, oldest first."""
    events = ui.gql(OBSERVATIONS, {"partition": DATASET})["assetOrError"]["assetObservations"]
    values = []
    for e in sorted((e for e in events if e["runId"] == run_id), key=lambda e: float(e["timestamp"])):
        entry = {m["label"]: m for m in e["metadataEntries"]}.get("current_prompts_answered")
        if entry is not None:
            values.append(entry["intValue"])
    return values


def _run(ui, run_id: str) -> tuple[str, dict[str, str]]:
    run = ui.gql(RUN, {"runId": run_id})["runOrError"]
    return run["status"], {t["key"]: t["value"] for t in run["tags"]}


# The value cell of current_prompts_answered in the partition's metadata table, when it comes from an observation
# of the running run (the row's third cell says "Observed in run <id>"), else null.
_OBSERVED_ANSWERED = """(() => {
    const row = Array.from(document.querySelectorAll('tr')).find(
        r => r.cells.length > 2 && r.cells[0].innerText.trim() === 'current_prompts_answered');
    if (!row || !row.cells[2].innerText.includes('Observed in run %s')) return null;
    return row.cells[1].innerText.trim();
})()"""


async def _shown_answered(tab, url: str, run_id: str, above: int) -> int:
    """Loads `url` until the partition page shows an observed answered count above `above` (a person reloads, or
    presses the page's refresh button); returns it."""
    deadline = time.monotonic() + WAIT_S
    while True:
        await tab.navigate(url)
        value = await tab.wait_for(
            _OBSERVED_ANSWERED % run_id[:8], timeout=60, what="current_prompts_answered observed in the running run"
        )
        if int(value) > above:
            return int(value)
        assert time.monotonic() < deadline, f"the page still shows {value} answered after {WAIT_S}s"
        await asyncio.sleep(2)


_PROGRESS_LINE = rf"\[{DATASET}\] (\d+)/{SLOW_ROWS} done"  # the log line of each report


async def _browse_progress(ui, chromium: str, run_id: str, shots, profile) -> dict:
    """While the run goes on: its run page (a progress line and an observation in the event log), then the
    partition's page twice, the second time after the run answered more prompts."""
    from eagle_pipeline_tests.ui.cdp import chromium_tab

    url = ui.base_url + PARTITION_URL
    seen: dict = {}
    async with chromium_tab(chromium, profile, WIDTH, PAGE_HEIGHT) as tab:
        await tab.navigate(ui.base_url + f"/runs/{run_id}")
        seen["run_text"] = await tab.wait_for(
            f"(() => {{ const t = document.body && document.body.innerText;"
            f" return t && new RegExp({json.dumps(_PROGRESS_LINE)}).test(t) && t.includes('ASSET_OBSERVATION') && t; }})()",
            timeout=60,
            what="a progress line and an ASSET_OBSERVATION in the run's event log",
        )
        seen["run_status"] = _run(ui, run_id)[0]
        await tab.screenshot(shots / "ui_progress_run.png")

        seen["first"] = await _shown_answered(tab, url, run_id, above=0)
        seen["first_status"] = _run(ui, run_id)[0]
        seen["first_text"] = await tab.evaluate("document.body.innerText")
        await tab.screenshot(shots / "ui_progress_partition.png")
        deadline = time.monotonic() + WAIT_S
        while max(_answered(ui, run_id)) <= seen["first"]:  # the run answers more; then the page is looked at again
            assert time.monotonic() < deadline, "no further progress observed"
            await asyncio.sleep(0.5)
        seen["second"] = await _shown_answered(tab, url, run_id, above=seen["first"])
        seen["second_status"] = _run(ui, run_id)[0]
    return seen


def test_progress_advances_while_a_slow_generation_runs(slow_ui, chromium, screenshot_dir, tmp_path):
    """Through GraphQL and in the browser, while the run is STARTED: the answered count (earlier runs' rows
    included) grows, on the partition's page, in the run's event log and in the run's progress tag."""
    pytest.importorskip("aiohttp", reason="the DevTools-protocol driver needs aiohttp")
    ui = slow_ui
    run_id = launch_dataset_run(ui, DATASET)
    deadline = time.monotonic() + WAIT_S
    while not _answered(ui, run_id):
        assert time.monotonic() < deadline, f"no progress observation after {WAIT_S}s:\n{ui.log_tail()}"
        time.sleep(0.5)
    status, tags = _run(ui, run_id)
    assert status == "STARTED", status
    assert re.fullmatch(rf"{DATASET} \d+/{SLOW_ROWS} \(\d+%\) .* 0 failed", tags[PROGRESS_TAG]), tags

    seen = asyncio.run(
        asyncio.wait_for(_browse_progress(ui, chromium, run_id, screenshot_dir, tmp_path / "profile"), 4 * WAIT_S)
    )
    statuses = {k: v for k, v in seen.items() if k.endswith("_status")}
    assert set(statuses.values()) == {"STARTED"}, f"the run ended before the pages were seen: {statuses}"
    # The page's count starts from the rows of the earlier run and grows as the run answers.
    assert EARLIER_ROWS <= seen["first"] < seen["second"] <= SLOW_ROWS, seen
    assert f"Observed in run {run_id[:8]}" in seen["first_text"]
    for label in ("current_prompts", "percent_done", "eta_s", "rate_per_s", "spend_usd_this_run", "spend_usd_ledger"):
        assert f"\n{label}\n" in seen["first_text"], f"the partition page lacks {label}"
    assert f"Run {run_id[:8]} that targets this partition has started" in seen["first_text"]
    shown_in_log = [int(n) for n in re.findall(_PROGRESS_LINE, seen["run_text"])]
    assert shown_in_log and all(EARLIER_ROWS <= n <= SLOW_ROWS for n in shown_in_log), shown_in_log

    final = wait_for_run(ui, run_id)
    assert final["status"] == "SUCCESS", final
    answered = _answered(ui, run_id)
    assert answered == sorted(answered) and answered[0] >= EARLIER_ROWS and answered[-1] == SLOW_ROWS, answered
    assert len(set(answered)) >= 4, answered
    assert _run(ui, run_id)[1][PROGRESS_TAG].startswith(f"{DATASET} {SLOW_ROWS}/{SLOW_ROWS} (100%) ")
    for name in ("ui_progress_partition.png", "ui_progress_run.png"):
        assert _png_size((screenshot_dir / name).read_bytes()) == (WIDTH, PAGE_HEIGHT)
        _assert_not_blank(screenshot_dir / name)
