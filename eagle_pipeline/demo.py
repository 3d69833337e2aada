"""`make demo`: materialise the whole asset graph on the embedded defaults, offline, then say what it produced.

Every stage does its real work: generation over real HTTP against the simulated OpenRouter-format server,
reconstruction with the target tokenizer (the real Kimi one when $EAGLE_KIMI_TOKENIZER_DIR is set, else the demo
tokenizer), every audit gate as a blocking check, merge, draft vocabulary, hidden states from a tiny randomly
initialised model of the target's family, and trainer exports. The runs land in a persistent Dagster instance under
the data root, so `make ui` shows them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from eagle_pipeline.config import DEFAULT_CONFIG, ConfigError, load_config
from eagle_pipeline.drafter_types import TRAINERS
from eagle_pipeline.shared.storage import DataRoot, read_json

# The event stream goes to the instance (and the UI); the console gets progress lines and problems only.
QUIET = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}


def prepare_dagster_home(root: DataRoot) -> Path:
    """Create $DAGSTER_HOME under the data root with the project's dagster.yaml."""
    home = root.dagster_home
    home.mkdir(parents=True, exist_ok=True)
    src = DEFAULT_CONFIG.parent / "dagster.yaml"  # the checkout's, or the copy an installed wheel ships
    if src.exists():
        shutil.copyfile(src, home / "dagster.yaml")
    return home


def run_demo() -> int:
    cfg = load_config()
    root = DataRoot(cfg.data_root)
    os.environ["DAGSTER_HOME"] = str(prepare_dagster_home(root))

    import dagster as dg

    from eagle_pipeline.definitions import defs
    from eagle_pipeline.defs.partitions import SHARD_PARTITIONS_NAME
    from eagle_pipeline.defs.pools import ensure_pool_limits

    instance = dg.DagsterInstance.get()
    ensure_pool_limits(instance, cfg.pools.limits())  # the UI's Concurrency page lists them from the start
    t0 = time.monotonic()
    failures: dict[str, str] = {}  # run label -> its first failed step and that step's message

    def run(job_name: str, partition_key: str | None = None) -> bool:
        label = f"{job_name}[{partition_key}]" if partition_key else job_name
        print(f"==> {label}", flush=True)
        result = defs.resolve_job_def(job_name).execute_in_process(
            instance=instance, partition_key=partition_key, raise_on_error=False, run_config=QUIET
        )
        if not result.success:
            for event in result.all_events:
                if event.is_step_failure:
                    error = event.step_failure_data.error
                    message = error.message.strip() if error is not None else "no error recorded"
                    message = message.removeprefix("dagster._core.definitions.events.Failure: ")
                    print(f"    step failed: {event.step_key}: {message[:500]}")
                    failures.setdefault(label, f"{event.step_key} failed: {message.splitlines()[0][:160]}")
            failures.setdefault(label, "failed")
        return result.success

    for ds in cfg.dataset_names:
        run("EAGLE_dataset", ds)
    run("EAGLE_audit_view")  # the audit view, so the UI opens on every dataset's verdict
    if run("EAGLE_merge"):
        for key in sorted(instance.get_dynamic_partitions(SHARD_PARTITIONS_NAME)):
            run("EAGLE_hidden_states", key)
        run("EAGLE_exports")
    elif (root.exports_dir / "manifest.json").exists():
        # An earlier run's exports stay on disk: their check judges them again, so the UI marks them stale.
        run("EAGLE_exports_freshness")
    built_by = {}
    for asset in ("merged_dataset", "hidden_states", "trainer_exports"):
        event = instance.get_latest_materialization_event(dg.AssetKey(asset))
        built_by[asset] = event.run_id[:8] if event is not None else "?"
    print_summary(cfg, root, time.monotonic() - t0, failures, built_by)
    return 1 if failures else 0


def print_summary(cfg, root: DataRoot, elapsed: float, failures: dict[str, str], built_by: dict[str, str]) -> None:
    import pyarrow.parquet as pq

    from eagle_pipeline.audit.records import audit_stamps, describe_stale, stale_audit_stamps
    from eagle_pipeline.generation.store.coverage import dataset_coverage, prompt_sample_ids
    from eagle_pipeline.generation.store.identity import dataset_identity
    from eagle_pipeline.tokens import resolve_tokenizer

    tok = resolve_tokenizer(cfg.target.tokenizer)
    print("\n" + "=" * 78)
    print(f"eagle-pipeline demo finished in {elapsed:.0f} s   data root: {root.root}")
    label = "DEMO tokenizer (set EAGLE_KIMI_TOKENIZER_DIR for the real Kimi one)" if tok.kind == "demo" else tok.source
    print(f"tokenizer: {tok.name} [{tok.kind}] {label}")
    print("generation: SIMULATED OpenRouter-format loopback server (no API key, no spend)\n")
    # One heading word per column: answered = responses to the current prompts, token_samples = its audited rows.
    print(f"{'dataset':<8}{'answered':>9}{'token_samples':>15}{'audit':>7}  findings")
    for ds in cfg.dataset_names:
        ids = prompt_sample_ids(root.prompts(ds)) if root.prompts(ds).exists() else []
        # Responses to the current prompts, by the configured backend (generation/store/identity.py).
        n_resp = dataset_coverage(ds, ids, root.responses_dir(ds), dataset_identity(cfg, ds, tok)).answered
        n_tok = pq.read_metadata(root.tokens(ds)).num_rows if root.tokens(ds).exists() else 0
        verdict, findings = "-", failures.get(f"EAGLE_dataset[{ds}]", "")
        if root.audit_report(ds).exists():
            verdict, audit_findings = _audit_findings(read_json(root.audit_report(ds)))
            findings = "; ".join(f for f in (findings, audit_findings) if f)
        print(f"{ds:<8}{n_resp:>9}{n_tok:>15}{verdict:>7}  {findings}")
    # An output built from dataset audits that are no longer the current ones says so, with the run that built it.
    manifest = root.merged_dir / "manifest.json"
    merged_stale = {}
    if manifest.exists():
        m = read_json(manifest)
        merged_stale = stale_audit_stamps(audit_stamps(root, m["upstream_versions"]))
        mark = _stale_mark(merged_stale, built_by["merged_dataset"])
        print(f"\nmerged: {m['rows_total']} rows, {m['tokens_total']} tokens -> {root.merged_dir}{mark}")
    shards = sorted(root.hidden_states_dir.glob("shard-*.safetensors"))
    h = cfg.hidden_states
    engine = "vLLM engine, " + ", ".join(h.vllm.endpoints) if h.engine == "vllm" else "in process"
    mark = _stale_mark(merged_stale, built_by["hidden_states"]) if shards else ""
    print(f"hidden states: {len(shards)} shard(s) ({engine}) -> {root.hidden_states_dir}{mark}")
    print(f"draft vocabulary -> {root.draft_vocab_dir}")
    exports = root.exports_dir / "manifest.json"
    exports_stale = stale_audit_stamps(read_json(exports).get("dataset_audits", {})) if exports.exists() else {}
    print(f"trainer exports -> {root.exports_dir}{_stale_mark(exports_stale, built_by['trainer_exports'])}")
    if merged_stale or exports_stale:
        print(
            f"  stale = built from audits that are no longer current: {describe_stale(merged_stale or exports_stale)}"
        )
    for name in TRAINERS:  # each trainer layout exports into the folder of its name
        export = root.exports_dir / name / "export.json"
        if export.exists():
            e = read_json(export)
            extra = e["extra"].get("args") or e["extra"]["config"]["data.hidden_states_path"]
            rows = ", ".join(f"{n} {split}" for split, n in sorted(e["rows"].items(), key=lambda kv: kv[0] != "train"))
            print(f"  {name}: {rows} rows, final state {e['final_state']}; {extra}")
    if failures:
        print(f"\nFAILED runs: {', '.join(failures)}")
    print("\nOpen the Dagster UI on these runs:  make ui   (then http://127.0.0.1:3000)")
    print("=" * 78)


def _audit_findings(report: dict) -> tuple[str, str]:
    """The audit column and what it found, for people: the gates that block by their counts, then the gates that
    only filtered or warned, apart (a warn-only gate is not a failing gate)."""
    blocks, others = [], []
    for name, g in report["gates"].items():
        if g.get("blocking"):
            blocks.append(f"{name} {g['failing']} of {g['checked']}")
        elif g["failing"]:
            others.append(f"{name} {g['failing']} ({g['action']})")
    parts = ([f"blocked by {', '.join(blocks)}"] if blocks else []) + others
    return ("pass" if report.get("passed") else "FAIL"), "; ".join(parts)


def _stale_mark(stale: dict[str, str], run_id: str) -> str:
    """'   [stale: built by run abc12345; datasets B1, B6]' for an output built from audits no longer current."""
    return f"   [stale: built by run {run_id}; datasets {', '.join(sorted(stale))}]" if stale else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle_pipeline.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--print-dagster-home", action="store_true", help="prepare and print $DAGSTER_HOME, then exit")
    args = parser.parse_args(argv)
    if args.print_dagster_home:
        try:
            cfg = load_config()
        except ConfigError as exc:  # `make ui` ends on this message: the problems, not a traceback above them
            print(f"ConfigError: {exc}", file=sys.stderr)
            return 2
        print(prepare_dagster_home(DataRoot(cfg.data_root)))
        return 0
    return run_demo()


if __name__ == "__main__":
    sys.exit(main())
