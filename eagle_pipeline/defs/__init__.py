"""The Dagster shell: assets, checks, resources, jobs and schedules that wire the functional core together.

The warnings Dagster 1.13 gives for the features this shell uses on purpose are silenced here, once, for every
process that loads the shell (the webserver, the daemon, runs, the demo, the tests), and only these: any other
preview or beta warning still shows.
"""

import warnings

import dagster as dg

# Each entry: (message prefix, category, why it is used).
KNOWN_WARNINGS = (
    # One partition per run, where partitioned asset checks work (docs/operations.md).
    ("Specifying a partitions_def on an AssetCheckSpec", dg.PreviewWarning),
    # Hidden-state shards backfill one run per shard (BackfillPolicy.multi_run(1)).
    ("Parameter `backfill_policy`", dg.BetaWarning),
    # `AssetSelection.assets(...).without_checks()` style selections in jobs.
    ("Parameter `include_sources`", dg.BetaWarning),
)
for _message, _category in KNOWN_WARNINGS:
    warnings.filterwarnings("ignore", message=_message, category=_category)
