"""Defects a new user's trial of the pipeline found (session 27), each tested where it was fixed."""

from __future__ import annotations

import random
import time

import pytest

from distributed_training.pipeline import partition
from distributed_training.pipeline.balance import schedule_cut
from distributed_training.pipeline.schedules import build_schedule, simulate, stage_of
from test_pipeline_balance import _makespan  # the simulated step of a cut, as schedule_cut scores it


def _costs(n: int, seed: int = 0):
    rng = random.Random(seed)
    forward = [1.0 + rng.random() for _ in range(n)]
    return forward, [2.0 * f for f in forward]


def test_schedule_cut_is_quick_at_200_layers_8_ranks_2_chunks():
    """Every rank runs the search at setup. Each candidate cut was scored by a full `simulate`, a move
    scoring ~300 of them: 17 s here at 200 layers, P = 8, 2 chunks, 32 microbatches (6 minutes at 98
    layers, P = 8, 4 chunks, 64 microbatches). Now all of a move's candidates at once, and bounded."""
    forward, backward = _costs(200)
    start = time.perf_counter()
    cut = schedule_cut(forward, backward, "interleaved_1f1b", 8, 32, 2)
    took = time.perf_counter() - start
    assert took < 5.0, f"schedule_cut took {took:.1f} s"
    assert len(cut) == 17 and cut[0] == 0 and cut[-1] == 200 and all(a < b for a, b in zip(cut, cut[1:]))


def test_schedule_cut_work_is_bounded_and_the_same_on_every_call():
    """A bound counted in work, not seconds: every rank stops at the same cut. No work at all: the
    search's starting point (`partition`); a bound in between: a cut no worse than that."""
    forward, backward = _costs(40, seed=1)
    start = partition([f + b for f, b in zip(forward, backward)], 8)
    assert schedule_cut(forward, backward, "interleaved_1f1b", 4, 8, 2, max_work=0) == start
    some = schedule_cut(forward, backward, "interleaved_1f1b", 4, 8, 2, max_work=200_000)
    assert some == schedule_cut(forward, backward, "interleaved_1f1b", 4, 8, 2, max_work=200_000)
    full = schedule_cut(forward, backward, "interleaved_1f1b", 4, 8, 2)
    spans = [_makespan(forward, backward, cut, "interleaved_1f1b", 4, 8, 2) for cut in (start, some, full)]
    assert spans[0] >= spans[1] >= spans[2], spans


@pytest.mark.parametrize("schedule, P, M, V", [("gpipe", 3, 2, 1), ("1f1b", 4, 6, 1), ("zbh1", 3, 5, 1),
                                               ("interleaved_1f1b", 2, 4, 3), ("1f1b", 1, 3, 1)])
def test_the_vectorised_step_equals_simulate_to_the_bit(schedule, P, M, V):
    """`_StepModel.makespans` (all candidates at once) gives `simulate`'s makespan exactly, so the
    search picks the cut it picked before."""
    from distributed_training.pipeline.balance import _StepModel

    rng = random.Random(2)
    n = P * V + 7
    forward = [rng.random() + 0.05 for _ in range(n)]
    backward = [f * (1 + 2 * rng.random()) for f in forward]
    fsum, bsum = [0.0], [0.0]
    for f, b in zip(forward, backward):
        fsum.append(fsum[-1] + f)
        bsum.append(bsum[-1] + b)
    cuts = [[0, *sorted(rng.sample(range(1, n), P * V - 1)), n] for _ in range(6)]
    got = _StepModel(schedule, P, M, V).makespans(fsum, bsum, cuts)
    for cut, value in zip(cuts, got):
        fw = [fsum[cut[s + 1]] - fsum[cut[s]] for s in range(P * V)]
        bw = [bsum[cut[s + 1]] - bsum[cut[s]] for s in range(P * V)]

        def cost(rank, action):
            s = stage_of(rank, action.chunk, P)
            return fw[s] if action.kind == "F" else bw[s] if action.kind == "B" else bw[s] / 2.0

        assert value == simulate(build_schedule(schedule, P, M, V), P, V, cost, microbatches=M).makespan


def test_the_pipeline_phase_world_4_test_keeps_its_slow_mark_and_timeout():
    """`_cut` was inserted between the marks and the test they were for: the marks went to the helper, and
    the world-4 pipeline phase (a 400 s suite run) lost ``slow`` and its 420 s timeout (pytest's default is
    300 s)."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).parent / "test_benchmarks_worlds.py").read_text())
    marks = {node.name: [ast.unparse(d) for d in node.decorator_list]
             for node in tree.body if isinstance(node, ast.FunctionDef)}
    test = marks["test_pipeline_phase_at_world_4_with_data_parallel_pipelines_balanced_by_time"]
    assert "pytest.mark.slow" in test and "pytest.mark.timeout(420)" in test, test
    assert not [name for name, decorators in marks.items() if not name.startswith("test") and
                any("pytest.mark" in d for d in decorators)], marks


@pytest.mark.parametrize("preset, refused", [("classifier", True), ("tiny", False)])
def test_dtrain_refuses_compute_balance_for_a_model_without_a_compute_model_before_the_rendezvous(
        monkeypatch, preset, refused):
    """`training.pipeline_balance: compute` on the classifier passed the config's checks and failed in every
    rank's trainer with a ValueError traceback (torchrun's ChildFailedError around it); the other
    mismatches of the pipeline fields and the model are an invalid config naming the field, said once."""
    from distributed_training.config import ConfigError, load_config
    from distributed_training.dtrain_checks import check_pipeline_fits
    from distributed_training.dtrain_job import _build

    data = {"dataset": "digits"} if preset == "classifier" else {}
    cfg = load_config({"model": {"preset": preset}, "data": data,
                       "training": {"pipeline_parallel_size": 2, "pipeline_balance": "compute"}})
    monkeypatch.setenv("WORLD_SIZE", "2")
    if refused:
        with pytest.raises(ConfigError, match=r"^training\.pipeline_balance 'compute' knows the compute of our GPT "
                                              r"only, not of a Sequential"):
            check_pipeline_fits(cfg, _build(cfg)[0])
    else:
        check_pipeline_fits(cfg, _build(cfg)[0])
    split = load_config({"model": {"preset": preset}, "data": data,
                         "training": {"pipeline_parallel_size": 2, "pipeline_balance": "compute",
                                      "pipeline_split_points": ["2" if preset == "classifier" else "block.1"]}})
    check_pipeline_fits(split, _build(split)[0])  # split points decide the cut: the balance is not used


def test_the_config_says_what_cuts_the_stages_without_split_points():
    """`dtrain --print-config` said ``pipeline_split_points: null`` balances the stages by parameter count,
    whatever ``pipeline_balance`` says."""
    from distributed_training.config import TrainingConfig

    split = TrainingConfig.model_fields["pipeline_split_points"].description
    balance = TrainingConfig.model_fields["pipeline_balance"].description
    assert "parameter count" not in split and "pipeline_balance" in split, split
    assert "simulated step" in balance, balance
