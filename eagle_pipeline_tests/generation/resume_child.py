"""Child process of the kill -9 resume test: one generate_dataset run against a server owned by the test.

python -m eagle_pipeline_tests.generation.resume_child PROMPTS_PARQUET URL ROOT [OPTIONS_JSON]

OPTIONS_JSON (optional): {"backend": {BackendSpec overrides}, "commit_every_rows": N, "commit_every_s": T,
"dataset": NAME, "regenerate": MODE, "answer_log_s": S (null: no answer log)}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq

from eagle_pipeline.generation.run.options import RunOptions
from eagle_pipeline.generation.run.runner import generate_dataset
from eagle_pipeline.generation.spec import BackendSpec
from eagle_pipeline.generation.store.answer_log import DEFAULT_FLUSH_S

from .generation_helpers import SAMPLING


def main() -> None:
    prompts_path, url, root = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    backend = BackendSpec(
        **{
            "name": "sim",
            "kind": "simulated",
            "endpoint": url,
            "model": "moonshotai/kimi-k2.5",
            "concurrency": 8,
            "timeout_s": 10.0,
            "max_retries": 5,
            "backoff_base_s": 0.01,
            "backoff_max_s": 0.05,
            **options.get("backend", {}),
        }
    )
    dataset = options.get("dataset", "B1")
    s = generate_dataset(
        dataset=dataset,
        prompts=pq.read_table(prompts_path),
        backend=backend,
        sampling=SAMPLING,
        out_dir=root / "responses" / dataset,
        errors_dir=root / "responses" / dataset / "errors",
        options=RunOptions(
            commit_every_rows=options.get("commit_every_rows", 4),
            commit_every_s=options.get("commit_every_s", 0.05),
            progress_every_s=3600,
            regenerate=options.get("regenerate", "last_turn"),
            answer_log_s=options.get("answer_log_s", DEFAULT_FLUSH_S),
        ),
    )
    print(json.dumps(s.to_dict()))


if __name__ == "__main__":
    main()
