"""What every stage uses and no stage owns: atomic storage and the data-root layout, Arrow column helpers, progress
reports, the settings base, the HTTP transport with its failure classes, and the loopback HTTP harness. It imports
no other package of eagle_pipeline (pyproject.toml's layers contract)."""
