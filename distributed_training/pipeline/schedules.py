"""Pipeline schedules as data: what each pipeline rank computes, in which order, and a simulator
that checks an order and measures it.

Nothing here touches torch (or torch.distributed): a schedule is a list of `Action` per pipeline rank,
which the engine replays, and which the simulator replays on a virtual clock.

Stages. With P pipeline ranks and V model chunks per rank there are S = P * V (virtual) stages; chunk
c of rank r is stage ``c * P + r`` (`stage_of`), so consecutive stages sit on consecutive ranks,
stage S-1 on rank P-1, and with V >= 2 an activation also goes from rank P-1 back to rank 0 between
chunks. Microbatch m's activation goes from stage s to stage s+1 (forward), its gradient from s+1
to s (backward).

Actions. ``F`` runs a stage's forward on one microbatch and sends the activation on; ``B`` runs the
whole backward (input and weight gradients) and sends the input gradient back; ``I`` computes only
the input gradient (sent back at once: it is on the critical path) and ``W`` the weight gradient that
``I`` deferred (no message: it can run whenever the rank would otherwise wait).

The schedules (`build_schedule`), for P ranks and M microbatches:

* ``"gpipe"``: every forward, then every backward, in microbatch order. A rank holds the
  activations of all M microbatches at once.
* ``"1f1b"`` (PipeDream-flush): rank r runs min(P - r - 1, M) forwards (warm-up), then alternates
  one forward and one backward (steady state), then runs the backwards left (cool-down). Same
  bubble as GPipe, but rank r holds at most min(P - r, M) microbatches' activations.
* ``"interleaved_1f1b"`` (Megatron-LM's, V >= 2 chunks, M a multiple of P): microbatches go in
  groups of P; the k-th forward on every rank is microbatch ``(k // (P*V)) * P + k % P`` on chunk
  ``(k % (P*V)) // P`` (a group of P microbatches through chunk 0, then the same group through
  chunk 1, ...), backwards the same with the chunks reversed. Rank r warms up with
  ``(P - r - 1) * 2 + (V - 1) * P`` forwards (at most M * V), then alternates, then cools down.
  Because every rank runs its forwards (and its backwards) in the same (microbatch, chunk) order,
  the messages between two ranks are consumed in the order they are sent. Each stage is 1/V of a
  rank's layers, so the bubble shrinks by about V.
* ``"zbh1"`` (zero bubble, "handcrafted 1" of Qi et al., 2023): 1F1B's order of forwards and
  backwards with each backward an ``I`` (input gradient, on the critical path), and the ``W`` (weight
  gradient) of microbatch j placed right after the ``I`` of microbatch j + r on rank r, the rank's last
  min(r, M) W passes at the end. The gradients start from the last rank: the lag lets rank r pass
  them on sooner, and it runs the deferred W passes at the end of the step, where 1F1B leaves it
  idle while the last gradients travel to rank 0. With unit costs (F = I = W = 1) the
  makespan is max(3M + P - 1, 2M + 2P - 1) against 1F1B's 3(M + P - 1): for M >= P a bubble of
  (P-1)/(3M+P-1), a third of 1F1B's idle time. Activations in flight (forward done, ``I`` not yet)
  peak at 1F1B's min(P - r, M); counted until ``W``, at min(P, M) on every rank, the peak of 1F1B's
  rank 0.

`simulate` replays a schedule with per-kind costs (communication free, sends asynchronous, receives
waiting) and raises `ScheduleError` for: an action missing or duplicated, a chunk out of range, a
deadlock (no rank can make progress), and a message order that differs between the two
ends of a channel. Channels are directed pairs of ranks (rank a -> rank b) carrying activations and
gradients alike: NCCL matches the sends and receives between two ranks in the order they are issued,
so the sender's order of messages to a peer must be the order in which the peer consumes them.
The simulator takes a send to never block its sender: an engine must issue its sends so that a send
waiting for its peer cannot hold back that rank's own receives (on NCCL, operations queued on one
stream run in order).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence, Union

__all__ = [
    "Action",
    "KINDS",
    "SCHEDULES",
    "ScheduleError",
    "Simulation",
    "DEFAULT_COSTS",
    "bubble_formula",
    "build_schedule",
    "simulate",
    "stage_of",
]

#: Action kinds: forward, full backward, input-gradient backward, weight-gradient backward.
KINDS = ("F", "B", "I", "W")
#: Schedule names accepted by `build_schedule` and `bubble_formula`.
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbh1")
#: Default costs of `simulate`: a backward costs two forwards, split evenly between I and W.
DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


class ScheduleError(ValueError):
    """A schedule that cannot run: an action missing, duplicated or misplaced, a deadlock, or a message
    order that differs between a channel's sender and receiver."""


@dataclass(frozen=True)
class Action:
    """One unit of work of one pipeline rank.

    Attributes:
        kind: ``"F"`` forward, ``"B"`` backward (input and weight gradients), ``"I"`` backward for the
            input gradient only, ``"W"`` the weight gradient that an ``"I"`` deferred.
        microbatch: index of the microbatch, from 0.
        chunk: the model chunk on this rank (0 unless the schedule is interleaved); the stage is
            ``stage_of(rank, chunk, pipe_size)``.
    """

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action kind must be one of {list(KINDS)}, got {self.kind!r}")
        for name in ("microbatch", "chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Action {name} must be an int >= 0, got {value!r}")

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


def stage_of(rank: int, chunk: int, pipe_size: int) -> int:
    """The (virtual) stage that chunk `chunk` of pipeline rank `rank` runs: ``chunk * pipe_size + rank``."""
    _check_int("pipe_size", pipe_size, 1)
    _check_int("chunk", chunk, 0)
    _check_int("rank", rank, 0)
    if rank >= pipe_size:
        raise ValueError(f"rank must be < pipe_size ({pipe_size}), got {rank}")
    return chunk * pipe_size + rank


def _check_int(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_request(name: str, pipe_size: int, microbatches: int, chunks: int) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"name must be one of {list(SCHEDULES)}, got {name!r}")
    _check_int("pipe_size", pipe_size, 1)
    _check_int("microbatches", microbatches, 1)
    _check_int("chunks", chunks, 1)
    if name == "interleaved_1f1b":
        if chunks < 2:
            raise ValueError(f"chunks must be >= 2 for 'interleaved_1f1b' (the model chunks per rank), got {chunks}")
        if microbatches % pipe_size:
            raise ValueError(f"microbatches must be a multiple of pipe_size ({pipe_size}) for 'interleaved_1f1b', "
                             f"got {microbatches}")
    elif chunks != 1:
        raise ValueError(f"chunks must be 1 for {name!r} (only 'interleaved_1f1b' runs several chunks per rank), "
                         f"got {chunks}")


# ----------------------------------------------------------------------------------------------------
# Schedules


def build_schedule(name: str, pipe_size: int, microbatches: int, chunks: int = 1) -> list[list[Action]]:
    """Each pipeline rank's actions for one step, in order: ``schedule[rank] = [Action, ...]``.

    `name` is one of ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"`` (needs `chunks` >= 2 and
    `microbatches` a multiple of `pipe_size`) or ``"zbh1"``; the others take ``chunks=1``. Raises
    ValueError naming the argument for an impossible request. Every schedule built here passes
    `simulate`.
    """
    _check_request(name, pipe_size, microbatches, chunks)
    builder = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved_1f1b": _interleaved, "zbh1": _zbh1}[name]
    return [builder(rank, pipe_size, microbatches, chunks) for rank in range(pipe_size)]


def _gpipe(rank: int, P: int, M: int, V: int) -> list[Action]:
    return [Action("F", m) for m in range(M)] + [Action("B", m) for m in range(M)]


def _one_f_one_b(rank: int, P: int, M: int, V: int, backward: Sequence[str] = ("B",)) -> list[Action]:
    """1F1B's order; `backward` is what each backward becomes (``("I",)`` for ZB-H1's skeleton)."""
    warmup = min(P - rank - 1, M)
    actions = [Action("F", m) for m in range(warmup)]
    for m in range(M - warmup):  # steady state: the forward of m + warmup, then the backward of m
        actions.append(Action("F", m + warmup))
        actions.extend(Action(kind, m) for kind in backward)
    for m in range(M - warmup, M):  # cool-down
        actions.extend(Action(kind, m) for kind in backward)
    return actions


def _interleaved(rank: int, P: int, M: int, V: int) -> list[Action]:
    total = M * V  # forwards on this rank (and backwards)

    def unit(k: int, forward: bool) -> tuple[int, int]:
        group, position = divmod(k, P * V)
        chunk = position // P
        return group * P + position % P, (chunk if forward else V - 1 - chunk)

    warmup = min((P - rank - 1) * 2 + (V - 1) * P, total)
    actions = [Action("F", *unit(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        actions.append(Action("F", *unit(k + warmup, True)))
        actions.append(Action("B", *unit(k, False)))
    actions.extend(Action("B", *unit(k, False)) for k in range(total - warmup, total))
    return actions


def _zbh1(rank: int, P: int, M: int, V: int) -> list[Action]:
    # W(j) right after I(j + rank): the lag lets the ranks nearer the end fill their cool-down waits
    # with W passes, and keeps at most min(P, M) microbatches before their W on every rank.
    actions = []
    for action in _one_f_one_b(rank, P, M, V, backward=("I",)):
        actions.append(action)
        if action.kind == "I" and action.microbatch >= rank:
            actions.append(Action("W", action.microbatch - rank))
    actions.extend(Action("W", m) for m in range(max(M - rank, 0), M))
    return actions


# ----------------------------------------------------------------------------------------------------
# Simulation


@dataclass
class Simulation:
    """What `simulate` measured.

    Attributes:
        makespan: time from the first action's start to the last one's end.
        busy: per rank, the total cost of its actions.
        bubble: the idle fraction of the pipeline, ``1 - sum(busy) / (ranks * makespan)``.
        peak_in_flight: per rank, the most (microbatch, chunk) pairs whose activations it held at
            once: forward done, ``B`` or ``I`` not yet (with V chunks, each pair is one chunk's
            activations, about 1/V of a microbatch's on that rank).
        peak_until_w: per rank, the same counted until the weight gradient is done (``B`` or ``W``):
            what an implementation holds if ``I`` keeps the whole graph alive for ``W``. Equal to
            `peak_in_flight` for schedules without ``I``/``W``.
        timeline: per rank, ``(start, end, action)`` in order, for plots.
    """

    makespan: float
    busy: list[float]
    bubble: float
    peak_in_flight: list[int]
    peak_until_w: list[int]
    timeline: list[list[tuple[float, float, Action]]] = field(repr=False)

    @property
    def idle(self) -> list[float]:
        """Per rank, the makespan minus its busy time."""
        return [self.makespan - busy for busy in self.busy]


Costs = Union[Mapping[str, float], Callable[[int, Action], float]]


def _cost_function(costs: Costs | None) -> Callable[[int, Action], float]:
    if costs is None:
        costs = {}
    if callable(costs):
        return costs
    if not isinstance(costs, Mapping):
        raise ValueError(f"costs must be a mapping kind -> cost or a callable (rank, action) -> cost, got {costs!r}")
    table = dict(DEFAULT_COSTS)
    for kind, value in costs.items():
        if kind not in KINDS:
            raise ValueError(f"costs has unknown kind {kind!r}: expected some of {list(KINDS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"costs[{kind!r}] must be a number >= 0, got {value!r}")
        table[kind] = float(value)
    return lambda rank, action: table[action.kind]


def _check_actions(schedule, P: int, V: int, microbatches: int | None) -> int:
    """Static checks: shape, ranges, and exactly one F and one B (or one I and one W) per (microbatch,
    stage) on the stage's rank. Returns the number of microbatches."""
    if not isinstance(schedule, Sequence) or len(schedule) != P:
        size = len(schedule) if isinstance(schedule, Sequence) else type(schedule).__name__
        raise ScheduleError(f"schedule must hold one list of actions per pipeline rank ({P}), got {size}")
    seen: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
    for rank, actions in enumerate(schedule):
        for position, action in enumerate(actions):
            if not isinstance(action, Action):
                raise ScheduleError(f"rank {rank} position {position}: expected an Action, got {action!r}")
            if action.chunk >= V:
                raise ScheduleError(f"rank {rank} position {position}: {action} has chunk {action.chunk} but chunks "
                                    f"is {V}")
            key = (action.kind, action.microbatch, stage_of(rank, action.chunk, P))
            seen.setdefault(key, []).append((rank, position))
    M = max((m for _, m, _ in seen), default=-1) + 1
    if microbatches is not None:
        _check_int("microbatches", microbatches, 1)
        if M > microbatches:
            raise ScheduleError(f"microbatch {M - 1} scheduled but microbatches is {microbatches}")
        M = microbatches
    if M == 0:
        raise ScheduleError("the schedule has no actions")
    for (kind, m, s), places in seen.items():
        if len(places) > 1:
            where = ", ".join(f"rank {r} position {i}" for r, i in places)
            raise ScheduleError(f"{kind} of microbatch {m} at stage {s} is duplicated: {where}")
    for m in range(M):
        for s in range(P * V):
            rank, chunk = s % P, s // P
            name = f"microbatch {m} at stage {s} (rank {rank}, chunk {chunk})"
            if ("F", m, s) not in seen:
                raise ScheduleError(f"F of {name} is missing")
            split = [kind for kind in ("I", "W") if (kind, m, s) in seen]
            if ("B", m, s) in seen and split:
                raise ScheduleError(f"{name} has both B and {'/'.join(split)}: a backward is either B or I and W")
            if ("B", m, s) not in seen and len(split) < 2:
                lacking = "B (or I and W)" if not split else ("W" if split == ["I"] else "I")
                raise ScheduleError(f"{lacking} of {name} is missing")
    return M


def simulate(schedule: Sequence[Sequence[Action]], pipe_size: int, chunks: int = 1, costs: Costs | None = None, *,
             microbatches: int | None = None) -> Simulation:
    """Replay `schedule` (one list of actions per pipeline rank) on a virtual clock, check it, measure it.

    Each rank runs its actions in order; an action starts when the rank is free and its inputs exist:
    ``F(m, s)`` needs ``F(m, s-1)``'s activation; ``B``/``I`` of (m, s) need ``F(m, s)`` and the gradient
    of ``B``/``I`` of (m, s+1); ``W(m, s)`` needs ``I(m, s)``. Sends are asynchronous and communication
    is free; a message between different ranks travels on the channel (sender, receiver) and must be
    consumed in the order it was sent. `costs` maps kinds to durations (missing kinds take
    `DEFAULT_COSTS`: F=1, B=2, I=1, W=1), or is a function ``(rank, action) -> duration``.
    `microbatches`, if given, is the number the schedule must cover (by default, up to the largest
    one it names).

    Raises ScheduleError (a ValueError) for a missing, duplicated or misplaced action, a deadlock, or a
    channel whose messages are consumed in another order than sent; ValueError for bad arguments.
    """
    _check_int("pipe_size", pipe_size, 1)
    _check_int("chunks", chunks, 1)
    cost = _cost_function(costs)
    P, V = pipe_size, chunks
    S = P * V
    _check_actions(schedule, P, V, microbatches)

    done: dict[tuple[str, int, int], float] = {}  # ("F" | "G" (input gradient) | "W", m, stage) -> end time
    channels: dict[tuple[int, int], deque] = {}  # (sender, receiver) -> deque of ((what, m, from stage), time)
    position = [0] * P
    clock = [0.0] * P
    busy = [0.0] * P
    held = [set() for _ in range(P)]  # (m, chunk): forward done, input gradient not yet
    unfinished = [set() for _ in range(P)]  # (m, chunk): forward done, weight gradient not yet
    peak_in_flight, peak_until_w = [0] * P, [0] * P
    timeline: list[list[tuple[float, float, Action]]] = [[] for _ in range(P)]

    def needs(rank: int, action: Action) -> list[tuple]:
        """The action's inputs: ("local", key) on this rank, or ("message", channel, message)."""
        s = stage_of(rank, action.chunk, P)
        m = action.microbatch
        if action.kind == "W":
            return [("local", ("G", m, s))]
        inputs = []
        if action.kind == "F":
            remote = ("act", m, s - 1) if s > 0 else None
        else:
            inputs.append(("local", ("F", m, s)))
            remote = ("grad", m, s + 1) if s < S - 1 else None
        if remote is not None:
            sender = remote[2] % P
            if sender == rank:  # P == 1: the neighbouring stage is on this rank
                inputs.append(("local", ("F" if remote[0] == "act" else "G", m, remote[2])))
            else:
                inputs.append(("message", (sender, rank), remote))
        return inputs

    def describe(message) -> str:
        what, m, s = message
        return f"{'activation' if what == 'act' else 'gradient'} of microbatch {m} from stage {s}"

    def ready(rank: int, action: Action):
        """The time the action's inputs are there, or None if one is not there yet."""
        start = clock[rank]
        for need in needs(rank, action):
            if need[0] == "local":
                if need[1] not in done:
                    return None
                start = max(start, done[need[1]])
            else:
                queue = channels.get(need[1])
                if not queue:
                    return None
                head, sent = queue[0]
                if head != need[2]:
                    sender, receiver = need[1]
                    raise ScheduleError(
                        f"message order on channel rank {sender} -> rank {receiver}: rank {receiver} position "
                        f"{position[rank]} ({action}) waits for the {describe(need[2])}, but rank {sender} sent the "
                        f"{describe(head)} first (the channel is FIFO: messages are consumed in the order sent)")
                start = max(start, sent)
        return start

    def run(rank: int, action: Action, start: float) -> None:
        s = stage_of(rank, action.chunk, P)
        m, unit = action.microbatch, (action.microbatch, action.chunk)
        end = start + cost(rank, action)
        for need in needs(rank, action):
            if need[0] == "message":
                channels[need[1]].popleft()
        outgoing = None
        if action.kind == "F":
            done[("F", m, s)] = end
            held[rank].add(unit)
            unfinished[rank].add(unit)
            if s < S - 1:
                outgoing = ("act", m, s), (s + 1) % P
        elif action.kind in ("B", "I"):
            done[("G", m, s)] = end
            held[rank].discard(unit)
            if action.kind == "B":
                unfinished[rank].discard(unit)
            if s > 0:
                outgoing = ("grad", m, s), (s - 1) % P
        else:
            unfinished[rank].discard(unit)
        if outgoing is not None and outgoing[1] != rank:
            channels.setdefault((rank, outgoing[1]), deque()).append((outgoing[0], end))
        peak_in_flight[rank] = max(peak_in_flight[rank], len(held[rank]))
        peak_until_w[rank] = max(peak_until_w[rank], len(unfinished[rank]))
        timeline[rank].append((start, end, action))
        busy[rank] += end - start
        clock[rank] = end
        position[rank] += 1

    remaining = sum(len(actions) for actions in schedule)
    while remaining:
        progress = False
        for rank in range(P):
            while position[rank] < len(schedule[rank]):
                action = schedule[rank][position[rank]]
                start = ready(rank, action)
                if start is None:
                    break
                run(rank, action, start)
                remaining -= 1
                progress = True
        if not progress:
            waits = []
            for rank in range(P):
                if position[rank] < len(schedule[rank]):
                    action = schedule[rank][position[rank]]
                    waits.append(_blocked(rank, schedule[rank], position[rank], P, needs(rank, action), done, channels,
                                          describe))
            raise ScheduleError("deadlock: no rank can make progress; " + "; ".join(waits))

    makespan = max((entries[-1][1] for entries in timeline if entries), default=0.0)
    start = min((entries[0][0] for entries in timeline if entries), default=0.0)
    makespan -= start
    bubble = 1.0 - sum(busy) / (P * makespan) if makespan > 0 else 0.0
    return Simulation(makespan=makespan, busy=busy, bubble=bubble, peak_in_flight=peak_in_flight,
                      peak_until_w=peak_until_w, timeline=timeline)


def _blocked(rank, actions, position, P, needs, done, channels, describe) -> str:
    """Why rank `rank`'s next action cannot start, for the deadlock error."""
    missing = []
    for need in needs:
        if need[0] == "local":  # always on this rank, and not run: later in its list
            if need[1] not in done:
                kind, m, s = need[1]
                kinds = "F" if kind == "F" else "BI"
                later = next(i for i, a in enumerate(actions)
                             if a.kind in kinds and a.microbatch == m and a.chunk == s // P)
                what = "F" if kind == "F" else "input gradient (B or I)"
                missing.append(f"the {what} of microbatch {m} at stage {s}, which comes later on rank {rank} "
                               f"(position {later})")
        elif not channels.get(need[1]):
            missing.append(f"the {describe(need[2])}, not sent yet by rank {need[1][0]}")
    return f"rank {rank} position {position} ({actions[position]}) waits for " + " and ".join(missing)


# ----------------------------------------------------------------------------------------------------
# Formulas


def bubble_formula(name: str, pipe_size: int, microbatches: int, chunks: int = 1) -> float:
    """The bubble fraction (idle time over ``pipe_size x makespan``) of `build_schedule`'s schedule
    `name`, with p ranks, m microbatches and v chunks:

    * GPipe and 1F1B: ``(p-1)/(m+p-1)``, for any ratio of backward to forward cost;
    * interleaved 1F1B: ``(p-1)/(v*m+p-1)`` (the issue's "about (p-1)/(v*m)" is idle over busy time);
    * ZB-H1: ``1 - 3m / max(3m+p-1, 2m+2p-1)``, that is ``(p-1)/(3m+p-1)`` for m >= p.

    Each is exact for `simulate`'s default costs (F = 1, B = 2, I = W = 1, the same for every stage)
    and the schedules built here; the tests check it. Same arguments and errors as `build_schedule`.
    """
    _check_request(name, pipe_size, microbatches, chunks)
    p, m, v = pipe_size, microbatches, chunks
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    # zbh1: the last rank's I passes, every unit long, reach rank 0 after 2m + 2p - 2 (m < p), or the
    # last rank is busy from p - 1 to the end (m >= p).
    return 1 - 3 * m / max(3 * m + p - 1, 2 * m + 2 * p - 1)
