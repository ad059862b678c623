"""`python -m distributed_training CONFIG.yaml`: the same as the `dtrain` command."""

import sys

from .cli import main

sys.exit(main())
