"""`python -m eagle_pipeline.cli`: the `eagle-pipeline` command."""

import sys

from eagle_pipeline.cli import main

sys.exit(main())
