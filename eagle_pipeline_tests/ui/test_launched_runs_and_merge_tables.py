"""What a person sees after clicking in the UI (issue 16, item 3), in headless Chromium on the package's `dagster dev`:

- a run launched from an asset's page (`audit_overview`'s *Materialize*; one partition of `token_samples` through the
  launch dialog) carries the project's job name on its run page and in the Runs list, not `__ASSET_JOB` or a list of
  assets, and GraphQL's `jobName` is that job;
- a successful merge (of the datasets the audit view marks fit, through a pipeline configuration that lists only
  them) shows its per-dataset tables at 1280 px with every column header visible, nothing overflowing sideways, and
  the figures of the merge's own metadata.

B6 is the partition launched from the dialog: its rerun fails its audit again, so B6 stays the latest evaluation of
every check, which the other tests' pages describe. The module's name sorts after test_browser_smoke.py, whose asset
graph screenshot shows nothing merged yet.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import yaml

from eagle_pipeline.audit import GATES
from eagle_pipeline_tests.ui.conftest import FAILING, PASSING, ROWS, launch_job_run, wait_for_run
from eagle_pipeline_tests.ui.test_browser_smoke import PAGE_TIMEOUT_S, _assert_not_blank, _png_size

pytestmark = pytest.mark.slow

NARROW_WIDTH = 1280
SESSION_TIMEOUT_S = 240  # one browser session
RUNS_QUERY = """
query Runs {
  runsOrError(limit: 30) {
    ... on Runs {
      results { runId jobName status assetSelection { path } assetCheckSelection { name } tags { key value } }
    }
  }
}
"""
_TEXT = "(document.body ? document.body.innerText : '')"
_BUTTON = "Array.from(document.querySelectorAll({scope!r})).find(b => b.innerText.trim() === {label!r} && !b.disabled)"
_LAUNCHED = r"Launched run ([0-9a-f]{8})"


def _button(label: str, scope: str = "button") -> str:
    return _BUTTON.format(scope=scope, label=label)


async def _launched_run_prefix(tab) -> str:
    """The id the UI's toast names after a launch ("Launched run 2043e25f")."""
    text = await tab.wait_for(
        f"(() => {{ const t = {_TEXT}; return new RegExp({json.dumps(_LAUNCHED)}).test(t) && t; }})()",
        timeout=PAGE_TIMEOUT_S,
        what="the 'Launched run <id>' toast",
    )
    return re.search(_LAUNCHED, text).group(1)


async def _materialize_audit_view(tab, base_url: str) -> str:
    """audit_overview's page → Materialize (not partitioned: it launches at once)."""
    await tab.navigate(base_url + "/assets/audit_overview")
    await tab.wait_for(f"!!{_button('Materialize')}", timeout=PAGE_TIMEOUT_S, what="the Materialize button")
    await tab.evaluate(f"{_button('Materialize')}.click()")
    return await _launched_run_prefix(tab)


_DIALOG = """Array.from(document.querySelectorAll('[role=dialog]')).find(
    d => d.innerText.includes('Launch runs to materialize token_samples'))"""


async def _materialize_one_partition(tab, base_url: str, partition: str) -> tuple[str, str]:
    """token_samples' page → Materialize… → the partition selector → `partition` → Launch 1 run.
    Returns (the dialog's text before the launch, the launched run's id prefix)."""
    await tab.navigate(base_url + "/assets/token_samples")
    await tab.wait_for(f"!!{_button('Materialize…')}", timeout=PAGE_TIMEOUT_S, what="the Materialize… button")
    await tab.evaluate(f"{_button('Materialize…')}.click()")
    selector = f"({_DIALOG} || document).querySelector('[class*=TagSelector_tagSelectorContainer]')"
    await tab.wait_for(f"!!{_DIALOG} && !!{selector}", timeout=PAGE_TIMEOUT_S, what="the launch dialog")
    await tab.evaluate(f"{selector}.click()")
    item = f"document.querySelector('.dagster-popover [title={partition}]')"
    await tab.wait_for(f"!!{item}", timeout=PAGE_TIMEOUT_S, what=f"{partition} in the partition list")
    await tab.evaluate(f"{item}.closest('[role=menuitem]').click()")
    launch = _button("Launch 1 run", "[role=dialog] button")
    await tab.wait_for(f"!!{launch}", timeout=PAGE_TIMEOUT_S, what="'Launch 1 run' once one partition is selected")
    dialog = await tab.evaluate(f"{_DIALOG}.innerText")
    await tab.evaluate(f"{launch}.click()")
    return dialog, await _launched_run_prefix(tab)


# The Runs list (a virtualized grid, one RunsFeedRow per run): each row's text, found by the run's id link.
_RUN_ROW = """(() => {
    const link = Array.from(document.querySelectorAll('a')).find(a => a.innerText.trim() === %s);
    const row = link && link.closest('[class*=RunsFeedRow_rowGrid]');
    return row ? row.innerText : null;
})()"""


async def _read_run_pages(tab, base_url: str, runs: dict[str, dict], png: Path) -> dict:
    """Each run's page, then the Runs list: what a person reads there about each run."""
    seen: dict = {}
    for key, run in runs.items():
        await tab.navigate(f"{base_url}/runs/{run['runId']}")
        seen[key] = await tab.wait_for(
            f"(() => {{ const t = {_TEXT}; return t.includes('Run of') && t.includes({run['jobName']!r}) && t; }})()",
            timeout=PAGE_TIMEOUT_S,
            what=f"the run page of {run['runId'][:8]} naming {run['jobName']}",
        )
    await tab.navigate(base_url + "/runs")
    for key, run in runs.items():
        seen[f"{key} row"] = await tab.wait_for(
            _RUN_ROW % json.dumps(run["runId"][:8]), timeout=PAGE_TIMEOUT_S, what=f"the Runs row of {run['runId'][:8]}"
        )
    await asyncio.sleep(0.5)
    await tab.screenshot(png)
    return seen


def _run_by_prefix(ui, prefix: str) -> dict:
    found = [r for r in ui.gql(RUNS_QUERY)["runsOrError"]["results"] if r["runId"].startswith(prefix)]
    assert len(found) == 1, (prefix, found)
    return found[0]


def _tags(run: dict) -> dict[str, str]:
    return {t["key"]: t["value"] for t in run["tags"]}


def test_runs_launched_from_an_asset_page_carry_the_project_job_name(
    chromium, ui_without_welcome, audit_view, screenshot_dir, tmp_path
):
    """audit_overview's Materialize and one token_samples partition through the launch dialog: GraphQL's jobName,
    the run page and the Runs list all name the project's job. (`audit_view` first: the sensor's own refresh is what
    the other tests read, and a click made before it would take its place.)"""
    pytest.importorskip("aiohttp", reason="the DevTools-protocol driver needs aiohttp")
    from eagle_pipeline_tests.ui.cdp import chromium_tab

    ui = ui_without_welcome
    png = screenshot_dir / "ui_runs_job_names.png"
    png.unlink(missing_ok=True)

    async def launch() -> tuple[str, str, str]:
        async with chromium_tab(chromium, tmp_path / "profile-launch", NARROW_WIDTH, 1000) as tab:
            view = await _materialize_audit_view(tab, ui.base_url)
            dialog, partition = await _materialize_one_partition(tab, ui.base_url, FAILING)
            return view, dialog, partition

    view_prefix, dialog, partition_prefix = asyncio.run(asyncio.wait_for(launch(), SESSION_TIMEOUT_S))
    assert "1 partition" in dialog and FAILING in dialog, dialog

    view_run = wait_for_run(ui, _run_by_prefix(ui, view_prefix)["runId"])
    partition_run = wait_for_run(ui, _run_by_prefix(ui, partition_prefix)["runId"])
    runs = {"audit view": _run_by_prefix(ui, view_prefix), "partition": _run_by_prefix(ui, partition_prefix)}
    # Through GraphQL: the project's jobs, with the selection and (for the dataset) every audit check.
    assert runs["audit view"]["jobName"] == "EAGLE_audit_view", runs["audit view"]
    assert runs["audit view"]["assetSelection"] == [{"path": ["audit_overview"]}]
    assert view_run["status"] == "SUCCESS", ui.log_tail()
    assert runs["partition"]["jobName"] == "EAGLE_dataset", runs["partition"]
    assert runs["partition"]["assetSelection"] == [{"path": ["token_samples"]}]
    assert {c["name"] for c in runs["partition"]["assetCheckSelection"]} == {g.name for g in GATES}
    assert _tags(runs["partition"])["dagster/partition"] == FAILING
    # B6 is still over-billed: its rerun fails in token_samples (whose checks hold the audit), and only there.
    assert partition_run["status"] == "FAILURE"
    failed = {s["stepKey"] for s in partition_run["stepStats"] if s["status"] == "FAILURE"}
    assert failed == {"token_samples"}, partition_run["stepStats"]
    for run in runs.values():
        assert _tags(run).get("dagster/from_ui") == "true", run

    async def read() -> dict:
        async with chromium_tab(chromium, tmp_path / "profile-runs", NARROW_WIDTH, 1000) as tab:
            return await _read_run_pages(tab, ui.base_url, runs, png)

    seen = asyncio.run(asyncio.wait_for(read(), SESSION_TIMEOUT_S))
    (tmp_path / "seen.json").write_text(json.dumps(seen, indent=1))
    for key, run in runs.items():
        page, row = seen[key], seen[f"{key} row"]
        assert f"{run['jobName']} @" in page and "__ASSET_JOB" not in page, page[:1500]
        # The Runs list's Target column: the job's name, not the implicit job nor the list of assets it ran.
        assert run["jobName"] in row and "__ASSET_JOB" not in row, row
        assert not any(a["path"][0] in row.split("\n") for a in run["assetSelection"]), row
    assert f"partition: {FAILING}" in seen["partition row"]
    assert _png_size(png.read_bytes()) == (NARROW_WIDTH, 1000)
    _assert_not_blank(png)


# --- A successful merge, and its per-dataset tables at 1280 px ---

MERGE_TABLES = ("per_dataset_rows", "per_dataset_requests", "per_dataset_providers")
MERGED_QUERY = """
query Merged {
  assetOrError(assetKey: {path: ["merged_dataset"]}) {
    ... on Asset {
      assetMaterializations(limit: 10) {
        runId
        timestamp
        metadataEntries {
          label
          ... on IntMetadataEntry { intValue }
          ... on JsonMetadataEntry { jsonString }
          ... on TableMetadataEntry { table { records schema { columns { name } } } }
        }
      }
    }
  }
}
"""


@pytest.fixture(scope="module")
def fit_merge(dagster_ui, audit_view, refused_merge, tmp_path_factory) -> dict:
    """EAGLE_merge of only the datasets the audit view marks fit: the same configuration, with its `datasets` cut to
    those, given to the run as the pipeline resource's `config_file` (run config). After the refused merge of the
    full configuration, which that refusal keeps asserting. Returns {"run", "materialization": label -> entry}."""
    fit = [
        r["dataset"]
        for r in map(json.loads, audit_view["metadata"]["datasets"]["table"]["records"])
        if r["fit"] == "yes"
    ]
    assert fit == [PASSING], fit
    cfg = yaml.safe_load(dagster_ui.config.read_text())
    cfg["datasets"] = [d for d in cfg["datasets"] if d["name"] in fit]
    path = tmp_path_factory.mktemp("fit_merge") / "pipeline.fit.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    run_config = {"resources": {"pipeline": {"config": {"config_file": str(path)}}}}
    run = wait_for_run(dagster_ui, launch_job_run(dagster_ui, "EAGLE_merge", run_config=run_config))
    assert run["status"] == "SUCCESS", dagster_ui.log_tail()
    mats = dagster_ui.gql(MERGED_QUERY)["assetOrError"]["assetMaterializations"]
    ours = [m for m in mats if m["runId"] == run["runId"]]
    assert len(ours) == 1, mats
    return {
        "run": run,
        "timestamp": ours[0]["timestamp"],
        "metadata": {e["label"]: e for e in ours[0]["metadataEntries"]},
    }


# Each per_dataset_* table in the materialization's metadata: its box, whether it scrolls, where each header is, and
# the right edge a person can see (the window's, narrowed by every ancestor that clips sideways).
_MERGE_TABLES = """(() => {
    const visibleRight = el => {
        let right = window.innerWidth;
        for (let a = el.parentElement; a; a = a.parentElement) {
            if (getComputedStyle(a).overflowX !== 'visible') right = Math.min(right, a.getBoundingClientRect().right);
        }
        return right;
    };
    const out = {};
    for (const row of document.querySelectorAll('tr')) {
        const label = row.cells.length > 1 ? row.cells[0].innerText.trim() : '';
        const table = label.startsWith('per_dataset_') ? row.cells[1].querySelector('table') : null;
        if (!table) continue;
        const box = table.getBoundingClientRect();
        const outer = row.closest('table');
        out[label] = {
            left: Math.round(box.left), right: Math.round(box.right), width: Math.round(box.width),
            scroll: table.scrollWidth, visible_right: Math.round(visibleRight(table)),
            outer_scroll: outer.scrollWidth, outer_box: Math.round(outer.parentElement.clientWidth),
            headers: Array.from(table.querySelectorAll('th')).map(h => {
                const r = h.getBoundingClientRect();
                return {text: h.innerText.trim(), left: Math.round(r.left), right: Math.round(r.right),
                        visible_right: Math.round(visibleRight(h))};
            }),
            rows: Array.from(table.querySelectorAll('tr')).filter(r => r.querySelector('td'))
                .map(r => Array.from(r.cells).map(c => c.innerText.trim())),
        };
    }
    return Object.keys(out).length === %d ? out : null;
})()"""


async def _merge_tables(tab, url: str, run_id: str, png: Path) -> tuple[dict, int]:
    await tab.navigate(url)
    await tab.wait_for(
        f"{_TEXT}.includes('Materialized in run {run_id[:8]}')", timeout=PAGE_TIMEOUT_S, what="the merge's event"
    )
    tables = await tab.wait_for(
        _MERGE_TABLES % len(MERGE_TABLES), timeout=PAGE_TIMEOUT_S, what=f"the {len(MERGE_TABLES)} per-dataset tables"
    )
    await asyncio.sleep(1.0)  # let the remaining queries settle, then measure again
    tables = await tab.evaluate(_MERGE_TABLES % len(MERGE_TABLES))
    scroll_width = await tab.evaluate("document.documentElement.scrollWidth")
    await tab.screenshot(png)
    return tables, scroll_width


def test_a_successful_merge_shows_its_per_dataset_tables_whole_at_1280_px(
    chromium, ui_without_welcome, fit_merge, screenshot_dir, tmp_path
):
    pytest.importorskip("aiohttp", reason="the DevTools-protocol driver needs aiohttp")
    from eagle_pipeline_tests.ui.cdp import chromium_tab

    ui = ui_without_welcome
    meta = fit_merge["metadata"]
    run_id = fit_merge["run"]["runId"]
    png = screenshot_dir / "ui_merged_dataset_tables.png"
    png.unlink(missing_ok=True)
    url = f"{ui.base_url}/assets/merged_dataset?view=events&time={fit_merge['timestamp']}"

    async def run():
        async with chromium_tab(chromium, tmp_path / "profile", NARROW_WIDTH, 1000) as tab:
            return await _merge_tables(tab, url, run_id, png)

    tables, scroll_width = asyncio.run(asyncio.wait_for(run(), SESSION_TIMEOUT_S))
    (tmp_path / "tables.json").write_text(json.dumps(tables, indent=1))
    assert scroll_width <= NARROW_WIDTH, f"the page scrolls sideways: {scroll_width} px (tables in {tmp_path})"
    for label in MERGE_TABLES:
        shown, table = tables[label], meta[label]["table"]
        columns = [c["name"] for c in table["schema"]["columns"]]
        # Every column header is there, inside the window and inside every box that clips it.
        assert [h["text"] for h in shown["headers"]] == columns, (label, shown["headers"])
        for header in shown["headers"]:
            assert 0 <= header["left"] < header["right"] <= min(NARROW_WIDTH, header["visible_right"]), (label, header)
        # Nothing overflows: the table is as wide as its content, ends where it can be seen, and so does the
        # metadata table around it.
        assert shown["scroll"] <= shown["width"] + 1 and shown["right"] <= shown["visible_right"], (label, shown)
        assert shown["outer_scroll"] <= shown["outer_box"] + 1, (label, shown)
        # The figures shown are the materialization's.
        records = [json.loads(r) for r in table["records"]]
        assert shown["rows"] == [[str(r[c]) for c in columns] for r in records], (label, shown["rows"], records)

    # And they agree with the merge's other metadata: only the fit dataset, all its rows, its audit passed.
    rows = {r["dataset"]: r for r in map(json.loads, meta["per_dataset_rows"]["table"]["records"])}
    assert set(rows) == {PASSING}, rows
    assert rows[PASSING]["merged_rows"] == json.loads(meta["rows_per_dataset"]["jsonString"])[PASSING]
    assert rows[PASSING]["merged_rows"] == meta["dagster/row_count"]["intValue"] == ROWS
    assert rows[PASSING]["responses"] == rows[PASSING]["token_samples"] == ROWS and rows[PASSING]["audit"] == "pass"
    spend = {r["dataset"]: r for r in map(json.loads, meta["per_dataset_requests"]["table"]["records"])}
    assert spend[PASSING]["spend_usd"] > 0 and spend[PASSING]["failed_requests"] == 0
    assert _png_size(png.read_bytes()) == (NARROW_WIDTH, 1000)
    _assert_not_blank(png)
