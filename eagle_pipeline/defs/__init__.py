"""The Dagster shell: assets, checks, resources, jobs and schedules that wire the functional core together."""
