"""The checks of extracted shards: the registry the Dagster shell declares, the structural verification, the semantic audit, and the layer guard of exports."""
