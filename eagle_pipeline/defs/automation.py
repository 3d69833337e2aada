"""Declarative automation: each stage follows its upstream only when every upstream partition's checks passed.

Dagster's built-in `all_deps_blocking_checks_passed()` is true when ANY partition of each dependency passed, which
lets a fan-in asset (the merge over eight datasets) run while one dataset's audit failed. This condition asks for
no upstream partition with a blocking check that neither passed nor is about to run.
"""

import dagster as dg

AC = dg.AutomationCondition

every_upstream_partition_passed = ~AC.any_deps_match(
    AC.any_checks_match(~AC.check_passed() & ~AC.will_be_requested(), blocking_only=True)
).with_label("every upstream partition passed its blocking checks")

# Materialise when upstream changes (eager), but only once every upstream partition passed its blocking checks.
after_checks_pass = AC.eager() & every_upstream_partition_passed

# The audit view follows the audits: after any dataset's token samples or any of their checks were updated, once no
# dataset run is in progress (so a run's fourteen check results are in). since_last_handled keeps an update seen while
# a run was still going until the view has been refreshed.
after_any_audit = (
    (AC.any_deps_updated() | AC.any_deps_match(AC.any_checks_match(AC.newly_updated()))).since_last_handled()
    & ~AC.any_deps_in_progress()
    & ~AC.in_progress()
).with_label("after any dataset's audit")

# Running from the start (the view must never need a click) and evaluated by the daemon; it targets only the audit
# view, so every other asset's automation stays with the default sensor, stopped until a user starts it.
audit_view_sensor = dg.AutomationConditionSensorDefinition(
    "audit_view_sensor",
    target=dg.AssetSelection.assets("audit_overview"),
    default_status=dg.DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=30,  # Dagster's default; each tick costs the daemon a pass over the asset graph
    run_tags={"eagle/launched_by": "audit_view_sensor"},
    description="Refreshes audit_overview after any dataset's audit (token_samples and its checks) changed.",
)
