"""`python -m distributed_training CONFIG.yaml`: the same as the `dtrain` command."""

from .cli import entry

entry()
