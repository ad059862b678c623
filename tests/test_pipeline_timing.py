"""Timing a pipeline step (`PipelineEngine.timing`): busy time by action, the window, the measured bubble.

The window arithmetic (`timing.combine`) is checked on `simulate`'s timelines, where the answer is known
exactly; the engine on real processes whose stages sleep known times (forward t, backward 2t: the
formula's costs), so the measured bubble must come out at the formula's."""

from __future__ import annotations

import copy
import statistics
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed_training.pipeline import bubble_formula, build_schedule, simulate
from distributed_training.pipeline.engine import PipelineEngine
from distributed_training.pipeline.timing import combine, rank_row
from distributed_training.testing import run_distributed


# ---------------------------------------------------------------------------------------------------
# The window arithmetic, on simulated timelines


def _rows_from(sim, P: int, V: int, shift: list[float]) -> list[list[float]]:
    """Each rank's `rank_row` from a simulated timeline, on a clock of its own (shifted by `shift[r]`):
    what an engine's marks give, in ms from the rank's first mark."""
    rows = []
    for r in range(P):
        spans = [(a.kind, a.microbatch, a.chunk, s + shift[r], e + shift[r]) for s, e, a in sim.timeline[r]]
        first = spans[0][3]
        rows.append(rank_row([(k, m, c, s - first, e - first) for k, m, c, s, e in spans], V))
    return rows


@pytest.mark.parametrize("schedule,P,M,V", [("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 2, 1),
                                            ("interleaved_1f1b", 2, 4, 2), ("interleaved_1f1b", 4, 8, 2),
                                            ("zbh1", 4, 8, 1), ("zbh1", 4, 2, 1)])
@pytest.mark.parametrize("uneven", [False, True])
def test_combine_recovers_the_simulated_bubble(schedule, P, M, V, uneven):
    # Uneven stages (rank r's costs scaled by 1 + r/2, chunk 1 slower): the window's end is then not
    # always rank 0's, and the bubble is not the formula's, but the measured one must still be simulate's.
    def cost(rank, action):
        base = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}[action.kind]
        return base * ((1 + rank / 2) * (1 + 0.3 * action.chunk) if uneven else 1.0)

    plan = build_schedule(schedule, P, M, chunks=V)
    sim = simulate(plan, P, V, costs=cost)
    rows = _rows_from(sim, P, V, shift=[17.0 * r - 5.0 for r in range(P)])  # clocks unrelated across ranks
    for rank in range(P):
        t = combine(rows, rank=rank, schedule=schedule, microbatches=M, chunks=V)
        assert t.window_ms == pytest.approx(sim.makespan)
        assert t.bubble == pytest.approx(sim.bubble)
        assert t.bubble_simulated == pytest.approx(sim.bubble)
        assert t.bubble_formula == pytest.approx(bubble_formula(schedule, P, M, chunks=V))
        if not uneven:
            assert t.bubble == pytest.approx(t.bubble_formula)
        assert t.rank_busy_ms == pytest.approx(sim.busy)
        kinds = {a.kind for a in plan[rank]}
        assert set(t.busy_ms) == kinds
        assert sum(t.busy_ms.values()) == pytest.approx(sim.busy[rank])
        assert t.forward_ms == pytest.approx(sum(cost(rank, a) for a in plan[rank] if a.kind == "F"))


def test_metrics_names():
    plan = build_schedule("zbh1", 2, 4)
    sim = simulate(plan, 2)
    t = combine(_rows_from(sim, 2, 1, [0.0, 0.0]), rank=1, schedule="zbh1", microbatches=4)
    m = t.metrics()
    assert set(m) == {"pipeline/forward_ms", "pipeline/backward_ms", "pipeline/input_grad_ms",
                      "pipeline/weight_grad_ms", "pipeline/window_ms", "pipeline/bubble", "pipeline/bubble_formula",
                      "pipeline/bubble_simulated"}
    assert m["pipeline/backward_ms"] == pytest.approx(8.0)  # 4 I + 4 W of cost 1
    assert all(isinstance(v, float) for v in m.values())


# ---------------------------------------------------------------------------------------------------
# The engine on real processes: stages that sleep known times


class _Sleep(torch.autograd.Function):
    """Identity that sleeps `seconds` in forward and twice that in backward (the formula's B = 2F)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad, None


class SleepyLinear(nn.Module):
    def __init__(self, width: int, seconds: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.seconds = seconds

    def forward(self, x):
        return _Sleep.apply(torch.tanh(self.linear(x)), self.seconds)


# Seconds of forward per microbatch and stage: long beside a message's few ms on CI's loaded cores (at 0.04
# the least disturbed of 3 steps once measured 0.242 against GPipe's 0.2, past the band's 0.24).
T = 0.08
M = 4


def sleepy_worker(rank, world, schedule, seconds, steps):
    torch.manual_seed(rank)
    stage = SleepyLinear(8, seconds)
    engine = PipelineEngine([stage], ranks=list(range(world)), rank=rank, schedule=schedule, microbatches=M,
                            loss_fn=F.mse_loss)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    engine.step(x, y)  # untimed: the first messages set up gloo's connections
    assert engine.last_timing is None
    engine.timing = True
    timings, windows = [], []
    for _ in range(steps):
        engine.step(x, y)
        timings.append(engine.last_timing)
        # The same host's monotonic clock is shared by the processes: the absolute marks give the
        # window without any alignment, to check the alignment against.
        spans = engine._clock.spans
        windows.append((spans[0][3], max(s[4] for s in spans)))
    return timings, windows


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_measured_bubble_matches_the_formula_with_known_costs(schedule):
    P, steps = 2, 3
    results = run_distributed(sleepy_worker, P, args=(schedule, T, steps), timeout=120)
    formula = bubble_formula(schedule, P, M)
    for rank, (timings, _) in enumerate(results):
        # Messages between the sleeps take a few ms each on a loaded CPU, idle time the formula leaves out,
        # so the measured bubble sits a little above it: the least disturbed of the steps is compared,
        # in a band that fails for a wrong definition: counting the waits as busy gives 0.10 here, the
        # mean of the ranks' own spans as the window 0.11, a window one forward too long 0.25. (Rank 0
        # ends last here; the alignment is checked against the shared host clock below, and on
        # schedules where another rank ends last in test_combine_recovers_the_simulated_bubble.)
        bubble = min(t.bubble for t in timings)
        assert formula - 0.03 <= bubble <= formula + 0.04, (rank, [t.bubble for t in timings], formula)
        sim = statistics.median(t.bubble_simulated for t in timings)
        assert abs(sim - formula) <= 0.02, (rank, sim, formula)  # the measured costs are the sleeps
        for t in timings:
            assert t.rank == rank and t.schedule == schedule and t.microbatches == M and t.chunks == 1
            assert t.bubble_formula == pytest.approx(formula)
            assert set(t.busy_ms) == {"F", "B"}
        # Busy time by kind: the sleeps (at least; a loaded machine oversleeps a little).
        forward = statistics.median(t.forward_ms for t in timings)
        backward = statistics.median(t.backward_ms for t in timings)
        assert M * T * 1e3 <= forward <= M * T * 1e3 * 1.25, (rank, forward)
        assert 2 * M * T * 1e3 <= backward <= 2 * M * T * 1e3 * 1.25, (rank, backward)
        window = statistics.median(t.window_ms for t in timings)
        ideal = (M + P - 1) * 3 * T * 1e3
        assert ideal <= window <= ideal * 1.15, (rank, window, ideal)
    # Every rank reports the same pipeline figures.
    for step in range(steps):
        assert len({round(r[0][step].window_ms, 9) for r in results}) == 1
    # The aligned window against the shared host clock: rank 0's first mark to the last mark of any rank.
    for step in range(steps):
        absolute = (max(r[1][step][1] for r in results) - results[0][1][step][0]) * 1e3
        aligned = results[0][0][step].window_ms
        assert abs(absolute - aligned) <= 0.05 * absolute, (step, absolute, aligned)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 8))


def on_off_worker(rank, world, schedule, chunks):
    layers = list(_mlp())
    S = world * chunks
    bounds = [round(i * len(layers) / S) for i in range(S + 1)]
    results = []
    for timing in (False, True):
        mine = [copy.deepcopy(nn.Sequential(*layers[bounds[s]:bounds[s + 1]])) for s in range(rank, S, world)]
        opt = torch.optim.SGD([p for m in mine for p in m.parameters()], lr=0.1, momentum=0.9)
        engine = PipelineEngine(mine, ranks=list(range(world)), rank=rank, schedule=schedule, microbatches=4,
                                loss_fn=F.mse_loss)
        engine.timing = timing
        losses = []
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
            losses.append(engine.step(x, y).item())
            opt.step()
            opt.zero_grad()
        results.append((losses, [p.detach().clone() for m in mine for p in m.parameters()], engine.last_timing))
    return results


@pytest.mark.parametrize("schedule,world,chunks", [("1f1b", 2, 1), ("zbh1", 2, 1), ("gpipe", 3, 1),
                                                   ("interleaved_1f1b", 2, 2)])
def test_timing_changes_nothing(schedule, world, chunks):
    results = run_distributed(on_off_worker, world, args=(schedule, chunks), timeout=120)
    for rank, (off, on) in enumerate(results):
        assert off[0] == on[0], rank
        for p, q in zip(off[1], on[1]):
            assert torch.equal(p, q), rank
        assert off[2] is None and on[2] is not None
        assert 0.0 <= on[2].bubble < 1.0 and on[2].forward_ms > 0 and on[2].backward_ms > 0
        if schedule == "zbh1":
            assert set(on[2].busy_ms) == {"F", "I", "W"}
        assert on[2].rank == rank and on[2].chunks == chunks
        assert on[2].window_ms == results[0][1][2].window_ms  # the pipeline's figures: every rank's alike
        assert on[2].rank_busy_ms == results[0][1][2].rank_busy_ms
        assert on[2].rank == rank and on[2].chunks == chunks
        assert on[2].window_ms == results[0][1][2].window_ms  # the pipeline's figures: every rank's alike
        assert on[2].rank_busy_ms == results[0][1][2].rank_busy_ms



# ---------------------------------------------------------------------------------------------------
# The trainer's monitor under a pipeline


def monitored_pipeline_worker(rank, world, log_dir, seconds):
    from torch.utils.data import TensorDataset

    from distributed_training import DistributedTrainer

    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 8, generator=g))
    states, summaries = [], []
    # The same run with and without the monitor (timing a step changes nothing; the second sleeps not).
    for logs, sleep in ((log_dir, seconds), (None, 0.0)):
        torch.manual_seed(0)
        model = nn.Sequential(SleepyLinear(8, sleep), SleepyLinear(8, sleep))
        trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), seed=5,
                                     pipeline_parallel_size=2, pipeline_schedule="1f1b", microbatches=4,
                                     log_dir=logs, log_every=2, progress=False)
        trainer.fit(data, epochs=1, criterion=F.mse_loss, batch_size=8, shuffle=False)
        summaries.append(trainer.get_performance_metrics())
        states.append(trainer.full_state_dict())
        trainer.close()
    same = rank != 0 or all(torch.equal(states[0][k], states[1][k]) for k in states[1])
    return summaries[0], same


def test_monitor_logs_stage_times_and_the_bubble_under_a_pipeline(tmp_path):
    import json

    results = run_distributed(monitored_pipeline_worker, 2, args=(str(tmp_path), T), timeout=120)
    formula = bubble_formula("1f1b", 2, M)
    for rank, (summary, same) in enumerate(results):
        assert same, "the monitored run's parameters differ from the unmonitored one's"
        lines = [json.loads(l) for l in (tmp_path / f"rank_{rank}" / "metrics.jsonl").read_text().splitlines()]
        assert [l["step"] for l in lines] == [2, 4], lines
        for line in lines:
            # This rank's stage: M forwards of T and M backwards of 2T (at least: oversleeping).
            assert M * T * 1e3 <= line["pipeline/forward_ms"] <= 1.25 * M * T * 1e3, line
            assert 2 * M * T * 1e3 <= line["pipeline/backward_ms"] <= 1.25 * 2 * M * T * 1e3, line
            assert line["pipeline/bubble_formula"] == pytest.approx(formula)
            assert abs(line["pipeline/bubble_simulated"] - formula) <= 0.02, line
        # As in the engine's test; the trainer's steps pass a little more through the host between messages.
        assert formula - 0.03 <= min(l["pipeline/bubble"] for l in lines) <= formula + 0.05, lines
        assert summary["pipeline_bubble"] == pytest.approx(statistics.mean(l["pipeline/bubble"] for l in lines))
        assert summary["pipeline_bubble_formula"] == pytest.approx(formula)
