"""SIGTERM and SIGINT during `fit`: every rank stops at the same step within seconds, SIGTERM saves a
checkpoint there first, nothing half-written is left, and the resumed run equals an unbroken one."""

from __future__ import annotations

import glob
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from distributed_training import DistributedTrainer
from distributed_training.checkpoint import CheckpointManager
from distributed_training.testing import TorchrunJob, run_distributed

import _forked_torchrun
from _models import job_main, sgd_momentum, tiny_gpt, tiny_gpt_data

REPO = Path(__file__).resolve().parents[1]
JOB = str(REPO / "tests" / "jobs" / "signal_job.py")


def _tmp_files(directory) -> list[str]:
    return glob.glob(os.path.join(str(directory), "**", "*.tmp.*"), recursive=True)


# ------------------------------------------------------------------ under torchrun
@pytest.fixture
def torchrun_job():
    """Start tests/jobs/signal_job.py under torchrun with two workers (in a session of their own, so
    that a signal to torchrun is what a scheduler sends); every job is killed and removed afterwards.
    The launcher is forked from the warm fork server (`_forked_torchrun`: no fresh interpreter importing
    torch before the workers start); it is torchrun all the same, its signal handling and forwarding
    included, and its workers are torchrun's fresh processes."""
    jobs: list[TorchrunJob] = []

    def start(args: list[str]) -> TorchrunJob:
        jobs.append(_forked_torchrun.start(JOB, args, nproc=2, cwd=REPO,
                                           env={"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}))
        return jobs[-1]

    yield start
    for job in jobs:
        job.close()


def _wait(job: TorchrunJob, timeout: float) -> float:
    """Seconds until the job ended (it fails, killed, after `timeout`)."""
    started = time.monotonic()
    job.wait(timeout)
    return time.monotonic() - started


def _wait_for(predicate, job: TorchrunJob, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if job.poll() is not None:
            raise AssertionError(f"the job ended before it could be signalled:\n{job.output()[-4000:]}")
        if time.monotonic() > deadline:
            job.kill()
            raise AssertionError(f"the job did not get there within {timeout}s:\n{job.output()[-4000:]}")
        time.sleep(0.05)


def _progress(out: Path) -> int:
    try:
        return int((out / "progress").read_text())
    except (OSError, ValueError):
        return 0


def _trajectory(out: Path, n: int) -> dict:
    return torch.load(out / f"trajectory_{n}.pt", map_location="cpu", weights_only=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_sigterm_stops_saves_and_the_resumed_run_equals_an_unbroken_one(tmp_path, strategy, torchrun_job):
    base = ["--strategy", strategy]
    # The unbroken reference and the resumed run: the same job's main() on 2 ranks forked from a warm
    # interpreter (no torchrun processes to start: neither is signalled); the stopped run below is torchrun's,
    # signalled as a scheduler does, and the resumed one picks up the checkpoint it saved on the way out.
    run_distributed(job_main, 2, args=("signal_job", base + ["--ckpt", str(tmp_path / "clean"), "--out",
                                                            str(tmp_path / "clean_out")]), timeout=300)
    unbroken = _trajectory(tmp_path / "clean_out", 0)
    assert unbroken["step"] == 24, unbroken["step"]

    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    # No periodic checkpoints (every 100 steps): the only one can come from the stop.
    job = torchrun_job(base + ["--ckpt", str(ckpt), "--out", str(out), "--every", "100", "--step-sleep", "0.3"])
    _wait_for(lambda: _progress(out) >= 6, job)
    job.signal(signal.SIGTERM)  # what Kubernetes does to the pod's main process: torchrun forwards it
    elapsed = _wait(job, 60)
    log = job.output()
    stopped = _trajectory(out, 0)["step"]
    assert elapsed < 10, f"took {elapsed:.1f}s to stop:\n{log[-3000:]}"
    assert "forcefully exiting" not in log, log[-3000:]  # torchrun never had to SIGKILL a worker
    assert 6 <= stopped < 24, (stopped, log[-3000:])
    assert sorted(os.listdir(ckpt)) == [f"step_{stopped:09d}"], os.listdir(ckpt)
    assert f"stopping at step {stopped} on SIGTERM" in log, log[-3000:]
    found = CheckpointManager(str(ckpt)).latest_good()
    assert found is not None and found[1]["step"] == stopped, "the checkpoint must be at the step where it stopped"
    assert not _tmp_files(ckpt), _tmp_files(ckpt)

    run_distributed(job_main, 2, args=("signal_job", base + ["--ckpt", str(ckpt), "--out", str(out), "--every", "100"]),
                    timeout=300)
    after = _trajectory(out, 1)
    assert after["step"] == 24 and sorted(after["trajectory"]) == list(range(stopped + 1, 25))
    for step, state in after["trajectory"].items():
        for key, value in unbroken["trajectory"][step].items():
            assert torch.equal(value, state[key]), f"step {step}: {key} differs from the unbroken run"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigint_during_a_slow_checkpoint_write_exits_within_seconds_and_leaves_no_tmp(tmp_path, torchrun_job):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    job = torchrun_job(["--ckpt", str(ckpt), "--out", str(out), "--step-sleep", "0.1", "--slow-fsync-from", "8",
                        "--fsync-sleep", "1.0"])
    _wait_for(lambda: (out / "writing").exists(), job)
    job.signal(signal.SIGINT, group=True)  # Ctrl-C in a terminal: the whole foreground process group
    elapsed = _wait(job, 60)
    log = job.output()
    assert elapsed < 15, f"took {elapsed:.1f}s to stop:\n{log[-3000:]}"
    assert "forcefully exiting" not in log, log[-3000:]
    assert not _tmp_files(ckpt), _tmp_files(ckpt)
    stopped = _trajectory(out, 0)["step"]
    assert 8 <= stopped < 24, (stopped, log[-3000:])
    assert f"stopping at step {stopped} on SIGINT" in log, log[-3000:]
    assert CheckpointManager.verify(str(ckpt / "step_000000004"))["step"] == 4  # the previous one is intact
    found = CheckpointManager(str(ckpt)).latest_good()
    assert found is not None and found[1]["step"] in (4, 8), found  # the write in progress was finished, or not


# ------------------------------------------------------------------ a signal that reaches one rank only


def one_rank_signalled_worker(rank, world, directory, strategy):
    own_calls = []

    def own_handler(signum, frame):
        own_calls.append(signum)

    if rank == 0:  # rank 0's script has its own SIGTERM handler: fit must hand the signal on to it
        signal.signal(signal.SIGTERM, own_handler)
    torch.manual_seed(0)
    trainer = DistributedTrainer(tiny_gpt(dropout=0.1), sgd_momentum, strategy=strategy, checkpoint_dir=directory, checkpoint_every=100)
    sent = {}

    def on_step(step, metrics):
        if rank == 1 and step == 3:
            sent["at"] = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)  # only rank 1 is told

    outcome = "returned"
    try:
        trainer.fit(tiny_gpt_data(), epochs=3, batch_size=3, log_every=1, on_step=on_step)
    except SystemExit as stop:
        outcome = f"SystemExit({stop.code})"
    elapsed = time.monotonic() - sent["at"] if sent else None
    handler = signal.getsignal(signal.SIGTERM)
    restored = handler is own_handler if rank == 0 else handler == signal.SIG_DFL
    step = trainer.step
    trainer.close()
    return outcome, step, elapsed, own_calls, restored


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_a_signal_reaching_one_rank_stops_every_rank_at_the_same_step(tmp_path, strategy):
    directory = str(tmp_path / "ckpt")
    (out0, step0, _, calls0, restored0), (out1, step1, elapsed, calls1, restored1) = run_distributed(
        one_rank_signalled_worker, 2, args=(directory, strategy), timeout=120, collective_timeout=60)
    assert step0 == step1 and 3 <= step1 <= 5, (step0, step1)  # the same step, one or two after the signal
    assert out1 == "SystemExit(143)" and out0 == "returned", (out0, out1)
    assert calls0 == [signal.SIGTERM] and calls1 == []  # rank 0's own handler got the agreed signal
    assert restored0 and restored1, "the handlers in place before fit must be back"
    assert elapsed < 5, elapsed
    assert sorted(os.listdir(directory)) == [f"step_{step1:09d}"], os.listdir(directory)  # saved where it stopped
    assert CheckpointManager(directory).latest_good()[1]["step"] == step1
    assert not _tmp_files(directory)


def thread_worker(rank, world, directory):
    results = {}

    def train():
        trainer = DistributedTrainer(tiny_gpt(dropout=0.1), sgd_momentum, checkpoint_dir=directory)
        try:
            trainer.fit(tiny_gpt_data(), epochs=1, batch_size=9, max_steps=2)
            results["step"] = trainer.step
        except BaseException as err:  # noqa: BLE001 - signal.signal outside the main thread raises ValueError
            results["error"] = repr(err)
        finally:
            trainer.close()

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=train)
    thread.start()
    thread.join(120)
    return results, signal.getsignal(signal.SIGTERM) is before


def test_fit_outside_the_main_thread_trains_without_handlers(tmp_path):
    results, untouched = run_distributed(thread_worker, 1, args=(str(tmp_path / "ckpt"),), timeout=120)[0]
    assert results == {"step": 2}, results
    assert untouched


def self_signal_worker(rank, world, directory, sig, save_on_preemption):
    # As from a terminal: a test run started in the background (`cmd &` without job control) ignores
    # SIGINT, the workers inherit that, and fit rightly leaves an ignored signal ignored.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.manual_seed(0)
    trainer = DistributedTrainer(tiny_gpt(dropout=0.1), sgd_momentum, checkpoint_dir=directory, checkpoint_every=2,
                                 save_on_preemption=save_on_preemption)

    def on_step(step, metrics):
        if step == 3:
            os.kill(os.getpid(), sig)

    try:
        trainer.fit(tiny_gpt_data(), epochs=2, batch_size=9, log_every=1, on_step=on_step)
        outcome = "returned"
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
    except SystemExit as stop:
        outcome = f"SystemExit({stop.code})"
    step = trainer.step
    trainer.close()
    return outcome, step, sorted(os.listdir(directory)), repr(inherited)


@pytest.mark.parametrize("sig,save,expected", [(signal.SIGINT, True, "KeyboardInterrupt"),
                                               (signal.SIGTERM, False, "SystemExit(143)")])
def test_sigint_and_unsaved_sigterm_stop_without_writing_a_checkpoint(tmp_path, sig, save, expected):
    directory = str(tmp_path / "ckpt")
    outcome, step, files, inherited = run_distributed(self_signal_worker, 1, args=(directory, sig, save),
                                                      timeout=120)[0]
    # World 1: nobody to agree with, stops at once. (`inherited`: the worker's SIGINT handler before the test
    # set Python's own, for the report.)
    assert outcome == expected and step == 3, (outcome, step, inherited)
    assert files == ["step_000000002"], files  # nothing written for the stop at step 3
