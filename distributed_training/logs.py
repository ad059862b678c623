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
import warnings

__all__ = ["LOGGER_NAME", "get_logger", "install_default_handler"]

LOGGER_NAME = "distributed_training"


def get_logger(name: str | None = None) -> logging.Logger:
    """The package's logger, or its child ``distributed_training.<name>``."""
    return logging.getLogger(f"{LOGGER_NAME}.{name}" if name else LOGGER_NAME)


class _RankZeroHandler(logging.Handler):
    """INFO from rank 0, WARNING and above from every rank (prefixed with the rank), to stderr."""

    def __init__(self, rank: int, label: int | None = None) -> None:
        super().__init__(logging.INFO)
        self.rank = rank
        self.label = rank if label is None else label  # the rank a message is prefixed with

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.WARNING and self.rank != 0:
            return
        if _configured_elsewhere(self):
            return  # the application set up logging after us: its handlers get the record, ours stays quiet
        try:
            text = record.getMessage()
            if record.levelno >= logging.WARNING:
                text = f"[rank {self.label}] {record.levelname}: {text}"
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            from tqdm import tqdm

            # Clears a progress bar, writes the line, redraws the bar. The line and its end in one write:
            # two ranks' lines sharing a terminal do not run into each other.
            tqdm.write(text + "\n", file=sys.stderr, end="")
        except Exception:
            self.handleError(record)


def _configured_elsewhere(ours: logging.Handler | None = None) -> bool:
    package = logging.getLogger(LOGGER_NAME)
    return bool(logging.getLogger().handlers) or any(h is not ours for h in package.handlers)


def install_default_handler(rank: int | None = None, *, label: int | None = None) -> None:
    """Add the default handler once (see the module's docstring); later calls only update the rank.
    `rank` 0 prints INFO; `label` (default: `rank`) is the rank warnings are prefixed with, the global
    one where another rank speaks for the job (a parameter server's first worker).

    Does nothing when the application configured logging: a handler on the root logger or on
    ``distributed_training``, or a level set on ``distributed_training``.
    """
    if rank is None:
        rank = int(os.environ.get("RANK", "0") or 0)
    package = logging.getLogger(LOGGER_NAME)
    for handler in package.handlers:
        if isinstance(handler, _RankZeroHandler):
            handler.rank, handler.label = rank, rank if label is None else label
            return
    if _configured_elsewhere() or package.level != logging.NOTSET:
        return
    package.addHandler(_RankZeroHandler(rank, label))
    package.setLevel(logging.INFO)
    _route_package_warnings()


def _route_package_warnings() -> None:
    """Show the `warnings` this package raises (a skipped checkpoint, RNG states not restored, ...) as
    records of its logger, so they get the rank prefix and obey the logger's level like every other
    message. Other warnings, and code that records warnings (``warnings.catch_warnings``,
    ``pytest.warns``, which replace `showwarning`), are untouched."""
    previous = warnings.showwarning
    if getattr(previous, "_routes_distributed_training", False):
        return
    package_dir = os.path.dirname(os.path.abspath(__file__)) + os.sep

    def showwarning(message, category, filename, lineno, file=None, line=None):
        record = _recording()
        if record is not None:  # this was installed inside the block: the block gets the warning
            record(warnings.WarningMessage(message, category, filename, lineno, file, line))
        elif os.path.abspath(filename).startswith(package_dir) or _raised_by_package():
            get_logger().warning("%s", message)
        else:
            previous(message, category, filename, lineno, file, line)

    showwarning._routes_distributed_training = True  # type: ignore[attr-defined]
    warnings.showwarning = showwarning


def _recording():
    """Where a ``warnings.catch_warnings(record=True)`` block (``pytest.warns`` too) is in force: what it
    records with (its list's ``append``), else None. Such a block sets `warnings.showwarning` back to
    Python's own at its start, and Python calls a replaced one instead of the block's recorder: the route
    installed inside the block (the first trainer built there) took the block's warnings to the logger.
    (The recorder is the `warnings` module's private ``_showwarnmsg_impl``: where it is not there, None.)"""
    impl = getattr(warnings, "_showwarnmsg_impl", None)
    return impl if isinstance(getattr(impl, "__self__", None), list) else None


def _raised_by_package() -> bool:
    """Whether the code that called `warnings.warn` is in this package (a `stacklevel` > 1 names the
    caller's file, but the message is still ours)."""
    package_dir = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame = sys._getframe(2)  # above showwarning: the warnings module, then whoever called warn()
    while frame is not None and os.path.basename(frame.f_code.co_filename) == "warnings.py":
        frame = frame.f_back
    return frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package_dir)
