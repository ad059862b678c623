"""How a rank's `fit` ended when one rank fails, for the tests of errors told to the peers."""

from __future__ import annotations

import time
from typing import Callable


def fit_outcome(rank: int, trainer, fit: Callable[[], object], own: type[BaseException]) -> tuple[str, float]:
    """Run ``fit()`` and say how it ended, with its seconds: ``"returned"``, ``"peer <r>: <message>"`` for a
    `PeerFailureError` naming rank r, or ``"own: <message>"`` for this rank's own error of type `own`. The
    failing rank (1) stays alive a few seconds after its error, as a notebook or cleanup code would, while
    the other finds out; the trainer is closed without a barrier."""
    from distributed_training.peer_watch import PeerFailureError

    start = time.monotonic()
    try:
        fit()
        said = "returned"
    except PeerFailureError as err:
        said = f"peer {err.rank}: {err}"
    except own as err:
        said = f"own: {err}"
    seconds = time.monotonic() - start
    if rank == 1:
        time.sleep(4)
    trainer.close(barrier=False)
    return said, seconds


def failure_report(fn: Callable, world: int, **kwargs) -> str:
    """``run_distributed(fn, world, **kwargs)`` where some rank is expected to fail: what its error says
    (each failed rank's part), or "" when every rank returned."""
    from distributed_training.testing import DistributedTestError, run_distributed

    try:
        run_distributed(fn, world, **kwargs)
    except DistributedTestError as err:
        return str(err)
    return ""


def record_outcome(record: str, rank: int, call: Callable[[], object]) -> None:
    """Run ``call()`` and write ``"<seconds> <outcome>"`` to ``<record>.<rank>``: ``returned``, or the type
    and message of what it raised (Ctrl-C's `KeyboardInterrupt` too). A rank the process ended inside
    `call` (status 75, 130) writes nothing."""
    start = time.monotonic()
    try:
        call()
        outcome = "returned"
    except BaseException as err:  # noqa: BLE001 - how it ended is the result
        outcome = f"{type(err).__name__}: {err}"
    with open(f"{record}.{rank}", "w") as f:
        f.write(f"{time.monotonic() - start:.1f} {outcome}")
