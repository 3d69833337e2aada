"""The trainers' own layouts of the states (shards, SpecForge, speculators), and the exports and drafter hand-off built from finished shards."""
