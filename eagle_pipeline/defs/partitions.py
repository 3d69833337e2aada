"""Partitions: one per dataset (from the configuration), one per hidden-state shard (filled by the merge)."""

import dagster as dg

from eagle_pipeline.config import load_config

SHARD_PARTITIONS_NAME = "hidden_state_shards"


def dataset_partitions_for(dataset_names: list[str]) -> dg.StaticPartitionsDefinition:
    return dg.StaticPartitionsDefinition(list(dataset_names))


# Read once when the code location loads: the datasets in the configuration are the partitions.
dataset_partitions = dataset_partitions_for(load_config().dataset_names)
shard_partitions = dg.DynamicPartitionsDefinition(name=SHARD_PARTITIONS_NAME)


def shard_key(index: int) -> str:
    return f"{index:05d}"
