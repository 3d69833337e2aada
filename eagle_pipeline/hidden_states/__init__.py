"""Hidden-state extraction for EAGLE-3 drafter training, in the order of the data: `plan` (before any GPU), `engines`
(rows to states), `store` and `layouts` (what is written, and in which trainer's layout), `checks`, and `run`, the
stage's core calls that the Dagster assets, the CLI and scripts share. See docs/hidden_states.md."""
