"""The ZeRO stages under one import: stage 1 is `Zero1Strategy` (`zero1.py`), stages 2 and 3 are
`FSDPStrategy` (`fsdp_strategy.py`)."""

from .fsdp_strategy import FSDPStrategy
from .zero1 import Zero1Strategy

__all__ = ["FSDPStrategy", "Zero1Strategy"]
