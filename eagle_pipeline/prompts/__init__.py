"""Prompt sets (docs/generation.md, Prompt files): files as users have them read into prompts with stable sample ids
(sets.py), from the layouts formats.py reads. Import from here."""

from eagle_pipeline.prompts.sets import (
    PROMPTS_SCHEMA,
    VALID_ROLES,
    Prompt,
    PromptFileError,
    canonical_json,
    dataset_prompts_table,
    load_prompt_file,
    make_sample_id,
    normalized_prompt_key,
    prompts_table,
)

__all__ = [
    "PROMPTS_SCHEMA",
    "VALID_ROLES",
    "Prompt",
    "PromptFileError",
    "canonical_json",
    "dataset_prompts_table",
    "load_prompt_file",
    "make_sample_id",
    "normalized_prompt_key",
    "prompts_table",
]
