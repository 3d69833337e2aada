"""The one resource every asset uses: the pipeline configuration, its data root, tokenizer and model profile."""

import functools
from pathlib import Path

import dagster as dg

from eagle_pipeline.config import PipelineConfig, config_path, load_config
from eagle_pipeline.shared.storage import DataRoot


@functools.lru_cache(maxsize=4)
def _load_config_cached(path: str, mtime: float) -> PipelineConfig:
    return load_config(path)


@functools.lru_cache(maxsize=4)
def _tokenizer_cached(spec: str):
    from eagle_pipeline.tokens import resolve_tokenizer

    # A hub id is fetched only when the configuration names one; local directories and the demo never touch a hub.
    return resolve_tokenizer(spec, allow_download=True)


class PipelineResource(dg.ConfigurableResource):
    """Pipeline configuration and shared, cached helpers (tokenizer, profile, data root).

    `config_file` empty means `$EAGLE_PIPELINE_CONFIG`, else the repository's pipeline.yaml, read at run time.
    """

    config_file: str = ""

    def config(self) -> PipelineConfig:
        path = Path(self.config_file) if self.config_file else config_path()
        return _load_config_cached(str(path), path.stat().st_mtime if path.exists() else 0.0)

    def data_root(self) -> DataRoot:
        return DataRoot(self.config().data_root)

    def tokenizer(self):
        return _tokenizer_cached(self.config().target.tokenizer)

    def profile(self):
        from eagle_pipeline.tokens import get_profile

        return get_profile(self.config().target.profile)

    def profile_ids(self):
        return self.profile().resolve(self.tokenizer())

    def audit_settings(self):
        return self.config().audit

    def backend_identity(self, dataset: str):
        """What the dataset's committed rows must have been produced by to count (generation/store/identity.py)."""
        from eagle_pipeline.generation.store.identity import dataset_identity

        return dataset_identity(self.config(), dataset, self.tokenizer())


# The one resource every asset, check, schedule and sensor of the location takes.
resources = dg.Definitions(resources={"pipeline": PipelineResource()})
