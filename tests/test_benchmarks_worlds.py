"""The benchmark suite's phases at worlds 3 and 4 on CPU (gloo): the parameter server's consistency modes and
the pipeline with data-parallel pipelines (kept apart from `test_benchmarks.py`, so that the two pytest
workers can run them beside its smoke run of every phase)."""

from __future__ import annotations

import pytest

from _bench import _check_ps_recommender, _suite


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ps_phase_at_world_3_compares_sync_ssp_and_async(tmp_path, warm_python):
    """The ps phase at world 3: the recommender with one and two servers; on the digits one server and two
    workers, the second slow: every mode reaches 0.9, sync measures no staleness, ssp at most its bound
    (and some: the fast worker ran ahead), async one update per gradient."""
    results = _suite(tmp_path, "--phases", "ps", "--worlds", "3", timeout=280, warm_python=warm_python)
    part = results["phases"]["ps"]["worlds"]["3"]
    assert part["status"] == "ok", part.get("reason")
    _check_ps_recommender(part["recommender"], 3)
    cons = part["consistency"]
    assert cons["status"] == "ok" and cons["workers"] == 2 and cons["slow_worker"] == 1
    modes = cons["modes"]
    assert list(modes) == ["sync", "ssp", "async"]
    steps = cons["steps_per_worker"]
    for mode, m in modes.items():
        assert m["reached"] and 0 < m["time_to_accuracy_s"] < max(m["wall_s_per_worker"]), (mode, m)
        assert m["final_accuracy"] >= 0.85, (mode, m)
    assert modes["sync"]["max_staleness"] == 0 and modes["sync"]["updates"] == steps
    assert 1 <= modes["ssp"]["max_staleness"] <= 2 and modes["ssp"]["updates"] == 2 * steps  # one a gradient
    assert modes["async"]["updates"] == 2 * steps and modes["async"]["pulls_delayed"] == 0
    # The rotating straggler: the same bounds; sync waits for someone's sleep every step, ssp and async do
    # not, so they finish sooner (every worker sleeps in half of its steps; sync's wall is at least all of
    # them). Only what the delay alone forces is asserted: timings on shared cores are noisy.
    rotating = cons["rotating"]
    assert all(m["reached"] for m in rotating.values()), rotating
    assert rotating["sync"]["max_staleness"] == 0 and rotating["ssp"]["max_staleness"] <= 2
    assert min(rotating["sync"]["wall_s_per_worker"]) >= steps * cons["delay_s"]
    md = (tmp_path / "results.md").read_text()
    assert "## Parameter server, world 3" in md and "| one slow | ssp s=2 |" in md and "| rotating | async |" in md
    assert "| ps_s2 | 2 x 1 |" in md


def _cut(pipe, balance, schedule, P, chunks):
    """The cut the phase makes: the measured times a third forward, two thirds backward, cut for the
    schedule (torch's zero-bubble schedule, 2 stages a rank, as the interleaved one)."""
    from distributed_training.pipeline.balance import schedule_cut

    forward, backward = pipe["layer_step_costs"][balance]
    assert [f + b for f, b in zip(forward, backward)] == pipe["layer_costs"][balance]
    assert all(b == pytest.approx(2 * f) for f, b in zip(forward, backward))
    return schedule_cut(forward, backward, "interleaved_1f1b" if chunks > 1 else schedule, P, pipe["microbatches"], chunks)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_pipeline_phase_at_world_4_with_data_parallel_pipelines_balanced_by_time(tmp_path, warm_python):
    """The pipeline phase at world 4 (gloo): P = 4 and P = 2 x DP = 2, every schedule of ours and torch's,
    stages balanced by measured time. Same initial weights and global batch everywhere, so every run's
    last loss is the same: the two pipelines of P = 2 x DP = 2 see different halves of the batch (their
    own losses differ), and only the average of their gradients over the data groups keeps them on
    P = 4's trajectory (without it their mean loss moves off by about 6e-3 here)."""
    from distributed_training.pipeline import bubble_formula

    results = _suite(tmp_path, "--phases", "pipeline", "--worlds", "4", "--variants", "time", timeout=400,
                     warm_python=warm_python)
    pipe = results["phases"]["pipeline"]["worlds"]["4"]
    assert pipe["status"] == "ok" and pipe["balances"] == ["time"], pipe.get("reason")
    assert list(pipe["configs"]) == ["P4 time", "P2xDP2 time"]
    dp = pipe["configs"]["P2xDP2 time"]
    assert (dp["pipeline"], dp["data"], dp["microbatch_sequences"]) == (2, 2, 1)
    costs = pipe["layer_costs"]["time"]  # embed, 16 blocks, head: seconds, each measured
    assert len(costs) == 18 and all(c > 0 for c in costs)
    reference = pipe["runs"]["ours_1f1b"]["last_loss"]  # the first configuration's keys carry no prefix
    for prefix, P in (("", 4), ("P2xDP2 time ", 2)):
        for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zbh1"):
            for impl in ("ours", "torch"):
                run = pipe["runs"][f"{prefix}{impl}_{schedule}"]
                assert run["status"] == "ok" and run["step_ms"] > 0, (prefix, impl, schedule, run)
                assert (run["pipeline"], run["data"], run["balance"]) == (P, 4 // P, "time")
                # Cut by the measured times, for the schedule.
                assert run["bounds"] == _cut(pipe, "time", schedule, P, run["chunks_per_rank"]), (prefix, impl, schedule)
                assert run["last_loss"] == pytest.approx(reference, rel=1e-5), (prefix, impl, schedule)
                assert len(run["last_loss_per_pipeline"]) == 4 // P
            ours = pipe["runs"][f"{prefix}ours_{schedule}"]
            assert ours["bubble_formula"] == pytest.approx(bubble_formula(schedule, P, 4, chunks=ours["chunks_per_rank"]))
            assert 0 <= ours["bubble_measured"] < 1 and len(ours["bubble_measured_per_pipeline"]) == 4 // P
            assert len(ours["forward_ms_per_rank"]) == 4
    halves = pipe["runs"]["P2xDP2 time ours_1f1b"]["last_loss_per_pipeline"]
    assert abs(halves[0] - halves[1]) > 1e-4  # different data: the agreement above is not a coincidence
    md = (tmp_path / "results.md").read_text()
    assert "| P2xDP2 time | 1f1b |" in md and "Balance by time:" in md


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipeline_phase_balances_half_blocks_by_measured_time(tmp_path, warm_python):
    """``--variants halves_time``: the chain cut at half blocks (embed, block.i.a, block.i.m, ..., head), each
    layer timed on the device, and every run cut by those times; ours and torch's reach the same loss."""
    # fork=False: this world job is started as a GPU run starts it (torchrun, fresh workers), so that the
    # suite's own launch stays covered; the other suite runs fork their ranks (cheaper, same phases).
    results = _suite(tmp_path, "--phases", "pipeline", "--worlds", "2", "--variants", "pp,halves_time", timeout=280,
                     warm_python=warm_python, fork=False)
    pipe = results["phases"]["pipeline"]["worlds"]["2"]
    assert pipe["status"] == "ok" and pipe["balances"] == ["halves_time"], pipe.get("reason")
    costs = pipe["layer_costs"]["halves_time"]
    assert len(costs) == 2 + 2 * 8 and all(c > 0 for c in costs)  # the smoke GPT's 8 blocks in halves
    assert pipe["time_balance"]["halves_time"]["sample_shape"] == [2, 16]
    reference = pipe["runs"]["ours_1f1b"]["last_loss"]
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zbh1"):
        for impl in ("ours", "torch"):
            run = pipe["runs"][f"{impl}_{schedule}"]
            assert run["status"] == "ok" and run["balance"] == "halves_time", (impl, schedule, run)
            assert run["bounds"] == _cut(pipe, "halves_time", schedule, 2, run["chunks_per_rank"]), (impl, schedule)
            assert run["last_loss"] == pytest.approx(reference, rel=1e-5), (impl, schedule)
    md = (tmp_path / "results.md").read_text()
    assert "stages balanced by measured time, the blocks cut in halves" in md
    assert "Balance by halves_time: each layer's forward + backward on one microbatch of 2 x 16 tokens" in md
