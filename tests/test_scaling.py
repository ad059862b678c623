"""The scaling model: collective formulas, calibration, the step simulation, projections; and the model
against recorded GPU runs (the benchmark suite itself is tested in test_benchmarks.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from distributed_training.scaling import (Cluster, Link, StepProfile, all_reduce, calibrate_link,
                                          hierarchical_all_reduce, project, ring_all_gather, ring_all_reduce,
                                          step_time, tree_all_reduce)

REPO = Path(__file__).resolve().parents[1]
NVLINK = Link(alpha=5e-6, bandwidth=300e9)
IB = Link(alpha=10e-6, bandwidth=50e9)


def test_collective_formulas():
    m = 1e9
    assert ring_all_reduce(4, m, NVLINK) == pytest.approx(6 * 5e-6 + 1.5 * m / 300e9)
    assert tree_all_reduce(8, m, NVLINK) == pytest.approx(6 * 5e-6 + 2 * m / 300e9)
    assert ring_all_gather(4, m, NVLINK) == pytest.approx(3 * 5e-6 + 0.75 * m / 300e9)
    assert ring_all_reduce(1, m, NVLINK) == tree_all_reduce(1, m, NVLINK) == 0.0
    one_node = Cluster(8, 8, NVLINK, IB)
    # In one node, hierarchical = reduce-scatter + all-gather = a ring all-reduce.
    assert hierarchical_all_reduce(one_node, m) == pytest.approx(ring_all_reduce(8, m, NVLINK))
    # Across nodes a flat ring runs at InfiniBand speed; the hierarchy sends only 1/8 of it there.
    four_nodes = Cluster(32, 8, NVLINK, IB)
    assert all_reduce(four_nodes, m, "ring") == pytest.approx(ring_all_reduce(32, m, Link(10e-6, 50e9)))
    assert all_reduce(four_nodes, m, "hierarchical") < all_reduce(four_nodes, m, "ring")
    assert all_reduce(four_nodes, m) == min(all_reduce(four_nodes, m, a) for a in ("ring", "tree", "hierarchical"))
    # Small messages: the tree's log-depth latency wins at scale.
    many = Cluster(256, 8, NVLINK, IB)
    assert all_reduce(many, 1e3, "tree") < all_reduce(many, 1e3, "ring")


@pytest.mark.parametrize("op, formula", [("ring_all_reduce", ring_all_reduce), ("all_gather", ring_all_gather),
                                         ("tree_all_reduce", tree_all_reduce)])
def test_calibration_recovers_the_link(op, formula):
    truth = Link(alpha=12e-6, bandwidth=180e9)
    sizes = [2.0**k for k in range(20, 31, 2)]
    times = [formula(4, s, truth) for s in sizes]
    fitted = calibrate_link(4, sizes, times, op)
    assert fitted.alpha == pytest.approx(truth.alpha, rel=1e-6)
    assert fitted.bandwidth == pytest.approx(truth.bandwidth, rel=1e-6)
    with pytest.raises(ValueError, match="do not grow"):
        calibrate_link(4, sizes, [1.0] * len(sizes), op)


def test_ddp_pipeline_by_hand():
    # 2 buckets of 1 GB each; backward 1 s, forward 0.5 s; each bucket takes 0.6 s on the link.
    link = Link(alpha=0.0, bandwidth=2 * 1 / 2 * 1e9 / 0.6)  # ring of 2: 1 GB costs 0.6 s
    prof = StepProfile(params=int(0.5e9), compute_s=1.5, optimizer_s=0.1, backward_fraction=2 / 3,
                       bucket_bytes=1e9, grad_bytes=4)
    t = step_time(prof, Cluster(2, 2, link, link), "ddp")
    # Bucket 1 ready at 1.0, done 1.6; bucket 2 ready at 1.5, starts 1.6, done 2.2; backward ends 1.5.
    assert t["comm"] == pytest.approx(1.2)
    assert t["exposed"] == pytest.approx(0.7)
    assert t["total"] == pytest.approx(1.5 + 0.7 + 0.1)
    # Without overlap everything is exposed.
    prof.overlap = 0.0
    assert step_time(prof, Cluster(2, 2, link, link), "ddp")["exposed"] == pytest.approx(1.2)


def test_step_model_limits_and_orderings():
    prof = StepProfile(params=int(1.3e9), compute_s=0.28, optimizer_s=0.01, units=24)
    fast = Link(0.0, 1e18)
    for strategy in ("ddp", "zero1", "zero2", "zero3", "ddp_bf16"):
        t = step_time(prof, Cluster(8, 8, fast, fast), strategy)
        expected_opt = 0.01 if strategy.startswith("ddp") else 0.01 / 8
        assert t["total"] == pytest.approx(0.28 + expected_opt, rel=1e-6), strategy
    slow = Cluster(64, 8, NVLINK, Link(10e-6, 5e9))
    ddp, bf16, zero3 = (step_time(prof, slow, s) for s in ("ddp", "ddp_bf16", "zero3"))
    assert bf16["comm"] < ddp["comm"] and bf16["total"] <= ddp["total"]
    assert zero3["comm"] > ddp["comm"]  # two gathers and a reduce-scatter move 1.5x DDP's bytes
    assert step_time(prof, Cluster(1, 8, NVLINK, IB), "ddp")["total"] == pytest.approx(0.29)
    with pytest.raises(ValueError, match="strategy must be one of"):
        step_time(prof, slow, "zero4")


def test_projection_chooses_and_explains():
    compute_bound = StepProfile(params=int(124e6), compute_s=0.05, optimizer_s=0.002)
    rows = project(compute_bound, [8, 64, 256], 8, NVLINK, IB)
    assert [r["gpus"] for r in rows] == [8, 64, 256]
    # Compute-bound: a lossless strategy, nearly linear (ZeRO may win by sharding the optimizer step).
    assert rows[0]["choice"] in ("ddp", "zero1", "zero2", "zero3") and rows[0]["efficiency"] > 0.9, rows[0]
    assert all(r["reason"] and r["choice"] in r["reason"] for r in rows)
    # Above 1 only by what sharding the optimizer step saves (weak scaling against the bare model).
    assert all(r["efficiency"] <= (0.05 + 0.002) / 0.05 for r in rows)
    # A model whose 16 bytes/parameter do not fit one GPU: DDP and ZeRO-1 are ruled out.
    big = StepProfile(params=int(13e9), compute_s=2.0, optimizer_s=0.1, units=40)
    rows = project(big, [8], 8, NVLINK, IB, memory_bytes=80e9, largest_unit_params=int(13e9 / 40))
    assert rows[0]["choice"] in ("zero2", "zero3"), rows[0]
    # A very slow network makes compression worth it, and the reason says so.
    slow = project(compute_bound, [256], 8, NVLINK, Link(50e-6, 0.5e9))[0]
    assert slow["choice"].startswith("ddp_") and "faster than" in slow["reason"], slow


def test_model_on_the_recorded_h200_ddp_runs():
    """The model against the 2x H200 DDP runs on file (benchmarks/results/ddp_2026-11-26_h200.json): within
    10% whatever the overlap, since at 2 GPUs the gradient all-reduce is small next to compute."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from phases.model_check import check

    runs = json.loads((REPO / "benchmarks/results/ddp_2026-11-26_h200.json").read_text())["runs"]
    rows = check(runs)
    assert {(r["model"], r["micro_batch"]) for r in rows} == {("gpt-1.3b", 16), ("gpt-1.3b", 8), ("gpt2-124m", 16)}
    for r in rows:
        assert abs(r["error_overlap1"]) < 0.10 and abs(r["error_overlap0"]) < 0.10, r
        assert r["predicted_overlap1_s"] <= r["measured_s"] <= r["predicted_overlap0_s"], r


def test_break_even_bandwidth_is_where_compression_stops_paying():
    from distributed_training.scaling import Cluster, Link, StepProfile, break_even_bandwidth, step_time

    profile = StepProfile(params=100_000_000, compute_s=0.1, optimizer_s=0.01, overhead_s={"ddp_bf16": 0.002})
    bw = break_even_bandwidth(profile, 4, "ddp_bf16", alpha=5e-6)
    assert bw is not None and 1e6 < bw < 1e13

    def gain(b):
        c = Cluster(4, 4, Link(5e-6, b), Link(5e-6, b))
        return step_time(profile, c, "ddp")["total"] - step_time(profile, c, "ddp_bf16")["total"]

    assert gain(bw * 0.9) > 0 > gain(bw * 1.1)  # it pays below the crossing, not above
    # Free compression wins at any speed; compression costing more than any communication never does.
    assert break_even_bandwidth(StepProfile(params=10**8, compute_s=0.0, optimizer_s=0.0), 4, "ddp_bf16", 5e-6) \
        == float("inf")
    costly = StepProfile(params=1000, compute_s=0.1, optimizer_s=0.0, overhead_s={"ddp_bf16": 1.0})
    assert break_even_bandwidth(costly, 4, "ddp_bf16", 5e-6) is None
    with pytest.raises(ValueError, match="compressed"):
        break_even_bandwidth(profile, 4, "ddp", 5e-6)


def test_impossible_inputs_are_refused_by_name():
    """Session 50's trial: state_bytes gave -160 bytes for -10 parameters, max_batch_size_for_budget divided by
    zero, calibrate_link took negative sizes and 2.5 ranks, project took negative memory and a compression
    gain of 0 (always PowerSGD), StepProfile(params=inf) overflowed."""
    from distributed_training import planner, scaling

    link = scaling.Link(alpha=1e-5, bandwidth=1e10)
    profile = scaling.StepProfile(params=1000, compute_s=0.1, optimizer_s=0.01)
    cases = {"num_params": lambda: planner.state_bytes("ddp", -10, 2),
             "bytes_per_sample": lambda: planner.max_batch_size_for_budget(1e9, 0, 0),
             "budget_bytes": lambda: planner.max_batch_size_for_budget(float("nan"), 0, 10),
             "sizes": lambda: scaling.calibrate_link(2, [-1, 2], [1e-3, 2e-3]),
             "n must be an integer": lambda: scaling.calibrate_link(2.5, [1, 2], [1e-3, 2e-3]),
             "memory_bytes": lambda: scaling.project(profile, [2], 8, link, link, memory_bytes=-1),
             "activation_bytes": lambda: scaling.project(profile, [2], 8, link, link, activation_bytes=-1e12),
             "compression_gain": lambda: scaling.project(profile, [2], 8, link, link, compression_gain=0),
             "StepProfile.params": lambda: scaling.StepProfile(params=float("inf"), compute_s=1, optimizer_s=0)}
    for name, call in cases.items():
        with pytest.raises(ValueError, match=name):
            call()
