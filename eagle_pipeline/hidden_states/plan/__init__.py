"""The extraction's plans before any GPU is touched: disk, GPUs and wall time, item by item, for the target and for this run."""
