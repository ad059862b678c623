"""Pipeline schedules (pure Python, no processes): every schedule covers each (microbatch, stage) once, the
simulator accepts it and measures the closed-form bubble, the peaks of activations in flight, and the
simulator itself against an independent reference (message order compared channel by channel, deadlock as a
cycle of the dependency graph, makespan as its longest path), including on randomly perturbed schedules."""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from fractions import Fraction

import pytest

from distributed_training.pipeline.schedules import (DEFAULT_COSTS, SCHEDULES, Action, ScheduleError, bubble_formula,
                                                     build_schedule, simulate, stage_of)

# (pipe_size, microbatches, chunks) per schedule: P = 1, 2, 4; M = P, 2P, 8, odd M, and M < P where allowed.
FLAT = [(1, 1, 1), (1, 5, 1), (2, 2, 1), (2, 3, 1), (2, 4, 1), (2, 8, 1), (4, 1, 1), (4, 3, 1), (4, 4, 1), (4, 5, 1),
        (4, 8, 1), (4, 9, 1), (3, 7, 1)]
CASES = {
    "gpipe": FLAT,
    "1f1b": FLAT,
    "zbh1": FLAT,
    # M a multiple of P (any M when P = 1)
    "interleaved_1f1b": [(1, 3, 2), (1, 5, 3), (2, 2, 2), (2, 4, 2), (2, 8, 3), (4, 4, 2), (4, 8, 2), (4, 8, 3),
                         (4, 12, 4), (3, 9, 2)],
}
ALL = [(name, *case) for name, cases in CASES.items() for case in cases]


def reference(schedule, P, V, cost=lambda rank, action: DEFAULT_COSTS[action.kind]):
    """Independent of `simulate`: None if the schedule cannot run (a channel whose sender's order of messages
    differs from its receiver's order of consuming them, or a cycle in the dependency graph), else
    (makespan, {(rank, index): (start, end)}) as the longest path of that graph."""
    S = P * V
    where = {}  # (kind, m, stage) -> (rank, index), B and I both as "G" (the input gradient)
    sent, consumed = defaultdict(list), defaultdict(list)
    for rank, actions in enumerate(schedule):
        for index, a in enumerate(actions):
            s, m = a.chunk * P + rank, a.microbatch
            where[("G" if a.kind in "BI" else a.kind, m, s)] = (rank, index)
            if a.kind == "F":
                if s + 1 < S and (s + 1) % P != rank:
                    sent[rank, (s + 1) % P].append(("act", m, s))
                if s > 0 and (s - 1) % P != rank:
                    consumed[(s - 1) % P, rank].append(("act", m, s - 1))
            elif a.kind in "BI":
                if s > 0 and (s - 1) % P != rank:
                    sent[rank, (s - 1) % P].append(("grad", m, s))
                if s + 1 < S and (s + 1) % P != rank:
                    consumed[(s + 1) % P, rank].append(("grad", m, s + 1))
    if any(sent[c] != consumed[c] for c in set(sent) | set(consumed)):
        return None

    def predecessors(rank, index):
        a = schedule[rank][index]
        s, m = a.chunk * P + rank, a.microbatch
        found = [(rank, index - 1)] if index else []
        if a.kind == "F" and s > 0:
            found.append(where[("F", m, s - 1)])
        elif a.kind in "BI":
            found.append(where[("F", m, s)])
            if s + 1 < S:
                found.append(where[("G", m, s + 1)])
        elif a.kind == "W":
            found.append(where[("G", m, s)])
        return found

    times, visiting = {}, set()

    class Cycle(Exception):
        pass

    def end(node):  # depth-first; the chains here are short enough for recursion
        if node in times:
            return times[node][1]
        if node in visiting:
            raise Cycle
        visiting.add(node)
        start = max((end(p) for p in predecessors(*node)), default=0.0)
        visiting.discard(node)
        times[node] = (start, start + cost(node[0], schedule[node[0]][node[1]]))
        return times[node][1]

    try:
        makespan = max(end((r, i)) for r in range(P) for i in range(len(schedule[r])))
    except Cycle:
        return None
    return makespan, times


def test_stage_of_and_action_checks():
    assert [stage_of(r, c, 4) for c in range(2) for r in range(4)] == list(range(8))
    assert stage_of(0, 0, 1) == 0 and stage_of(0, 3, 1) == 3
    with pytest.raises(ValueError, match="rank"):
        stage_of(4, 0, 4)
    with pytest.raises(ValueError, match="pipe_size"):
        stage_of(0, 0, 0)
    with pytest.raises(ValueError, match="kind"):
        Action("X", 0)
    with pytest.raises(ValueError, match="microbatch"):
        Action("F", -1)
    with pytest.raises(ValueError, match="chunk"):
        Action("F", 0, chunk=True)


@pytest.mark.parametrize("name,P,M,V", ALL)
def test_each_unit_once_and_accepted(name, P, M, V):
    schedule = build_schedule(name, P, M, V)
    assert len(schedule) == P
    counts = Counter((a.kind, a.microbatch, stage_of(r, a.chunk, P)) for r, actions in enumerate(schedule)
                     for a in actions)
    split = name == "zbh1"
    for m in range(M):
        for s in range(P * V):
            assert counts[("F", m, s)] == 1
            assert counts[("B", m, s)] == (0 if split else 1)
            assert counts[("I", m, s)] == counts[("W", m, s)] == (1 if split else 0)
    assert sum(counts.values()) == M * P * V * (3 if split else 2)
    for rank, actions in enumerate(schedule):  # W after its I on the same rank
        order = {(a.kind, a.microbatch, a.chunk): i for i, a in enumerate(actions)}
        assert all(order[("I", a.microbatch, a.chunk)] < i for i, a in enumerate(actions) if a.kind == "W")

    sim = simulate(schedule, P, V, microbatches=M)
    ref = reference(schedule, P, V)
    assert ref is not None and sim.makespan == ref[0]
    for rank, entries in enumerate(sim.timeline):
        assert [a for _, _, a in entries] == schedule[rank]
        assert all(e0[1] <= e1[0] for e0, e1 in zip(entries, entries[1:]))
        assert [(s, e) for s, e, _ in entries] == [ref[1][rank, i] for i in range(len(entries))]
        assert sim.busy[rank] == sum(e - s for s, e, _ in entries) == M * V * 3
    assert sim.bubble == pytest.approx(bubble_formula(name, P, M, V), abs=1e-12)


@pytest.mark.parametrize("P,M", [(p, m) for p, m, _ in FLAT])
def test_bubbles_against_closed_forms(P, M):
    sims = {name: simulate(build_schedule(name, P, M), P) for name in ("gpipe", "1f1b", "zbh1")}
    exact = Fraction(P - 1, M + P - 1)
    for name in ("gpipe", "1f1b"):  # unit costs F = 1, B = 2: exactly (p-1)/(m+p-1)
        assert Fraction(sims[name].bubble).limit_denominator(10**6) == exact
        assert sims[name].makespan == 3 * (M + P - 1)
    # ZB-H1 with F = I = W = 1: makespan max(3M + P - 1, 2M + 2P - 1), so for M >= P its idle time is exactly a
    # third of 1F1B's (P-1 per rank against 3(P-1)) and its bubble (P-1)/(3M+P-1): for P = 4, M = 8, 1/9 = 0.111
    # against 1F1B's 3/11 = 0.273 (a third of it as M grows).
    zb = sims["zbh1"]
    assert zb.makespan == max(3 * M + P - 1, 2 * M + 2 * P - 1)
    if M >= P:
        assert 3 * sum(zb.idle) == sum(sims["1f1b"].idle)
        assert Fraction(zb.bubble).limit_denominator(10**6) == Fraction(P - 1, 3 * M + P - 1)
    if P > 1:
        assert zb.bubble < sims["1f1b"].bubble
    if (P, M) == (4, 8):
        assert zb.bubble == pytest.approx(1 / 9) and sims["1f1b"].bubble == pytest.approx(3 / 11)


@pytest.mark.parametrize("P,M,V", CASES["interleaved_1f1b"])
def test_interleaved_bubble_lower(P, M, V):
    sim = simulate(build_schedule("interleaved_1f1b", P, M, V), P, V)
    assert Fraction(sim.bubble).limit_denominator(10**6) == Fraction(P - 1, V * M + P - 1)
    # activations in flight, in chunks: the warm-up forwards plus one
    assert sim.peak_in_flight == sim.peak_until_w == [min(2 * (P - r - 1) + (V - 1) * P + 1, M * V) for r in range(P)]
    one = simulate(build_schedule("1f1b", P, M), P)
    if P > 1:
        assert sim.bubble < one.bubble
    else:
        assert sim.bubble == one.bubble == 0


@pytest.mark.parametrize("P,M", [(p, m) for p, m, _ in FLAT])
def test_peak_in_flight(P, M):
    gpipe = simulate(build_schedule("gpipe", P, M), P)
    one = simulate(build_schedule("1f1b", P, M), P)
    zb = simulate(build_schedule("zbh1", P, M), P)
    assert gpipe.peak_in_flight == gpipe.peak_until_w == [M] * P
    assert one.peak_in_flight == one.peak_until_w == [min(P - r, M) for r in range(P)]
    # ZB-H1: 1F1B's activations in flight (forward done, I not yet); counted until W, 1F1B's rank-0 peak everywhere
    assert zb.peak_in_flight == one.peak_in_flight
    assert zb.peak_until_w == [min(P, M)] * P


def test_zbh1_faster_than_1f1b_with_uneven_costs():
    # a backward that is not split evenly, and a last stage (with the head) 1.5x slower: still ahead of 1F1B
    def cost(rank, action):
        return {"F": 1.0, "B": 2.0, "I": 1.2, "W": 0.8}[action.kind] * (1.5 if rank == 3 else 1.0)

    for M in (4, 8, 16):
        one = simulate(build_schedule("1f1b", 4, M), 4, costs=cost)
        zb = simulate(build_schedule("zbh1", 4, M), 4, costs=cost)
        assert zb.makespan < one.makespan
        assert zb.makespan == reference(build_schedule("zbh1", 4, M), 4, 1, cost)[0]


def test_perturbed_schedules_agree_with_reference():
    """Random adjacent swaps on valid schedules: simulate accepts exactly those the reference accepts (both
    channel orders equal and no dependency cycle), with the same makespan; otherwise it raises ScheduleError."""
    rng = random.Random(0)
    accepted = rejected = 0
    for trial in range(400):
        name, P, M, V = rng.choice([("gpipe", 2, 3, 1), ("1f1b", 3, 4, 1), ("zbh1", 3, 4, 1), ("1f1b", 2, 2, 1),
                                    ("interleaved_1f1b", 2, 2, 2), ("interleaved_1f1b", 2, 4, 2)])
        schedule = build_schedule(name, P, M, V)
        for _ in range(rng.randint(1, 3)):
            actions = schedule[rng.randrange(P)]
            i = rng.randrange(len(actions) - 1)
            actions[i], actions[i + 1] = actions[i + 1], actions[i]
        ref = reference(schedule, P, V)
        if ref is None:
            with pytest.raises(ScheduleError, match="message order|deadlock"):
                simulate(schedule, P, V)
            rejected += 1
        else:
            assert simulate(schedule, P, V).makespan == ref[0]
            accepted += 1
    assert accepted > 50 and rejected > 50  # both outcomes exercised


def base(P=2, M=2):
    return [list(actions) for actions in build_schedule("gpipe", P, M)]


def test_rejects_fifo_violations():
    # rank 1 consumes microbatch 1's activation before microbatch 0's, which rank 0 sent first
    bad = base()
    bad[1][0], bad[1][1] = bad[1][1], bad[1][0]
    with pytest.raises(ScheduleError, match=r"channel rank 0 -> rank 1: rank 1 position 0 \(F1\) waits for the "
                                            r"activation of microbatch 1 from stage 0, but rank 0 sent the activation "
                                            r"of microbatch 0 from stage 0 first"):
        simulate(bad, 2)
    # gradients: rank 0 consumes them in another order than rank 1 sends them
    bad = base()
    bad[0][2], bad[0][3] = bad[0][3], bad[0][2]
    with pytest.raises(ScheduleError, match="channel rank 1 -> rank 0.*gradient of microbatch 1 from stage 1"):
        simulate(bad, 2)
    # interleaved: the activation from stage 1 (rank 1) to stage 2 (rank 0) crosses from the last rank to the first
    bad = build_schedule("interleaved_1f1b", 2, 2, 2)
    order = [i for i, a in enumerate(bad[0]) if a.kind == "F" and a.chunk == 1]
    bad[0][order[0]], bad[0][order[1]] = bad[0][order[1]], bad[0][order[0]]
    with pytest.raises(ScheduleError, match="channel rank 1 -> rank 0"):
        simulate(bad, 2, 2)


def test_rejects_missing_duplicated_and_misplaced():
    bad = base()
    del bad[0][3]
    with pytest.raises(ScheduleError, match=r"B \(or I and W\) of microbatch 1 at stage 0 \(rank 0, chunk 0\) is "
                                            r"missing"):
        simulate(bad, 2)
    bad = base()
    bad[1].insert(0, Action("F", 0))
    with pytest.raises(ScheduleError, match="F of microbatch 0 at stage 1 is duplicated: rank 1 position 0, rank 1 "
                                            "position 1"):
        simulate(bad, 2)
    bad = build_schedule("zbh1", 2, 2)
    bad[1] = [a for a in bad[1] if a != Action("W", 1)]
    with pytest.raises(ScheduleError, match="W of microbatch 1 at stage 1 .* is missing"):
        simulate(bad, 2)
    bad = build_schedule("zbh1", 2, 2)
    bad[0].append(Action("B", 0))
    with pytest.raises(ScheduleError, match="both B and I/W"):
        simulate(bad, 2)
    with pytest.raises(ScheduleError, match="F of microbatch 2 at stage 0 .* is missing"):
        simulate(base(), 2, microbatches=3)
    with pytest.raises(ScheduleError, match="chunk 1 but chunks is 1"):
        simulate([[Action("F", 0, 1)]], 1)
    with pytest.raises(ScheduleError, match="one list of actions per pipeline rank"):
        simulate(base(), 3)
    with pytest.raises(ScheduleError, match="expected an Action"):
        simulate([[("F", 0)]], 1)


def test_rejects_deadlocks():
    # a backward before its own forward on the same rank
    with pytest.raises(ScheduleError, match=r"deadlock.*rank 0 position 0 \(B0\) waits for the F of microbatch 0 at "
                                            r"stage 0, which comes later on rank 0 \(position 1\)"):
        simulate([[Action("B", 0), Action("F", 0)]], 1)
    # rank 0 waits for microbatch 0's gradient before sending microbatch 1's activation, which rank 1 needs first
    bad = [[Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
           [Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)]]
    expected = (r"deadlock: no rank can make progress; rank 0 position 1 \(B0\) waits for the gradient of microbatch 0 "
                r"from stage 1, not sent yet by rank 1; rank 1 position 1 \(F1\) waits for the activation of "
                r"microbatch 1 from stage 0, not sent yet by rank 0")
    with pytest.raises(ScheduleError, match=expected):
        simulate(bad, 2)
    # W before its I
    bad = build_schedule("zbh1", 1, 1)
    bad[0] = [Action("F", 0), Action("W", 0), Action("I", 0)]
    with pytest.raises(ScheduleError, match=r"\(W0\) waits for the input gradient"):
        simulate(bad, 1)


def test_argument_errors_name_the_argument():
    for kwargs, field in [(dict(name="pipedream"), "name"), (dict(pipe_size=0), "pipe_size"),
                          (dict(microbatches=0), "microbatches"), (dict(chunks=2), "chunks"),
                          (dict(name="interleaved_1f1b", chunks=1, microbatches=4), "chunks"),
                          (dict(name="interleaved_1f1b", chunks=2, microbatches=6), "microbatches"),
                          (dict(pipe_size=True), "pipe_size"), (dict(microbatches=2.0), "microbatches")]:
        args = dict(name="1f1b", pipe_size=4, microbatches=8, chunks=1) | kwargs
        for function in (build_schedule, bubble_formula):
            with pytest.raises(ValueError, match=field):
                function(**args)
    schedule = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="costs has unknown kind 'X'"):
        simulate(schedule, 2, costs={"X": 1})
    with pytest.raises(ValueError, match=r"costs\['F'\]"):
        simulate(schedule, 2, costs={"F": -1})
    with pytest.raises(ValueError, match="chunks"):
        simulate(schedule, 2, 0)
    # costs may name only some kinds; the others keep their defaults
    assert simulate(schedule, 2, costs={"B": 1}).makespan == 2 * (2 + 2 - 1)


def test_bubble_formula_values():
    assert bubble_formula("gpipe", 4, 8) == bubble_formula("1f1b", 4, 8) == 3 / 11
    assert bubble_formula("interleaved_1f1b", 4, 8, 2) == 3 / 19
    assert bubble_formula("zbh1", 4, 8) == pytest.approx(1 / 9)
    assert bubble_formula("zbh1", 4, 2) == pytest.approx(1 - 6 / 11)  # m < p: makespan 2m + 2p - 1
    assert all(bubble_formula(name, 1, 5, 2 if name == "interleaved_1f1b" else 1) == 0 for name in SCHEDULES)
