"""Merge audited token samples, build the draft vocabulary, export for trainers. See docs/merge.md."""

from eagle_pipeline.merge.checks import (
    check_loss_mask_aligned,
    check_row_count,
    check_shard_hashes,
    check_supervised_spans_end_with_eot,
    check_unique_sample_ids,
)
from eagle_pipeline.merge.core import merge_datasets
from eagle_pipeline.merge.export import (
    HF_SCHEMA,
    ExportSummary,
    export_hf_parquet,
    export_specforge_jsonl,
    hf_manifest_path,
)
from eagle_pipeline.merge.manifest import (
    MANIFEST_NAME,
    MERGED_SCHEMA,
    MergeInput,
    MergeManifest,
    MergeSettings,
    merged_shard_paths,
)
from eagle_pipeline.merge.reader import iter_merged_shards, read_merged
from eagle_pipeline.merge.vocab import (
    D2T_NPY,
    DRAFT_VOCAB_PT,
    SUMMARY_JSON,
    T2D_NPY,
    TOKEN_COUNTS_NPY,
    DraftVocabSummary,
    build_draft_vocab,
    count_supervised_tokens,
    load_draft_vocab,
    select_draft_vocab,
)

__all__ = [
    "D2T_NPY",
    "DRAFT_VOCAB_PT",
    "HF_SCHEMA",
    "MANIFEST_NAME",
    "MERGED_SCHEMA",
    "SUMMARY_JSON",
    "T2D_NPY",
    "TOKEN_COUNTS_NPY",
    "DraftVocabSummary",
    "ExportSummary",
    "MergeInput",
    "MergeManifest",
    "MergeSettings",
    "build_draft_vocab",
    "check_loss_mask_aligned",
    "check_row_count",
    "check_shard_hashes",
    "check_supervised_spans_end_with_eot",
    "check_unique_sample_ids",
    "count_supervised_tokens",
    "export_hf_parquet",
    "export_specforge_jsonl",
    "hf_manifest_path",
    "iter_merged_shards",
    "load_draft_vocab",
    "merge_datasets",
    "merged_shard_paths",
    "read_merged",
    "select_draft_vocab",
]
