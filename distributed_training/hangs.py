"""Hangs turned into errors that say who is missing: a heartbeat per step in the rendezvous store,
and a `CollectiveTimeoutError` naming the operation and the ranks that never reached the step."""

from __future__ import annotations

import torch.distributed as dist

from .runtime import DistributedContext

__all__ = ["CollectiveTimeoutError", "heartbeat", "diagnose_timeout", "is_timeout"]


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the configured timeout; the message names the missing ranks."""


def is_timeout(err: Exception) -> bool:
    text = str(err).lower()
    return "timeout" in text or "timed out" in text


def _operation_of(err: Exception) -> str:
    text = str(err)
    for marker in ("DDP ", "FSDP "):
        if marker in text:
            return text[text.index(marker):].split(":")[0]
    return ""


def _store():
    try:
        return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except Exception:
        return None


def heartbeat(context: DistributedContext, step: int) -> None:
    """Publish this rank's step in the rendezvous store, so a timeout can name who is missing."""
    store = _store()
    if store is not None and context.world_size > 1:
        store.set(f"distributed_training/heartbeat/{context.rank}", str(step))


def diagnose_timeout(context: DistributedContext, step: int, err: Exception) -> str:
    """The message of a `CollectiveTimeoutError` raised in training step `step + 1`: the operation,
    and which ranks never reached the step (from their heartbeats)."""
    ctx = context
    where = f"rank {ctx.rank}: a collective timed out during training step {step + 1}"
    op = _operation_of(err)
    if op:
        where += f" in {op}"
    store = _store()
    if store is None:
        return f"{where}: {err}"
    behind = []
    for r in range(ctx.world_size):
        key = f"distributed_training/heartbeat/{r}"
        try:
            seen = int(store.get(key)) if store.check([key]) else None
        except Exception:
            seen = None
        if seen is None or seen < step:
            behind.append(f"rank {r} (last seen at step {seen + 1 if seen is not None else 'none'})")
    if behind:
        return f"{where}; missing: {', '.join(behind)} never reached step {step + 1}. Cause: {err}"
    return f"{where}; every rank reached step {step + 1}, so a rank is stuck inside it. Cause: {err}"
