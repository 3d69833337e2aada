"""Child process of the spend-ledger tests: one run's share of a data root's spend ledger, held until stdin closes.

python -m eagle_pipeline_tests.generation.ledger_child RESPONSES_ROOT DATASET COMMITTED ANSWERED RESERVED

Joins the ledger of RESPONSES_ROOT (`{data_root}/responses`) for DATASET with COMMITTED as its committed spend,
records ANSWERED as one answer's cost and RESERVED as its in-flight projection, prints "ready" once its slot holds
them, and leaves the ledger when stdin closes (a test may kill -9 it instead).
"""

from __future__ import annotations

import sys
from pathlib import Path

from eagle_pipeline.generation.spend.ledger import SharedSpend


def main() -> None:
    root, dataset = Path(sys.argv[1]), sys.argv[2]
    committed, answered, reserved = (float(x) for x in sys.argv[3:6])
    shared = SharedSpend(1e9, [root / dataset])
    with shared.join(dataset, committed) as run:
        run.add(answered)
        run.reached(reserved)
        run.publish()
        print("ready", flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
