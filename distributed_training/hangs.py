"""Hangs turned into errors that say who is missing: a heartbeat per step in the rendezvous store,
and a `CollectiveTimeoutError` naming the operation and the ranks that never reached the step."""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from .runtime import DistributedContext

__all__ = ["CollectiveTimeoutError", "heartbeat", "diagnose_timeout", "diagnose_lost_peer", "is_timeout"]


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
    """Publish this rank's step in the rendezvous store, so a timeout can name who is missing.

    The training thread only records the step: a background thread writes it to the store within
    `_Heartbeat.PERIOD_S` (a store write is a network round trip, and on a launch-bound model the GPU
    would wait for it every step). A rank stuck inside a step keeps publishing that step; a dead one
    stops, and the diagnosis, which runs only after a collective timeout, sees its last step."""
    if context.world_size <= 1:
        return
    beat = _Heartbeat.current
    if beat is None or beat.context is not context:  # first step, or a new process group
        store = _store()
        if store is None:
            return
        beat = _Heartbeat.current = _Heartbeat(store, context)
    beat.step = step


class _Heartbeat:
    """One per process: the latest step of the training thread, written to the store by a daemon thread."""

    PERIOD_S = 0.2
    current: "_Heartbeat | None" = None

    def __init__(self, store, context: DistributedContext) -> None:
        self.store, self.context = store, context
        self.step: int | None = None
        self._key = _heartbeat_key(context.rank)
        self._stopped = threading.Event()  # set by `stop_heartbeat`: the thread's sleep ends at once
        self._thread = threading.Thread(target=self._run, name="dt-heartbeat", daemon=True)
        # Current before the thread starts: the thread runs while it is the current one, and used to
        # check before `heartbeat` had assigned it, and end at once (no step was ever published).
        _Heartbeat.current = self
        self._thread.start()

    def _run(self) -> None:
        published = None
        while _Heartbeat.current is self and not self._stopped.is_set():
            step = self.step
            if step is not None and step != published:
                try:
                    self.store.set(self._key, str(step))
                    published = step
                except Exception:  # the store is gone (shutdown): nothing left to tell
                    return
            self._stopped.wait(self.PERIOD_S)


def stop_heartbeat() -> None:
    """End this process's heartbeat thread and wait for it (the trainer's `close`). A daemon thread
    still inside a store call when the interpreter exits cannot take the GIL back: Python ends it
    where it stands, through C++ frames that may not be unwound, and the process aborts ("terminate
    called without an active exception") after a job that had succeeded. The thread's sleep between
    writes is cut short (an event, not `time.sleep`): closing waits for a store call in flight at most,
    not for the rest of a period (0.2 s of every trainer's `close`, on every rank)."""
    beat, _Heartbeat.current = _Heartbeat.current, None
    if beat is not None:
        beat._stopped.set()
        if beat._thread is not threading.current_thread():
            beat._thread.join(timeout=beat.PERIOD_S + 10)  # at most one store call


def _heartbeat_key(rank: int) -> str:
    return f"distributed_training/heartbeat/{rank}"


def _last_step(store, rank: int) -> int | None:
    """The step `rank` last published (`heartbeat`), or None (none yet, or the store unreadable)."""
    key = _heartbeat_key(rank)
    try:
        return int(store.get(key)) if store.check([key]) else None
    except Exception:
        return None


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
        seen = _last_step(store, r)
        if seen is None or seen < step:
            behind.append(f"rank {r} (last seen at step {seen + 1 if seen is not None else 'none'})")
    if behind:
        inside = [f"rank {r} is in {a}" for r, a in block_activities(ctx).items()]
        hint = (f" ({'; '.join(inside)}: a collective call, such as save_checkpoint, evaluate or full_state_dict, "
                "that every rank must make, made on some ranks only?)" if inside else "")
        return f"{where}; missing: {', '.join(behind)} never reached step {step + 1}{hint}. Cause: {err}"
    timed_out = _ranks_timed_out(ctx, store, step)
    stuck = [r for r in range(ctx.world_size) if r not in timed_out]
    if timed_out and stuck:
        tell_stuck(store, stuck, step, ctx.rank)
        return (f"{where}; every rank reached step {step + 1}, and {_ranks(stuck)} did not time out in a collective "
                f"within {TIMEOUT_PEERS_WAIT_S:g} s of the others: stuck inside the step outside its collectives (its forward, loss or data, a slow "
                f"read, a hung kernel or device), while the others waited for it. Cause: {err}")
    return (f"{where}; every rank reached step {step + 1}, so a rank is stuck inside it: a peer waiting on its "
            "device or data, or ranks that issued different collectives (control flow that depends on a rank's "
            "data, such as experts of a mixture that are FSDP units of their own and run on some ranks only). "
            f"Cause: {err}")


#: Seconds a rank whose collective timed out waits for its peers' own timeouts (`_ranks_timed_out`).
TIMEOUT_PEERS_WAIT_S = 3.0


def _ranks_timed_out(ctx: DistributedContext, store, step: int) -> set[int]:
    """The ranks whose collective also timed out in training step `step + 1`: this rank records its own in
    the store, then waits up to `TIMEOUT_PEERS_WAIT_S` for the others' (ranks that waited together time out
    within moments of each other); a rank that records none was not waiting in a collective. Empty where
    the store cannot be written."""
    key = f"distributed_training/timed_out/{step}/%d"
    try:
        store.set(key % ctx.rank, "1")
    except Exception:
        return set()
    deadline = time.monotonic() + TIMEOUT_PEERS_WAIT_S
    while True:
        seen = set()
        for r in range(ctx.world_size):
            try:
                if store.check([key % r]):
                    seen.add(r)
            except Exception:
                pass
        if len(seen) == ctx.world_size or time.monotonic() > deadline:
            return seen
        time.sleep(0.1)


def stuck_key(rank: int) -> str:
    """Where a rank is told that its peers' collectives timed out waiting for it (`tell_stuck`)."""
    return f"distributed_training/stuck/{rank}"


def tell_stuck(store, stuck: list[int], step: int, by: int) -> None:
    """Tell `stuck` ranks, through the store, that rank `by`'s collective of training step `step + 1` timed
    out waiting for them: a rank blocked in its own code never reaches a collective that would fail, and a
    launcher's SIGTERM only asks it to stop at the step's end, which it never reaches; its peer watch reads
    this and ends the process (`PeerWatch`)."""
    for r in stuck:
        try:
            store.set(stuck_key(r), f"{step}\t{by}")
        except Exception:
            return  # the store is gone


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def group_timeout_s() -> float | None:
    """The default process group's collective timeout in seconds (None where torch does not say)."""
    try:
        group = dist.distributed_c10d._get_default_group()
        return group._get_backend(group._device_types[0]).options._timeout.total_seconds()
    except Exception:
        return None


def _store_gone() -> bool:
    store = _store()
    if store is None:
        return False
    try:
        store.check([_heartbeat_key(0)])
        return False
    except Exception:
        return True


def _peers_reached(context: DistributedContext, step: int) -> bool:
    """Whether every other rank's heartbeat says it began training step `step + 1` (or later)."""
    store = _store()
    seen = [_last_step(store, r) for r in range(context.world_size) if r != context.rank]
    return all(s is not None and s >= step for s in seen)


def diagnose_lost_peer(context: DistributedContext, step: int, err: Exception, idle_s: float | None) -> str | None:
    """The message for training step `step + 1` failing on a closed connection (a peer gone), where it can
    say more than gloo, or None. This rank was late: it spent `idle_s` seconds since it last finished
    collectives with its peers (its previous step, an evaluation, a save, fit's agreements), longer than
    the group's timeout, and every peer's heartbeat says it began this step (so they waited for this rank,
    timed out and left). Or the rendezvous store is gone too: the process that hosted it (rank 0's, or its
    node's agent) ended, and which peer failed cannot be learnt (this rank's lateness said as a maybe)."""
    where = f"rank {context.rank}: training step {step + 1}"
    op = _operation_of(err)
    if op:
        where += f"'s {op.removesuffix(' failed')}"
    where += " found a peer's connection closed"
    timeout = group_timeout_s()
    late = idle_s is not None and timeout is not None and idle_s > timeout
    away = (f"{idle_s:.1f} s after this rank last met its peers (its previous step, or a collective call after "
            f"it): longer than the job's collective timeout ({timeout:g} s)") if late else ""
    advice = ("Find what held this rank between steps (its data, work of its own, a debugger), or give a longer "
              "timeout (DistributedTrainer(timeout=...))")
    if not _store_gone():
        if late and _peers_reached(context, step):
            return (f"{where}, {away}, and every peer had begun this step: they timed out waiting for this rank and "
                    f"left (their errors name it). {advice}. Cause: {err}")
        return None
    said = (f"{where}, and the job's rendezvous store cannot be reached either: the process that hosted it "
            "(rank 0, or its node's torchrun agent) has ended, so which peer failed cannot be learnt here; rank "
            "0's log says why.")
    if late:
        said += f" This rank was away {idle_s:.1f} s, longer than the collective timeout ({timeout:g} s): its peers may have given up on it. {advice}."
    return f"{said} Cause: {err}"


def _activity_key(rank: int) -> str:
    return f"distributed_training/activity/{rank}"


def publish_block(context: DistributedContext, activity: str) -> None:
    """Say in the rendezvous store that this rank is inside `activity` (a collective call outside a step:
    a checkpoint save, an evaluation, ``full_state_dict()``; "" when it left), for a timeout's message.
    Two store writes a call, never on a step's path."""
    store = _store()
    if store is None or context.world_size <= 1:
        return
    try:
        store.set(_activity_key(context.rank), activity)
    except Exception:
        pass


def block_activities(context: DistributedContext) -> dict[int, str]:
    """The ranks that said they are inside a collective call outside a step, and which."""
    store = _store()
    found = {}
    for r in range(context.world_size if store is not None else 0):
        try:
            key = _activity_key(r)
            value = store.get(key).decode() if store.check([key]) else ""
        except Exception:
            value = ""
        if value:
            found[r] = value
    return found


def diagnose_block_timeout(context: DistributedContext, step: int, activity: str, err: Exception) -> str:
    """The message of a `CollectiveTimeoutError` raised inside `activity` (a collective call outside a
    step) after training step `step`: the ranks that are not in it, where their heartbeats place them."""
    ctx = context
    where = f"rank {ctx.rank}: a collective timed out during {activity} (after training step {step})"
    store = _store()
    inside = block_activities(ctx)
    others = []
    for r in range(ctx.world_size if store is not None else 0):
        if r == ctx.rank or inside.get(r) == activity:
            continue
        seen = _last_step(store, r)
        place = inside.get(r) or (f"training step {seen + 1} or later" if seen is not None and seen >= step
                                  else "training" if seen is not None else "somewhere")
        others.append(f"rank {r} is in {place}")
    if others:
        return (f"{where}: {'; '.join(others)}, not in it. Every rank must make this call (save_checkpoint, "
                "evaluate and full_state_dict are collective: call them on every rank, and write or print "
                f"on rank 0 only). Cause: {err}")
    return f"{where}. Cause: {err}"


def block_activities_or_steps(context: DistributedContext) -> dict[int, str]:
    """Each other rank's collective call outside a step, or "a step" where it said none."""
    inside = block_activities(context)
    return {r: inside.get(r, "a step") for r in range(context.world_size) if r != context.rank}
