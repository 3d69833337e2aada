"""Concurrency pools that exist, with their limits, before anything uses them.

Dagster lists a pool on its Concurrency page only once the instance holds a limit for it, which by default happens
when a step first claims a slot. The limits live in the pipeline configuration (`pools:`); `ensure_pool_limits`
writes each one the instance does not have yet and never overwrites a limit someone set in the UI or with
`dagster instance concurrency set`. It runs from `make demo`, from `make ui` before the server starts
(`python -m eagle_pipeline.defs.pools`) and in the `pool_limits` sensor, which is on by default, so a deployment's
daemon creates the pools on its first tick.
"""

from __future__ import annotations

from collections.abc import Mapping

import dagster as dg

from eagle_pipeline.config import load_config
from eagle_pipeline.defs.resources import PipelineResource


def ensure_pool_limits(instance: dg.DagsterInstance, limits: Mapping[str, int]) -> dict[str, int]:
    """Set the limit of every pool in `limits` that the instance has none for; return the pools it set."""
    storage = instance.event_log_storage
    present = storage.get_concurrency_keys()
    created = {pool: int(limit) for pool, limit in limits.items() if pool not in present}
    for pool, limit in created.items():
        storage.set_concurrency_slots(pool, limit)
    return created


@dg.sensor(
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Creates the llm_api and gpu concurrency pools with the limits of the pipeline configuration "
    "(`pools:`) where the instance has none yet; never changes a limit that is already set.",
)
def pool_limits(context: dg.SensorEvaluationContext, pipeline: PipelineResource) -> dg.SkipReason:
    limits = pipeline.config().pools.limits()
    created = ensure_pool_limits(context.instance, limits)
    if created:
        context.log.info(f"created concurrency pools {created}")
        return dg.SkipReason(f"created pools {created}")
    return dg.SkipReason(f"every pool has a limit: {sorted(limits)}")


def main() -> None:
    """`python -m eagle_pipeline.defs.pools`: create the configured pools on the instance in $DAGSTER_HOME."""
    with dg.DagsterInstance.get() as instance:
        created = ensure_pool_limits(instance, load_config().pools.limits())
    print(f"concurrency pools created: {created}" if created else "concurrency pools: every pool already has a limit")


if __name__ == "__main__":
    main()
