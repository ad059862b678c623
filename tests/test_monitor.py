"""The training monitor: per-rank logs, the cluster view, system figures, the plot command, its cost."""

from __future__ import annotations

import io
import json
import os
import sys
import time
import types
import warnings

import pytest
import torch

from distributed_training.monitor import Monitor, NullMonitor, StragglerWarning, SystemStats
from distributed_training.testing import run_distributed

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GPU_KEYS = ("system/gpu_util_pct", "system/gpu_mem_used_gib", "system/gpu_power_w", "system/gpu_temp_c")

# The two-rank run of test (a): 20 steps, a log every 5. Ranks are even for steps 1-10; from step 11
# rank 1 takes 3x as long per step, so the logs at 15 and 20 must flag it.
STEPS, LOG_EVERY, SAMPLES, TOKENS = 20, 5, 8, 8 * 16
FAST, DATA = 0.010, 0.002


def step_time_of(rank: int, step: int) -> float:
    return FAST * 3 if rank == 1 and step > 10 else FAST


def comm_time_of(rank: int) -> float:
    return 0.001 * (rank + 1)


def loss_of(rank: int, step: int) -> float:
    return 1.0 / step + rank


def event_scalars(rank_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(rank_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_jsonl(rank_dir: str) -> list[dict]:
    with open(os.path.join(rank_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# ------------------------------------------------------------------ (a) two ranks, gloo
def two_rank_worker(rank: int, world: int, log_dir: str, background: bool | None = None) -> dict:
    # A monitor whose world_size disagrees with the process group is refused.
    with pytest.raises(ValueError, match="world_size"):
        Monitor(log_dir, rank=rank, world_size=world + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Monitor(log_dir, rank=rank, world_size=world, log_every=LOG_EVERY, progress=False,
                     background=background) as mon:
            mon.start(total_steps=STEPS)
            for step in range(1, STEPS + 1):
                metrics = {
                    "loss": torch.tensor(loss_of(rank, step)),
                    "lr": 0.1,
                    "grad_norm": torch.tensor(2.0 * step),
                    "loss_scale": 1024.0,
                }
                mon.record_step(step, metrics, samples=SAMPLES, tokens=TOKENS, step_time=step_time_of(rank, step),
                                data_time=DATA, comm_time=comm_time_of(rank))
            perf = mon.get_performance_metrics()
    stragglers = [str(w.message) for w in caught if issubclass(w.category, StragglerWarning)]
    return {"perf": perf, "stragglers": stragglers}


@pytest.mark.parametrize("background", [None, True], ids=["inline", "writer_thread"])
def test_two_ranks_event_files_jsonl_and_cluster_view(tmp_path, background):
    """Inline (CPU values: written at once) and through the writer thread, the same files and figures."""
    log_dir = str(tmp_path / "run")
    results = run_distributed(two_rank_worker, 2, args=(log_dir, background), timeout=180)
    log_steps = list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))

    for rank in (0, 1):
        rank_dir = os.path.join(log_dir, f"rank_{rank}")
        assert any(name.startswith("events.out.tfevents") for name in os.listdir(rank_dir)), os.listdir(rank_dir)
        scalars = event_scalars(rank_dir)
        for tag in ("train/loss", "train/lr", "train/grad_norm", "train/loss_scale", "perf/step_time_s",
                    "perf/samples_per_s", "perf/tokens_per_s", "perf/data_time_s", "perf/comm_time_s",
                    "perf/compute_time_s", "perf/exposed_comm_pct", "system/cpu_pct", "system/rss_gib"):
            assert tag in scalars, (rank, tag, sorted(scalars))
            assert [s for s, _ in scalars[tag]] == log_steps, (rank, tag)
        assert [v for _, v in scalars["train/loss"]] == pytest.approx([loss_of(rank, s) for s in log_steps], rel=1e-6)
        assert [v for _, v in scalars["train/grad_norm"]] == pytest.approx([2.0 * s for s in log_steps], rel=1e-6)
        assert [v for _, v in scalars["train/lr"]] == pytest.approx([0.1] * 4, rel=1e-6)
        # Window means: the window ending at step s covers steps s-4..s (all one speed here).
        want_step = [step_time_of(rank, s) for s in log_steps]
        assert [v for _, v in scalars["perf/step_time_s"]] == pytest.approx(want_step, rel=1e-6)
        assert [v for _, v in scalars["perf/samples_per_s"]] == pytest.approx([SAMPLES / t for t in want_step], rel=1e-6)
        assert [v for _, v in scalars["perf/exposed_comm_pct"]] == pytest.approx(
            [100 * comm_time_of(rank) / t for t in want_step], rel=1e-6)
        assert [v for _, v in scalars["perf/compute_time_s"]] == pytest.approx(
            [t - DATA - comm_time_of(rank) for t in want_step], rel=1e-5)
        cluster_tags = {t for t in scalars if t.startswith("cluster/")}
        if rank == 0:
            assert {"cluster/step_time_min_s", "cluster/step_time_mean_s", "cluster/step_time_max_s",
                    "cluster/slowest_rank", "cluster/straggler"} <= cluster_tags
            assert [v for _, v in scalars["cluster/straggler"]] == [0.0, 0.0, 1.0, 1.0]
            assert [v for _, v in scalars["cluster/slowest_rank"][2:]] == [1.0, 1.0]
            assert [v for _, v in scalars["cluster/step_time_max_s"]] == pytest.approx([FAST, FAST, 3 * FAST, 3 * FAST])
            assert [v for _, v in scalars["cluster/step_time_min_s"]] == pytest.approx([FAST] * 4)
            assert [v for _, v in scalars["cluster/step_time_mean_s"]] == pytest.approx([FAST, FAST, 2 * FAST, 2 * FAST])
        else:
            assert not cluster_tags, cluster_tags

        lines = read_jsonl(rank_dir)
        assert [line["step"] for line in lines] == log_steps
        assert all(line["rank"] == rank for line in lines)
        assert all(isinstance(line["time"], float) and line["time"] > 1e9 for line in lines)
        # JSONL keeps the exact float of the tensor passed (float32 here).
        assert [line["train/loss"] for line in lines] == [float(torch.tensor(loss_of(rank, s))) for s in log_steps]
        assert [line["perf/samples_per_s"] for line in lines] == pytest.approx([SAMPLES / t for t in want_step])
        assert ("cluster/straggler" in lines[-1]) == (rank == 0)
        if rank == 0:
            assert [line["cluster/straggler"] for line in lines] == [0.0, 0.0, 1.0, 1.0]
            assert lines[-1]["cluster/slowest_rank"] == 1.0

        perf = results[rank]["perf"]
        total_time = sum(step_time_of(rank, s) for s in range(1, STEPS + 1))
        assert perf["steps"] == STEPS
        assert perf["mean_step_time_s"] == pytest.approx(total_time / STEPS)
        assert perf["samples_per_s_per_gpu"] == pytest.approx(SAMPLES * STEPS / total_time)
        assert perf["tokens_per_s_per_gpu"] == pytest.approx(TOKENS * STEPS / total_time)
        assert perf["communication_overhead_pct"] == pytest.approx(100 * comm_time_of(rank) * STEPS / total_time)
        assert perf["data_loading_pct"] == pytest.approx(100 * DATA * STEPS / total_time)
        # Every rank receives the all-gather, so every rank knows the cluster view.
        assert perf["cluster_slowest_rank"] == 1 and perf["cluster_straggler"] is True
        assert perf["cluster_step_time_max_s"] == pytest.approx(3 * FAST)
        assert perf["straggler_events"] == 2

    # Only the writer of the cluster view warns, naming the slow rank: at the second window it is flagged in.
    assert len(results[0]["stragglers"]) == 1 and all("rank 1" in m for m in results[0]["stragglers"])
    assert results[0]["stragglers"][0].startswith(f"straggler at step {STEPS}:"), results[0]["stragglers"]
    assert results[1]["stragglers"] == []


# ------------------------------------------------------------------ one process, no process group
def test_single_process_without_process_group(tmp_path):
    assert not torch.distributed.is_initialized()
    with Monitor(tmp_path, rank=0, world_size=1, log_every=2, progress=False, system_stats=False) as mon:
        for step in range(1, 5):
            mon.record_step(step, {"loss": 1.0 * step}, samples=4, step_time=0.5)
        perf = mon.get_performance_metrics()
    scalars = event_scalars(str(tmp_path / "rank_0"))
    assert [v for _, v in scalars["train/loss"]] == [2.0, 4.0]
    assert not any(t.startswith(("cluster/", "system/")) for t in scalars)
    # No comm_time / tokens given: those figures are absent, not invented.
    assert "perf/exposed_comm_pct" not in scalars and "perf/tokens_per_s" not in scalars
    assert perf["samples_per_s_per_gpu"] == pytest.approx(8.0)
    assert perf["communication_overhead_pct"] is None and perf["tokens_per_s_per_gpu"] is None
    assert perf["cluster_slowest_rank"] is None and perf["straggler_events"] == 0


def test_jsonl_is_strict_json_with_a_nan_loss(tmp_path):
    # json.dumps wrote NaN / Infinity, which jq and JavaScript refuse: a non-finite value is null now.
    with Monitor(tmp_path, rank=0, world_size=1, log_every=1, progress=False, system_stats=False) as mon:
        mon.record_step(1, {"loss": float("nan"), "grad_norm": float("inf")}, samples=4, step_time=0.5)
        mon.record_step(2, {"loss": 2.0, "grad_norm": 1.0}, samples=4, step_time=0.5)
        mon.record_eval(2, {"loss": float("nan")}, {"loss": float("-inf")})

    def strict(token):
        raise ValueError(f"not strict JSON: {token}")

    for name in ("metrics.jsonl", "eval.jsonl"):
        path = tmp_path / "rank_0" / name
        records = [json.loads(line, parse_constant=strict) for line in path.read_text().splitlines()]
        if name == "metrics.jsonl":
            assert records[0]["train/loss"] is None and records[0]["train/grad_norm"] is None
            assert records[1]["train/loss"] == 2.0
        else:
            assert records[0]["val/loss"] is None


class CountingScalar:
    """A metric that counts how often it is read."""

    def __init__(self, value: float) -> None:
        self.value, self.reads = value, 0

    def __float__(self) -> float:
        self.reads += 1
        return self.value


def test_non_log_steps_read_nothing_and_write_nothing(tmp_path):
    metric = CountingScalar(3.0)
    mon = Monitor(tmp_path, rank=0, world_size=1, log_every=5, progress=False, system_stats=False, tensorboard=False)
    jsonl = tmp_path / "rank_0" / "metrics.jsonl"
    for step in range(1, 5):
        mon.record_step(step, {"loss": metric}, samples=1, step_time=0.1)
    assert metric.reads == 0 and jsonl.stat().st_size == 0
    mon.record_step(5, {"loss": metric}, samples=1, step_time=0.1)
    assert metric.reads == 1 and len(jsonl.read_text().splitlines()) == 1
    # Steps must increase; a closed monitor refuses more steps; close twice is fine.
    with pytest.raises(ValueError, match="step"):
        mon.record_step(5, {}, samples=1, step_time=0.1)
    mon.close()
    mon.close()
    with pytest.raises(RuntimeError, match="closed"):
        mon.record_step(6, {}, samples=1, step_time=0.1)


class _Terminal(io.StringIO):
    """What stderr is on a terminal, as far as the progress bar asks."""

    def isatty(self) -> bool:
        return True


def test_progress_bar_on_stderr(tmp_path, capsys, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with Monitor(tmp_path, rank=0, world_size=1, log_every=5, system_stats=False, tensorboard=False) as mon:
        mon.start(total_steps=10)
        for step in range(1, 11):
            mon.record_step(step, {"loss": 0.5}, samples=1, step_time=0.01)
    err = terminal.getvalue()
    assert "\r" in err and err.endswith("\n")
    assert "step 10/10" in err and "steps/s" in err and "ETA" in err and "loss 0.5" in err
    monkeypatch.undo()
    # Not on other ranks.
    with Monitor(tmp_path, rank=1, world_size=2, log_every=5, system_stats=False, tensorboard=False) as mon:
        mon.start(total_steps=10)
        mon.record_step(5, {"loss": 0.5}, samples=1, step_time=0.01)
    assert capsys.readouterr().err == ""


def test_the_bars_rate_leaves_an_evaluation_out(tmp_path, monkeypatch):
    # An evaluation between two log steps counted as training time: the bar's steps/s dropped after each.
    rates = []
    with Monitor(tmp_path, rank=0, world_size=1, log_every=2, system_stats=False, tensorboard=False,
                 background=False) as mon:
        monkeypatch.setattr(mon._bar, "draw", lambda step, total, rate, loss: rates.append(rate))
        mon.start(total_steps=4)
        mon.record_step(1, {"loss": 0.5}, samples=1, step_time=0.01)
        mon.record_step(2, {"loss": 0.5}, samples=1, step_time=0.01)
        time.sleep(0.3)  # an evaluation of 0.3 s
        mon.record_eval(2, {"loss": 0.4}, {"loss": 0.4}, seconds=0.3)
        mon.record_step(3, {"loss": 0.5}, samples=1, step_time=0.01)
        mon.record_step(4, {"loss": 0.5}, samples=1, step_time=0.01)
    assert rates[-1] > 20, rates  # 2 steps in a few milliseconds, not in the 0.3 s of the evaluation


def test_progress_without_a_terminal_is_one_plain_line_per_log_step(tmp_path, capsys):
    """stderr to a file or a pipe (capsys is neither a terminal): no carriage returns, no bar redrawn, each
    log step once, the end drawn once (a trial's log had every step's bar three times in fragments)."""
    with Monitor(tmp_path, rank=0, world_size=1, log_every=5, system_stats=False, tensorboard=False) as mon:
        mon.start(total_steps=12)
        for step in range(1, 13):
            mon.record_step(step, {"loss": 0.5}, samples=1, step_time=0.01)
        mon.end_progress()
    err = capsys.readouterr().err
    assert "\r" not in err, repr(err)
    lines = err.splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 0/12 (0%)", "step 5/12 (42%)", "step 10/12 (83%)",
                                                       "step 12/12 (100%)"], lines
    assert "steps/s" in lines[1] and "ETA" in lines[2] and lines[2].endswith("loss 0.5"), lines


def test_progress_of_a_resumed_run_starts_at_its_step_and_its_eta_counts_from_there(tmp_path, capsys,
                                                                                   monkeypatch):
    """A run resumed at step 80 of 200 drew ``step 0/200 (0%)`` and then, at step 90, an ETA as if 90
    steps had been trained since the start (00:03 where 110 steps at 10 s per 10 steps take 01:50)."""
    import distributed_training.monitor.progress as progress

    clock = [1000.0]
    monkeypatch.setattr(progress, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    with Monitor(tmp_path, rank=0, world_size=1, log_every=10, system_stats=False, tensorboard=False) as mon:
        mon.start(total_steps=200, step=80)
        for step in range(81, 101):
            clock[0] += 1.0  # one second a step
            mon.record_step(step, {"loss": 0.5}, samples=1, step_time=0.01)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 80/200 (40%)", "step 90/200 (45%)",
                                                       "step 100/200 (50%)"], lines
    assert "ETA 01:50" in lines[1] and "ETA 01:40" in lines[2], lines
    with pytest.raises(ValueError, match="step"):
        Monitor(tmp_path, rank=0, world_size=1, system_stats=False, tensorboard=False).start(10, step=-1)


def resumed_progress_worker(rank, world, ckpt, logs):
    import io

    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from distributed_training import DistributedTrainer

    from _models import MLP

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
    make = lambda: DistributedTrainer(MLP(), lambda ps: torch.optim.SGD(ps, lr=0.1), checkpoint_dir=ckpt,  # noqa: E731
                                      log_dir=logs, log_every=5)
    trainer = make()
    trainer.fit(data, epochs=1, criterion=F.cross_entropy, batch_size=4, max_steps=10)
    trainer.close()
    stderr, sys.stderr = sys.stderr, io.StringIO()  # the bar draws on the stderr of its construction
    try:
        trainer = make()
        trainer.fit(data, epochs=1, criterion=F.cross_entropy, batch_size=4, max_steps=15)
        trainer.close()
        return sys.stderr.getvalue()
    finally:
        sys.stderr = stderr


def test_fit_resumed_from_a_checkpoint_starts_its_progress_at_the_resumed_step(tmp_path):
    """dtrain resumed at step 80 of 200 printed ``step 0/200 (0%)`` (and a wrong ETA from it)."""
    err = run_distributed(resumed_progress_worker, 1, args=(str(tmp_path / "ckpt"), str(tmp_path / "logs")),
                          timeout=120)[0]
    bar = [line.split(" |")[0] for line in err.splitlines() if line.startswith("step ") and "/" in line]
    assert bar[:2] == ["step 10/15 (67%)", "step 15/15 (100%)"], err


def test_end_progress_closes_the_bar_line_at_the_last_step_and_a_new_start_redraws(tmp_path, capsys):
    """After fit, what the script prints must start on its own line, and the bar shows where training
    stopped even between log steps (a stop at step 7 with log_every=5)."""
    with Monitor(tmp_path, rank=0, world_size=1, log_every=5, system_stats=False, tensorboard=False) as mon:
        mon.start(total_steps=10)
        for step in range(1, 8):
            mon.record_step(step, {"loss": 0.5}, samples=1, step_time=0.01)
        mon.end_progress()
        first = capsys.readouterr().err
        assert first.endswith("\n") and "step 7/10" in first.rsplit("\r", 1)[-1], repr(first[-200:])
        print("the script's own line")
        mon.start(total_steps=12)  # a second fit
        mon.record_step(10, {"loss": 0.4}, samples=1, step_time=0.01)
        mon.end_progress()
    out = capsys.readouterr()
    assert out.out == "the script's own line\n" and "step 10/12" in out.err, out
    assert "step" not in capsys.readouterr().err  # close() after end_progress draws nothing more


def test_null_monitor_has_the_same_methods_and_does_nothing(tmp_path):
    public = lambda cls: {n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))}
    assert public(NullMonitor) == public(Monitor)
    with NullMonitor(tmp_path, rank=0, world_size=1) as mon:
        mon.start(total_steps=3)
        for step in range(1, 4):
            mon.record_step(step, {"loss": 1.0}, samples=1, step_time=0.1)
        assert mon.get_performance_metrics() == {}
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ (e) bad arguments
@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"log_every": 0}, "log_every"),
        ({"log_every": -3}, "log_every"),
        ({"log_every": 2.5}, "log_every"),
        ({"straggler_threshold": 1.0}, "straggler_threshold"),
        ({"straggler_threshold": 0.5}, "straggler_threshold"),
        ({"straggler_threshold": float("nan")}, "straggler_threshold"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"rank": -1}, "rank"),
        ({"world_size": 0}, "world_size"),
        ({"tensorboard": "yes"}, "tensorboard"),
        ({"background": "yes"}, "background"),
    ],
)
def test_bad_arguments_name_the_field(tmp_path, kwargs, field):
    args = {"rank": 0, "world_size": 1, **kwargs}
    with pytest.raises(ValueError, match=field):
        Monitor(tmp_path, **args)


def test_bad_total_steps(tmp_path):
    with Monitor(tmp_path, rank=0, world_size=1, system_stats=False, tensorboard=False, progress=False) as mon:
        with pytest.raises(ValueError, match="total_steps"):
            mon.start(total_steps=-1)


# ------------------------------------------------------------------ (b) system figures
def assert_host_only(stats: dict) -> None:
    assert set(stats) == {"system/cpu_pct", "system/rss_gib"}, stats
    assert stats["system/cpu_pct"] >= 0 and 0 < stats["system/rss_gib"] < 1024


def test_system_stats_without_nvml_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` now fails
    with SystemStats(device=0) as stats:
        assert_host_only(stats.read())
        assert_host_only(stats.read())


def test_system_stats_without_gpu(monkeypatch):
    # Without CUDA in this process and no device named, NVML is not even asked.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    with SystemStats() as stats:
        assert_host_only(stats.read())


class FakeNVMLError(Exception):
    pass


def fake_nvml(*, init_fails=False, failing=()):
    """A stand-in `pynvml` module recording the handles asked for."""
    calls = []

    def maybe_fail(name):
        calls.append(name)
        if name in failing:
            raise FakeNVMLError(name)

    def init():
        if init_fails:
            raise FakeNVMLError("NVML Shared Library Not Found")

    def by_index(i):
        maybe_fail("index")
        return ("index", i)

    def by_uuid(u):
        maybe_fail("uuid")
        return ("uuid", u)

    def util(h):
        maybe_fail("util")
        return types.SimpleNamespace(gpu=87, memory=40)

    def mem(h):
        maybe_fail("mem")
        return types.SimpleNamespace(used=3 << 30, total=80 << 30, free=77 << 30)

    def power(h):
        maybe_fail("power")
        return 312_500  # milliwatts

    def temp(h, sensor):
        maybe_fail("temp")
        return 61

    module = types.SimpleNamespace(
        NVMLError=FakeNVMLError, NVML_TEMPERATURE_GPU=0, nvmlInit=init, nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByIndex=by_index, nvmlDeviceGetHandleByUUID=by_uuid,
        nvmlDeviceGetUtilizationRates=util, nvmlDeviceGetMemoryInfo=mem, nvmlDeviceGetPowerUsage=power,
        nvmlDeviceGetTemperature=temp,
    )
    return module, calls


@pytest.fixture
def no_torch_cuda(monkeypatch):
    # Resolve devices through CUDA_VISIBLE_DEVICES, as when torch cannot name the UUID.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)


def test_system_stats_nvml_init_error(monkeypatch, no_torch_cuda):
    module, _ = fake_nvml(init_fails=True)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    with SystemStats(device=0) as stats:
        assert_host_only(stats.read())


def test_system_stats_reads_and_converts_gpu_figures(monkeypatch, no_torch_cuda):
    module, calls = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    stats = SystemStats(device=1)
    out = stats.read()
    assert out["system/gpu_util_pct"] == 87.0
    assert out["system/gpu_mem_used_gib"] == pytest.approx(3.0)
    assert out["system/gpu_mem_total_gib"] == pytest.approx(80.0)
    assert out["system/gpu_power_w"] == pytest.approx(312.5)
    assert out["system/gpu_temp_c"] == 61.0
    assert "system/cpu_pct" in out and "system/rss_gib" in out
    assert calls[0] == "index"
    stats.close()
    stats.close()
    assert calls.count("shutdown") == 1


def test_system_stats_maps_through_cuda_visible_devices(monkeypatch, no_torch_cuda):
    seen = []
    module, _ = fake_nvml()
    module.nvmlDeviceGetHandleByIndex = lambda i: seen.append(("index", i)) or ("index", i)
    module.nvmlDeviceGetHandleByUUID = lambda u: seen.append(("uuid", u)) or ("uuid", u)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,2")
    SystemStats(device=1).read()
    assert seen == [("index", 2)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")
    SystemStats(device=torch.device("cuda", 1)).read()
    assert seen[-1] == ("uuid", "GPU-bbbb")
    # An ordinal this process cannot see: no GPU figures, no error.
    assert_host_only(SystemStats(device=2).read())


def test_system_stats_skips_only_the_failing_query(monkeypatch, no_torch_cuda):
    module, _ = fake_nvml(failing=("power",))
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    out = SystemStats(device=0).read()
    assert "system/gpu_power_w" not in out
    assert {"system/gpu_util_pct", "system/gpu_mem_used_gib", "system/gpu_temp_c"} <= set(out)
    # A failing handle lookup drops every GPU figure.
    module, _ = fake_nvml(failing=("index",))
    monkeypatch.setitem(sys.modules, "pynvml", module)
    assert_host_only(SystemStats(device=0).read())


def test_monitor_without_nvml_logs_host_figures(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with Monitor(tmp_path, rank=0, world_size=1, log_every=1, progress=False, tensorboard=False) as mon:
        mon.record_step(1, {"loss": 1.0}, samples=1, step_time=0.1)
    (line,) = read_jsonl(str(tmp_path / "rank_0"))
    assert "system/cpu_pct" in line and "system/rss_gib" in line
    assert not any(k.startswith("system/gpu") for k in line)


# ------------------------------------------------------------------ (c) the plot command
def write_fake_run(log_dir, ranks=2, with_comm=True):
    for rank in range(ranks):
        d = log_dir / f"rank_{rank}"
        d.mkdir(parents=True)
        with open(d / "metrics.jsonl", "w") as f:
            for step in range(10, 110, 10):
                rec = {"step": step, "time": 1.7e9 + step, "rank": rank, "train/loss": 3.0 / step + rank,
                       "perf/samples_per_s": 100.0 + rank, "perf/step_time_s": 0.1}
                if with_comm:
                    rec["perf/exposed_comm_pct"] = 5.0 + rank
                f.write(json.dumps(rec) + "\n")
            f.write('{"step": 110, "train/lo')  # a line still being written


def test_plot_writes_png(tmp_path):
    from distributed_training.monitor import plot

    write_fake_run(tmp_path / "run")
    out = tmp_path / "run.png"
    assert plot.main([str(tmp_path / "run"), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    runs = plot.load_run(tmp_path / "run")
    assert sorted(runs) == [0, 1] and len(runs[0]) == 10


def test_plot_command_line_and_missing_panel(tmp_path, warm_python):
    write_fake_run(tmp_path / "run", with_comm=False)
    out = tmp_path / "run.png"
    proc = warm_python(["-m", "distributed_training.monitor.plot", str(tmp_path / "run"), "-o", str(out)], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "perf/exposed_comm_pct" not in proc.stdout and "train/loss" in proc.stdout
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_plot_empty_directory_fails_cleanly(tmp_path):
    from distributed_training.monitor import plot

    assert plot.main([str(tmp_path), "-o", str(tmp_path / "x.png")]) == 2
    assert not (tmp_path / "x.png").exists()


def test_plot_to_a_folder_that_does_not_exist_fails_cleanly(tmp_path, capsys):
    """`-o missing/run.png` ended in matplotlib's and PIL's traceback; now one line naming the file."""
    from distributed_training.monitor import plot

    write_fake_run(tmp_path / "run")
    out = tmp_path / "missing" / "run.png"
    assert plot.main([str(tmp_path / "run"), "-o", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"error: cannot write {str(out)!r}: No such file or directory"


def test_plot_of_a_real_monitor_run(tmp_path):
    from distributed_training.monitor import plot

    with Monitor(tmp_path / "run", rank=0, world_size=1, log_every=2, progress=False, tensorboard=False) as mon:
        for step in range(1, 11):
            mon.record_step(step, {"loss": torch.tensor(1.0 / step)}, samples=4, step_time=0.02, comm_time=0.002)
    out = tmp_path / "run.png"
    assert plot.main([str(tmp_path / "run"), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC


# ------------------------------------------------------------------ (d) cost per step
def time_calls(mon: Monitor, first_step: int, calls: int, metrics: dict) -> float:
    """Mean seconds per record_step over `calls` consecutive steps."""
    t0 = time.perf_counter()
    for step in range(first_step, first_step + calls):
        mon.record_step(step, metrics, samples=32, tokens=32 * 1024, step_time=0.1, data_time=0.01, comm_time=0.005)
    return (time.perf_counter() - t0) / calls


def test_record_step_overhead(tmp_path):
    calls = 2000
    metrics = {"loss": torch.tensor(2.5), "lr": torch.tensor(3e-4), "grad_norm": torch.tensor(1.1)}

    # Non-log steps only: log_every larger than any step recorded.
    with Monitor(tmp_path / "quiet", rank=0, world_size=1, log_every=10**9, progress=False) as mon:
        time_calls(mon, 1, 200, metrics)  # warm up
        non_log = min(time_calls(mon, 1000 + k * calls, calls, metrics) for k in range(3))

    # log_every=10, with TensorBoard, JSONL and system figures: the amortised cost per step.
    with Monitor(tmp_path / "logging", rank=0, world_size=1, log_every=10, progress=False) as mon:
        time_calls(mon, 1, 100, metrics)
        amortised = min(time_calls(mon, 1000 + k * calls, calls, metrics) for k in range(3))

    print(f"\nrecord_step: {non_log * 1e6:.2f} us per non-log step; "
          f"{amortised * 1e6:.1f} us per step amortised at log_every=10 "
          f"(~{(amortised * 10 - non_log * 9) * 1e3:.2f} ms per log step) with tensorboard+jsonl+system stats")
    assert non_log < 50e-6, f"non-log record_step costs {non_log * 1e6:.1f} us"
    assert amortised < non_log * 10 + 5e-3  # sanity: a log step must not cost tens of milliseconds on CPU


# ------------------------------------------------------------------ (d') off the training thread
def test_writer_thread_writes_log_steps_and_hands_back_its_error(tmp_path):
    """background=True: log records are written by the writer thread, complete once the monitor is
    asked for its figures (or closed); an error of the writer is raised on the training thread."""
    mon = Monitor(tmp_path, rank=0, world_size=1, log_every=2, progress=False, system_stats=False, background=True)
    for step in range(1, 4):
        mon.record_step(step, {"loss": torch.tensor(1.0 / step), "lr": 0.1}, samples=2, step_time=0.5)
    assert mon._thread is not None and mon._thread.name == "monitor-writer-rank0"
    assert mon.get_performance_metrics()["steps"] == 3  # waits for the writer
    (line,) = read_jsonl(str(tmp_path / "rank_0"))
    assert line["step"] == 2 and line["train/loss"] == float(torch.tensor(0.5)) and line["train/lr"] == 0.1
    assert line["perf/samples_per_s"] == pytest.approx(4.0)

    def broken(text):
        raise OSError(28, "No space left on device")

    mon._jsonl.write = broken
    mon.record_step(4, {"loss": 0.25}, samples=2, step_time=0.5)  # handed over; the writer fails on it
    with pytest.raises(RuntimeError, match="could not write its log under .*rank_0.*No space left"):
        mon.get_performance_metrics()
    mon.close()
    assert [line["step"] for line in read_jsonl(str(tmp_path / "rank_0"))] == [2]
    assert not mon._thread and mon._closed


def test_writer_thread_finishes_when_a_script_exits_without_close(tmp_path, warm_python):
    code = ("import torch\n"
            "from distributed_training.monitor import Monitor\n"
            f"mon = Monitor({str(tmp_path)!r}, rank=0, world_size=1, log_every=2, progress=False, tensorboard=False,\n"
            "              system_stats=False, background=True)\n"
            "for step in range(1, 5):\n"
            "    mon.record_step(step, {'loss': torch.tensor(float(step))}, samples=1, step_time=0.1)\n")
    proc = warm_python(["-c", code], timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr
    assert [(line["step"], line["train/loss"]) for line in read_jsonl(str(tmp_path / "rank_0"))] == [(2, 2.0), (4, 4.0)]


# What reads a tensor's value (on a GPU: waits for the device), and the collectives torch.distributed
# offers; counted while the trainer hands a step to the monitor.
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
               "broadcast", "broadcast_object_list", "barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv")
MONITOR_LOG_EVERY, MONITOR_STEPS = 3, 8


def monitor_calls_worker(rank: int, world: int, log_dir: str) -> dict:
    import contextlib
    import threading
    from unittest import mock

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset
    from torch.utils.tensorboard import SummaryWriter

    import distributed_training.monitor.monitor as monitor_module
    from distributed_training import DistributedTrainer

    from _models import MLP

    torch.manual_seed(0)
    trainer = DistributedTrainer(MLP(), lambda ps: torch.optim.SGD(ps, lr=0.01), log_dir=log_dir,
                                 log_every=MONITOR_LOG_EVERY, progress=False)
    calls: list[str] = []
    inside = threading.local()
    main = threading.get_ident()

    def counted(label, fn):
        def wrapper(*args, **kwargs):
            if getattr(inside, "on", False) and threading.get_ident() == main:
                calls.append(label)
            return fn(*args, **kwargs)
        return wrapper

    targets = [(torch.Tensor, name, f"read:{name}") for name in READS]
    targets += [(torch.cuda, "synchronize", "sync:cuda.synchronize"),
                (torch.cuda.Event, "synchronize", "sync:Event.synchronize"),
                (torch.cuda.Event, "query", "sync:Event.query"),
                (torch.cuda.Stream, "synchronize", "sync:Stream.synchronize"),
                (monitor_module, "all_gather_single", "collective:all_gather_single"),
                (SystemStats, "read", "work:SystemStats.read"),
                (SummaryWriter, "add_scalar", "work:add_scalar")]
    targets += [(dist, name, f"collective:{name}") for name in COLLECTIVES if hasattr(dist, name)]
    per_step: dict[int, list[str]] = {}
    record = trainer._record_step

    def watched(*args, **kwargs):
        calls.clear()
        inside.on = True
        try:
            return record(*args, **kwargs)
        finally:
            inside.on = False
            per_step[trainer.step] = sorted(set(calls))

    trainer._record_step = watched
    g = torch.Generator().manual_seed(rank)
    data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g))
    with contextlib.ExitStack() as stack:
        for owner, name, label in targets:
            stack.enter_context(mock.patch.object(owner, name, counted(label, getattr(owner, name))))
        trainer.fit(data, epochs=1, criterion=F.mse_loss, batch_size=2, max_steps=MONITOR_STEPS)
    trainer.close()
    return per_step


def test_trainer_monitor_reads_nothing_and_talks_to_no_rank_between_log_steps(tmp_path):
    """With log_dir set, what the trainer does for the monitor on a step that is not a logging step
    reads no tensor (on a GPU, each read waits for the device), runs no collective, reads no system
    figure and writes nothing. Logging steps do all of that, which shows the counting works."""
    per_rank = run_distributed(monitor_calls_worker, 2, args=(str(tmp_path),), timeout=180)
    for rank, per_step in enumerate(per_rank):
        assert sorted(per_step) == list(range(1, MONITOR_STEPS + 1)), per_step
        for step, calls in per_step.items():
            if step % MONITOR_LOG_EVERY:
                assert calls == [], (rank, step, calls)
            else:
                assert {"collective:all_gather_single", "read:tolist", "read:__float__", "work:SystemStats.read",
                        "work:add_scalar"} <= set(calls), (rank, step, calls)


# ------------------------------------------------------------------ (f) GPU: NVML figures in the event file
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nvml_metrics_in_event_files(tmp_path):
    x = torch.randn(2048, 2048, device="cuda")
    with Monitor(tmp_path, rank=0, world_size=1, log_every=2, progress=False) as mon:
        for step in range(1, 7):
            y = x @ x
            torch.cuda.synchronize()
            mon.record_step(step, {"loss": y.mean()}, samples=1, step_time=0.01)
    scalars = event_scalars(str(tmp_path / "rank_0"))
    for tag in GPU_KEYS:
        assert tag in scalars, (tag, sorted(scalars))
        assert [s for s, _ in scalars[tag]] == [2, 4, 6]
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
    mem_total = [v for _, v in scalars["system/gpu_mem_total_gib"]]
    assert mem_total[0] == pytest.approx(total, rel=0.05)
    assert all(0 <= v <= 100 for _, v in scalars["system/gpu_util_pct"])
    assert all(0 < v < 2000 for _, v in scalars["system/gpu_power_w"])
    assert all(0 < v < 120 for _, v in scalars["system/gpu_temp_c"])
    assert all(0 < v <= total * 1.05 for _, v in scalars["system/gpu_mem_used_gib"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_log_steps_do_not_wait_for_the_gpu(tmp_path):
    """With a long kernel queued, a log step's record_step returns long before the GPU is done, and the
    records still hold the exact values of the metric tensors (fp32, bf16, int) of their step."""
    x = torch.randn(1024, 1024, device="cuda")
    kept, took = {}, []
    with Monitor(tmp_path, rank=0, world_size=1, log_every=2, progress=False) as mon:
        for step in range(1, 9):
            loss = (x @ x).mean() + step
            metrics = {"loss": loss, "grad_norm": loss.to(torch.bfloat16), "count": torch.tensor(step, device="cuda")}
            torch.cuda._sleep(int(1e9))  # about half a second of GPU time, queued behind the metrics
            t0 = time.perf_counter()
            mon.record_step(step, metrics, samples=1, step_time=0.01)
            if step % 2 == 0:
                took.append(time.perf_counter() - t0)
                kept[step] = metrics
        torch.cuda.synchronize()
    assert max(took[1:]) < 0.1, took  # the first may set up NVML's and pinned memory's first use
    lines = read_jsonl(str(tmp_path / "rank_0"))
    assert [line["step"] for line in lines] == [2, 4, 6, 8]
    for line in lines:
        m = kept[line["step"]]
        assert line["train/loss"] == float(m["loss"]) and line["train/grad_norm"] == float(m["grad_norm"])
        assert line["train/count"] == line["step"]


def nccl_worker(rank: int, world: int, log_dir: str) -> dict:
    from distributed_training import init_distributed

    ctx = init_distributed()  # joins the harness's NCCL group and sets this rank's GPU
    x = torch.randn(1024, 1024, device=ctx.device)
    with Monitor(log_dir, rank=rank, world_size=world, log_every=2, progress=False) as mon:
        assert mon._gather_out.device == ctx.device  # NCCL needs the all-gather's tensors on the GPU
        for step in range(1, 5):
            loss = (x @ x).mean()
            mon.record_step(step, {"loss": loss}, samples=4, step_time=0.01 * (1 + 2 * rank))
        perf = mon.get_performance_metrics()
    stats = SystemStats().read()
    return {"perf": perf, "gpu_keys": sorted(k for k in stats if k.startswith("system/gpu"))}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_cluster_view_over_nccl(tmp_path):
    results = run_distributed(nccl_worker, 2, args=(str(tmp_path),), backend="nccl", timeout=300)
    for res in results:
        assert res["perf"]["cluster_slowest_rank"] == 1 and res["perf"]["cluster_straggler"] is True
        assert res["perf"]["cluster_step_time_max_s"] == pytest.approx(0.03)
        assert set(GPU_KEYS) <= set(res["gpu_keys"])
    assert "cluster/straggler" in event_scalars(str(tmp_path / "rank_0"))
    assert not any(t.startswith("cluster/") for t in event_scalars(str(tmp_path / "rank_1")))


# ------------------------------------------------------------------ (g) re-used log directories, the plot extra
def test_a_resumed_run_continues_its_series(tmp_path):
    """Runs appended to one log directory: the plot's series is the latest run's, steps increasing."""
    from distributed_training.monitor import plot

    def run(first, last, loss):
        with Monitor(tmp_path, rank=0, world_size=1, log_every=1, progress=False, tensorboard=False,
                     system_stats=False) as mon:
            for step in range(first, last + 1):
                mon.record_step(step, {"loss": loss(step)}, samples=1, step_time=0.01)

    run(1, 6, lambda s: 10.0 - s)          # crashed after step 6; its last checkpoint was step 4
    run(5, 10, lambda s: 100.0 + s)        # resumed from step 4: logs 5 and 6 again
    records = plot.load_run(tmp_path)[0]
    assert [r["step"] for r in records] == list(range(1, 11))
    assert [r["train/loss"] for r in records] == [10.0 - s for s in range(1, 5)] + [100.0 + s for s in range(5, 11)]
    run(1, 3, lambda s: -s)                # a new run in the same directory replaces the old one
    records = plot.load_run(tmp_path)[0]
    assert [(r["step"], r["train/loss"]) for r in records] == [(1, -1), (2, -2), (3, -3)]


def test_ranks_of_an_earlier_larger_run_do_not_mix_into_a_later_one(tmp_path):
    """A trial: a run of 2 ranks, then `dtrain --no-resume` at 1 rank in the same log dir: the plot drew
    the old run's rank 1 beside the new run's rank 0 ("2 rank(s)")."""
    from distributed_training.monitor import plot

    clock = [1000.0]

    def run(world, first, last):  # each run a minute after the one before; its ranks log each step together
        clock[0] += 60
        for step in range(first, last + 1):
            clock[0] += 1
            for rank in range(world):
                os.makedirs(tmp_path / f"rank_{rank}", exist_ok=True)
                with open(tmp_path / f"rank_{rank}" / "metrics.jsonl", "a") as f:
                    # rank 1 may log a step a little before rank 0: still the same run
                    f.write(json.dumps({"step": step, "time": clock[0] - 0.5 * rank, "rank": rank}) + "\n")

    def steps():
        return {k: [r["step"] for r in v] for k, v in plot.load_run(tmp_path).items()}

    run(2, 1, 8)
    run(2, 1, 2)   # a new run at the same size: both ranks' records replaced
    assert steps() == {0: [1, 2], 1: [1, 2]}
    run(2, 3, 8)   # it goes on to step 8
    run(1, 6, 9)   # resumed from step 5 at one rank: rank 1 keeps steps 1-5, which the later run did not redo
    assert steps() == {0: list(range(1, 10)), 1: [1, 2, 3, 4, 5]}
    run(1, 1, 3)   # a new run at one rank: rank 1 is gone
    assert steps() == {0: [1, 2, 3]}
    run(2, 1, 2)   # and back at two ranks
    assert steps() == {0: [1, 2], 1: [1, 2]}


def test_plot_without_matplotlib_names_the_extra(tmp_path, warm_python):
    write_fake_run(tmp_path / "run")
    code = ("import sys; sys.modules['matplotlib'] = None\n"  # as if it were not installed
            "from distributed_training.monitor.plot import main\n"
            f"sys.exit(main([{str(tmp_path / 'run')!r}, '-o', {str(tmp_path / 'x.png')!r}]))")
    proc = warm_python(["-c", code], timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "matplotlib" in proc.stderr and 'pip install -e ".[plot]"' in proc.stderr, proc.stderr
    assert not (tmp_path / "x.png").exists()


def test_workers_are_labelled_workers(tmp_path, capsys):
    """A parameter server's workers (``member="worker"``): their index, not a rank, in the straggler message,
    the JSONL records and the plot's labels; a bad `member` is refused by name."""
    from distributed_training.monitor import plot

    with pytest.raises(ValueError, match="member"):
        Monitor(tmp_path / "bad", rank=0, world_size=1, member="server")
    with Monitor(tmp_path / "run", rank=0, world_size=1, log_every=2, progress=False, tensorboard=False,
                 member="worker") as mon:
        for step in range(1, 5):
            mon.record_step(step, {"loss": torch.tensor(1.0 / step)}, samples=4, step_time=0.02)
        mon._group_ranks = [1, 2]  # the workers' group: worker w is global rank 1 + w
        mon._cluster_view(2, [0.1, -1.0, 0.3, -1.0])  # (step time, own time or -1) per worker
        assert not mon._warnings  # (flagged once: said when flagged in the next window too)
        mon._cluster_view(4, [0.1, -1.0, 0.3, -1.0])
        assert mon._warnings[-1].startswith("straggler at step 4: worker 1 averages 0.3 s"), mon._warnings
        assert "the median worker's" in mon._warnings[-1]
        mon._warnings.clear()
    assert all(r["member"] == "worker" for r in read_jsonl(str(tmp_path / "run" / "rank_0")))
    runs = plot.load_run(tmp_path / "run")
    assert plot.member_of(runs) == "worker"
    assert plot.main([str(tmp_path / "run"), "-o", str(tmp_path / "run.png")]) == 0
    assert "(1 worker(s);" in capsys.readouterr().out
    write_fake_run(tmp_path / "ranks")  # records without "member": ranks, as before
    assert plot.member_of(plot.load_run(tmp_path / "ranks")) == "rank"
