"""The pipeline configuration (docs/configuration.md): `load_config` reads and validates the YAML file into a
`PipelineConfig` (pipeline.py), assembled from one settings class per section (sections.py, or the domain's own
class). Import from here."""

from eagle_pipeline.config.pipeline import *  # noqa: F403
from eagle_pipeline.config.pipeline import __all__  # noqa: F401
