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
