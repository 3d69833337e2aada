"""Which committed responses answer a dataset's current prompts: the one definition of "complete".

A dataset's current prompts are the sample ids of its prompts table, each a hash of the dataset, the prompt and the
sampling settings. Responses committed under other settings (a larger `limit`, another seed) stay on disk and are
counted, but never reconstructed, audited or merged; retire them with `eagle-pipeline retire-responses` to move them
out of the dataset directory (generation/store/retire.py). So are rows another backend produced: a row answers a current
prompt only while its backend identity matches the dataset's backend (generation/store/identity.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle_pipeline.generation.store import shards
from eagle_pipeline.generation.store.identity import BackendIdentity, counting_identities
from eagle_pipeline.shared.arrow import value_counts


@dataclass(frozen=True)
class Coverage:
    """How far a dataset's committed responses cover its current prompts."""

    dataset: str
    prompts: int  # distinct current sample ids
    answered: int  # current sample ids with a committed response
    other_rows: int  # committed responses whose sample id is no current prompt's (kept on disk, never used)
    mismatched: str = ""  # rows of another backend (`identity.mismatch_report`): kept on disk, never used

    @property
    def missing(self) -> int:
        return self.prompts - self.answered

    @property
    def complete(self) -> bool:
        return self.missing == 0

    def describe(self) -> str:
        """One line for logs and messages, e.g. '0/4 current prompts answered (4 committed rows answer other prompts)'."""
        text = f"{self.answered}/{self.prompts} current prompts answered"
        if self.other_rows:
            text += f" ({self.other_rows} committed rows answer other prompts: kept on disk, not used)"
        if self.mismatched:
            text += f" (not from the configured backend, kept on disk, not used: {self.mismatched})"
        return text

    def metadata(self) -> dict[str, int]:
        return {
            "current_prompts": self.prompts,
            "current_prompts_answered": self.answered,
            "current_prompts_missing": self.missing,
            "rows_answering_other_prompts": self.other_rows,
        }


def prompt_sample_ids(prompts_path: str | os.PathLike) -> list[str]:
    """The sample ids of a prompts table on disk: the dataset's current prompts (none if never materialised)."""
    p = Path(prompts_path)
    return pq.read_table(p, columns=["sample_id"]).column("sample_id").to_pylist() if p.exists() else []


def coverage_of(
    dataset: str, prompt_ids: Iterable[str], committed_ids: Iterable[str], mismatched: str = ""
) -> Coverage:
    """Coverage of the prompts `prompt_ids` by the responses `committed_ids` (both sample ids)."""
    current = set(prompt_ids)
    committed = set(committed_ids)
    answered = len(current & committed)
    return Coverage(
        dataset=dataset,
        prompts=len(current),
        answered=answered,
        other_rows=len(committed) - answered,
        mismatched=mismatched,
    )


def dataset_coverage(
    dataset: str, prompt_ids: Iterable[str], responses_dir: str | os.PathLike, identity: BackendIdentity | None = None
) -> Coverage:
    """Coverage of a dataset's current prompts by the shards committed under `responses_dir` (by `identity`'s
    backend, when given: shards.read_committed)."""
    state = shards.read_committed(responses_dir, identity)
    return coverage_of(dataset, prompt_ids, state.answered, state.mismatched)


def _prompt_of_row(table: pa.Table) -> pa.ChunkedArray:
    """The prompt each row answers: its sample id, or the conversation's for a turn of a regenerated conversation."""
    if "conversation_id" not in table.column_names:
        return table.column("sample_id")
    return pc.coalesce(table.column("conversation_id"), table.column("sample_id"))


# The columns `current_responses` reads, besides what its caller keeps.
CURRENT_COLUMNS = ("sample_id", "backend_identity", "conversation_id", "turn_index", "conversation_end")


def current_responses(
    dataset: str, responses: pa.Table, prompt_ids: Iterable[str], identity: BackendIdentity | None = None
) -> tuple[pa.Table, Coverage]:
    """The rows of `responses` that answer one of `prompt_ids` (every turn of a current conversation; commit order
    kept) and, with `identity`, were produced by that backend (the others are described in the coverage)."""
    mismatched = ""
    if identity is not None and responses.num_rows:
        counting, mismatched = counting_identities(identity, responses.column("backend_identity"))
        responses = responses.filter(pc.is_in(responses.column("backend_identity"), value_set=counting))
    current = pa.array(sorted(set(prompt_ids)), pa.string())
    keep = pc.is_in(_prompt_of_row(responses), value_set=current)
    selected = responses.filter(keep)
    answered = shards.answered_ids(responses) if responses.num_rows else []
    return selected, coverage_of(dataset, current.to_pylist(), answered, mismatched)


def current_row_count(rows: pa.Table, prompt_ids: Iterable[str]) -> int:
    """How many of the committed rows `rows` (their `sample_id` and, where shards have it, `conversation_id`: a
    `shards.CommittedState`'s) answer one of `prompt_ids` (every committed turn of a current conversation): what
    `current_responses` selects, counted from two columns."""
    current = pa.array(sorted(set(prompt_ids)), pa.string())
    return int(pc.sum(pc.is_in(_prompt_of_row(rows), value_set=current)).as_py() or 0)


def resume_reason(
    dataset: str,
    prompt_ids: Iterable[str],
    responses_dir: str | os.PathLike,
    tokens_path: str | os.PathLike,
    identity: BackendIdentity | None = None,
) -> str | None:
    """Why a dataset needs another run (generation, reconstruction or audit), or None when it is complete.

    Complete means: every current prompt has a committed response, and the token samples on disk are exactly
    those responses (not those of earlier settings).
    """
    ids = set(prompt_ids)
    cov = dataset_coverage(dataset, ids, responses_dir, identity)
    if not cov.complete:
        return cov.describe()
    tokens = Path(tokens_path)
    if not tokens.exists():
        return f"{cov.describe()}; never reconstructed and audited"
    names = set(pq.read_schema(tokens).names)
    token_rows = pq.read_table(tokens, columns=[c for c in ("sample_id", "conversation_id") if c in names])
    if set(_prompt_of_row(token_rows).to_pylist()) != ids:
        return f"{cov.describe()}; the token samples on disk are not those of the current prompts"
    return None


def stale_token_samples(
    dataset: str, tokens_path: str | os.PathLike, responses_dir: str | os.PathLike, identity: BackendIdentity
) -> str | None:
    """Why the token samples on disk must not be merged because rows they were built from no longer count (another
    backend produced them: generation/store/identity.py), or None. Their audit may have passed: it judged other rows."""
    tokens = Path(tokens_path)
    if not tokens.exists():
        return None
    names = set(pq.read_schema(tokens).names)
    rows = pq.read_table(tokens, columns=[c for c in ("sample_id", "conversation_id") if c in names])
    built_from = set(_prompt_of_row(rows).to_pylist())
    state = shards.read_committed(responses_dir, identity)
    stale = built_from - state.answered
    if not stale:
        return None
    cov = coverage_of(dataset, built_from, state.answered, state.mismatched)
    return (
        f"{len(stale)} of {len(built_from)} token samples were built from rows that no longer count for backend "
        f"{identity.describe()} ({cov.describe()}); rematerialise the dataset (EAGLE_dataset) to regenerate them"
    )


def response_overview(root: Any, dataset: str) -> dict[str, Any]:
    """The responses columns of a dataset's overview row (`root` a storage.DataRoot): rows answering the current
    prompts, committed rows answering others, the ledger's spend (retired rows included), the current rows'
    provider split."""
    ids = prompt_sample_ids(root.prompts(dataset))
    parts = shards.part_files(root.responses_dir(dataset))
    cols = ["sample_id", "provider", "conversation_id", "turn_index", "conversation_end"]
    table = (
        pa.concat_tables([shards.read_shard_columns(p, cols) for p in parts], promote_options="default")
        if parts
        else pa.table({"sample_id": pa.array([], pa.string()), "provider": pa.array([], pa.string())})
    )
    current, cov = current_responses(dataset, table, ids)
    return {
        "responses": current.num_rows,
        "other_prompt_rows": cov.other_rows,
        "spend_usd": round(shards.committed_sample_ids(root.responses_dir(dataset))[1], 4),
        "providers": ", ".join(f"{k}:{v}" for k, v in value_counts(current.column("provider"), "unknown").items()),
    }
