"""One run per checkpoint directory (`distributed_training/checkpoint_lock.py`): a second run started on a
directory another process trains into is refused on every rank before it reads or moves anything (it
used to move the first run's checkpoints aside, with ``resume=False``, or prune them); a run that died
leaves no lock behind; trainers of one process share the lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from torch import nn

from distributed_training import DistributedTrainer
from distributed_training.checkpoint_lock import LOCK_NAME
from distributed_training.testing import run_distributed

HOLDER = """
import os, sys, time
from distributed_training.checkpoint_lock import lock_directory
assert lock_directory(sys.argv[1]) is None
child = os.fork()  # as a DataLoader's worker: it must not keep the lock after the holder dies
if child == 0:
    time.sleep(120)
    os._exit(0)
print("locked", child, flush=True)
time.sleep(120)
"""


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))


def fit_worker(rank, world, directory, resume):
    trainer = DistributedTrainer(nn.Linear(4, 1), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False,
                                 checkpoint_dir=directory, checkpoint_every=2, resume=resume)
    try:
        trainer.fit(_data(), epochs=1, batch_size=4, criterion=nn.functional.mse_loss)
    except Exception as err:
        return type(err).__name__, str(err)
    finally:
        trainer.close()
    return "trained", sorted(os.listdir(directory))


@pytest.fixture
def other_run(tmp_path):
    """A process of another run holding the directory's lock, with a checkpoint of its own there."""
    directory = tmp_path / "ckpt"
    (directory / "step_000000004").mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], stdout=subprocess.PIPE, text=True, env=env)
    said, child = proc.stdout.readline().split()
    try:
        assert said == "locked"
        yield directory, proc
    finally:
        proc.kill()
        proc.wait(timeout=30)
        os.kill(int(child), signal.SIGKILL)


def test_a_second_run_on_a_directory_in_use_is_refused_on_every_rank(other_run):
    directory, proc = other_run
    resume = False  # the worst case: it moved the other run's checkpoints aside
    results = run_distributed(fit_worker, 2, args=(str(directory), resume), timeout=60)
    for kind, said in results:
        assert kind == "CheckpointDirectoryInUseError", said
        assert str(directory) in said and f"pid {proc.pid}" in said and "rank 0 found it" in said, said
    assert sorted(os.listdir(directory)) == [LOCK_NAME, "step_000000004"]  # nothing moved aside or pruned
    # the other run dies without closing (its forked child lives on): the kernel drops its lock, and a run
    # starts there
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    results = run_distributed(fit_worker, 2, args=(str(directory), resume), timeout=60)
    assert all(kind == "trained" for kind, _ in results), results
    assert LOCK_NAME not in os.listdir(directory)  # the holder removed it when it closed


def test_trainers_of_one_process_share_the_lock_and_give_it_back(tmp_path):
    directory = str(tmp_path / "ckpt")
    first = DistributedTrainer(nn.Linear(4, 1), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False,
                               checkpoint_dir=directory, checkpoint_every=2)
    first.fit(_data(), epochs=1, batch_size=4, criterion=nn.functional.mse_loss)
    second = DistributedTrainer(nn.Linear(4, 1), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False,
                                checkpoint_dir=directory, checkpoint_every=2)
    second.fit(_data(), epochs=2, batch_size=4, criterion=nn.functional.mse_loss)  # resumes, in the same process
    assert second.step == 8
    first.close()
    assert LOCK_NAME in os.listdir(directory)  # the second trainer still holds it
    second.close()
    assert LOCK_NAME not in os.listdir(directory)


def test_a_read_only_directory_is_used_without_a_lock(tmp_path, monkeypatch):
    """A finished run's directory on a read-only mount failed with EROFS on the lock file (a new user's
    trial, session 32): nothing can be written there, so there is nothing to guard."""
    import errno

    from distributed_training import checkpoint_lock

    def read_only(path, flags, mode=0o777):
        raise OSError(errno.EROFS, "Read-only file system", path)

    monkeypatch.setattr(checkpoint_lock.os, "open", read_only)
    assert checkpoint_lock.lock_directory(tmp_path) is None and not checkpoint_lock._held
