"""The package's messages: the standard `logging` module, logger ``"distributed_training"``.

Library code never prints; it logs to ``distributed_training`` (or a child logger), so users route,
filter or silence its messages as they would any library's::

    logging.getLogger("distributed_training").setLevel(logging.WARNING)   # only warnings and errors

When the application has not configured logging itself (no handler on the root logger nor on
ours), `install_default_handler` (called by the `dtrain` command and by `DistributedTrainer`) adds
one handler that writes to stderr: INFO and above from rank 0, WARNING and above from every rank
with ``[rank N]`` in front, so a job of 64 processes says each thing once, and a warning still tells
which rank saw it. It writes through the progress bar (`tqdm.write`), so a bar stays on the last
line instead of being overwritten.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["LOGGER_NAME", "get_logger", "install_default_handler"]

LOGGER_NAME = "distributed_training"


def get_logger(name: str | None = None) -> logging.Logger:
    """The package's logger, or its child ``distributed_training.<name>``."""
    return logging.getLogger(f"{LOGGER_NAME}.{name}" if name else LOGGER_NAME)


class _RankZeroHandler(logging.Handler):
    """INFO from rank 0, WARNING and above from every rank (prefixed with the rank), to stderr."""

    def __init__(self, rank: int) -> None:
        super().__init__(logging.INFO)
        self.rank = rank

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.WARNING and self.rank != 0:
            return
        if _configured_elsewhere(self):
            return  # the application set up logging after us: its handlers get the record, ours stays quiet
        try:
            text = record.getMessage()
            if record.levelno >= logging.WARNING:
                text = f"[rank {self.rank}] {record.levelname}: {text}"
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            from tqdm import tqdm

            tqdm.write(text, file=sys.stderr)  # clears a progress bar, writes the line, redraws the bar
        except Exception:
            self.handleError(record)


def _configured_elsewhere(ours: logging.Handler | None = None) -> bool:
    package = logging.getLogger(LOGGER_NAME)
    return bool(logging.getLogger().handlers) or any(h is not ours for h in package.handlers)


def install_default_handler(rank: int | None = None) -> None:
    """Add the default handler once (see the module's docstring); later calls only update the rank.

    Does nothing when the application configured logging: a handler on the root logger or on
    ``distributed_training``, or a level set on ``distributed_training``.
    """
    if rank is None:
        rank = int(os.environ.get("RANK", "0") or 0)
    package = logging.getLogger(LOGGER_NAME)
    for handler in package.handlers:
        if isinstance(handler, _RankZeroHandler):
            handler.rank = rank
            return
    if _configured_elsewhere() or package.level != logging.NOTSET:
        return
    package.addHandler(_RankZeroHandler(rank))
    package.setLevel(logging.INFO)
