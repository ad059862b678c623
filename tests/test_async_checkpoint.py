"""Checkpoints written in the background (``checkpoint_async=True``): the files load to exactly what a
synchronous save writes, even while training goes on changing the state during the write; a write that
fails or is killed midway leaves the previous checkpoint as the latest good one, and the error names
the file; resuming from a background checkpoint equals an unbroken run, bit for bit."""

from __future__ import annotations

import logging
import os
import re
import signal
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from distributed_training import DistributedTrainer
from distributed_training.checkpoint import CheckpointManager
from distributed_training.checkpoint_async import CheckpointWriteError
from distributed_training.testing import run_distributed

REPO = Path(__file__).resolve().parents[1]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _data(n=64):
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g))


def _trainer(directory, strategy="ddp", **kwargs):
    torch.manual_seed(0)
    return DistributedTrainer(Net(), lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), strategy=strategy,
                              checkpoint_dir=directory, lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5),
                              progress=False, **kwargs)


def _fit(trainer, max_steps):
    return trainer.fit(_data(), epochs=100, criterion=F.mse_loss, batch_size=8, max_steps=max_steps)


def _slow_writes(seconds):
    """Make every background write take `seconds` more: training runs on while the write is in flight,
    so a snapshot that shared storage with the live state would be written with later values."""
    import distributed_training.trainer_checkpoints_async as tc

    original = tc.atomic_save

    def slow(obj, path):
        time.sleep(seconds)
        return original(obj, path)

    tc.atomic_save = slow


def _same(a, b, where="") -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _files(directory):
    """Every checkpoint under `directory`: {step dir: {file: loaded content}} (meta without checksums)."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if not name.startswith("step_"):
            continue
        path = os.path.join(directory, name)
        CheckpointManager.verify(path)  # complete, and every file matches its checksum
        files = {}
        for f in sorted(os.listdir(path)):
            if f.endswith(".pt"):
                files[f] = torch.load(os.path.join(path, f), weights_only=True)
        files["meta.pt"].pop("checksums")
        out[name] = files
    return out


# ----------------------------------------------------------------- async == sync
def equal_worker(rank, world, base, strategy):
    _slow_writes(0.25)
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("distributed_training").addHandler(handler)
    for mode in ("sync", "async"):
        with _trainer(os.path.join(base, mode), strategy, checkpoint_every=2, keep_last=2,
                      checkpoint_async=mode == "async") as t:
            _fit(t, 7)
    return messages


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_background_checkpoints_equal_synchronous_ones(tmp_path, strategy):
    messages = run_distributed(equal_worker, 2, args=(str(tmp_path), strategy), timeout=180)
    sync, background = _files(tmp_path / "sync"), _files(tmp_path / "async")
    # keep_last=2 pruned in the background too; step 7 is fit's last save (not a multiple of 2).
    assert list(sync) == list(background) == ["step_000000006", "step_000000007"]
    _same(sync, background)
    # Writes take 0.25 s, checkpoints come every 2 steps of a few ms: the next one waited (well over the
    # 0.1 s a wait must last to be warned about), and said so.
    assert any("waited" in m and "raise checkpoint_every" in m for m in messages[0]), messages[0]


def wait_worker(rank, world, base):
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("distributed_training").addHandler(handler)
    said = {}
    for delay in (0.03, 0.4):
        _slow_writes(delay)  # on top of the last one's: the module's atomic_save is wrapped again
        with _trainer(os.path.join(base, str(delay)), checkpoint_every=1, checkpoint_async=True) as t:
            _fit(t, 3)
        said[delay], messages[:] = list(messages), []
    return said


def test_a_negligible_wait_for_the_previous_write_is_not_warned_about(tmp_path):
    """Checkpoints every step of a few ms: writes 0.03 s longer make each checkpoint wait a little for
    the previous one, not worth a warning (it said "waited 0.00 s ... (0.01 s in all)"); writes 0.43 s
    longer are, and "in all" is the previous write's whole duration."""
    said = run_distributed(wait_worker, 1, args=(str(tmp_path),), timeout=120)[0]
    assert not [m for m in said[0.03] if "waited" in m], said[0.03]
    warned = [m for m in said[0.4] if "waited" in m]
    assert warned, said[0.4]
    for m in warned:
        found = re.search(r"waited ([\d.]+) s for the background write of step \d+, which took ([\d.]+) s in all "
                          r"while 1 step\(s\) trained in ([\d.]+) s: .*raise checkpoint_every", m)
        assert found, m
        waited, took, trained = map(float, found.groups())
        assert took >= 0.43 and 0.1 <= waited <= took and trained < took, m


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_background_checkpoints_equal_synchronous_ones_on_nccl(tmp_path, strategy):
    """On CUDA the snapshot goes through pinned buffers copied with non_blocking=True on the current stream:
    the step's later kernels must not reach them before the copies are done."""
    run_distributed(equal_worker, 2, args=(str(tmp_path), strategy), timeout=180, backend="nccl")
    sync, background = _files(tmp_path / "sync"), _files(tmp_path / "async")
    assert list(sync) == list(background) == ["step_000000006", "step_000000007"]
    _same(sync, background)


# ----------------------------------------------------------------- a failed write
def failing_worker(rank, world, base, fail_rank):
    import distributed_training.trainer_checkpoints_async as tc

    original = tc.atomic_save

    def failing(obj, path):
        if rank == fail_rank and "step_000000004" in path:
            raise OSError(28, "No space left on device")
        return original(obj, path)

    tc.atomic_save = failing
    with _trainer(base, checkpoint_every=2, checkpoint_async=True) as t:
        with pytest.raises(CheckpointWriteError) as info:
            _fit(t, 4)  # the failing write is the last: fit waits for it and raises its error
        found = t.latest_checkpoint()
    return str(info.value), found[0]


@pytest.mark.parametrize("fail_rank", [1, 0])
def test_a_failed_background_write_is_reported_and_never_resumed_from(tmp_path, fail_rank):
    results = run_distributed(failing_worker, 2, args=(str(tmp_path), fail_rank), timeout=120)
    for rank, (message, latest) in enumerate(results):
        assert latest.endswith("step_000000002"), latest  # the previous checkpoint is the latest good
        if rank == fail_rank:
            assert f"rank{rank}.pt" in message and "step 4" in message and "No space left" in message, message
    if fail_rank == 1:  # rank 0's meta.pt waited on rank 1 in vain, and says why
        assert "rank 1 failed to write its file" in results[0][0] and "rank1.pt" in results[0][0], results[0][0]
    else:  # rank 1's own write went well: it learns at the end of fit that the checkpoint is not complete
        assert "failed on another rank" in results[1][0] and "step 4" in results[1][0], results[1][0]
    assert not (tmp_path / "step_000000004" / "meta.pt").exists()


def test_a_failed_write_surfaces_at_the_next_step(tmp_path, monkeypatch):
    import distributed_training.trainer_checkpoints_async as tc

    original = tc.atomic_save

    def failing(obj, path):
        if "step_000000002" in path:
            raise OSError(5, "Input/output error")
        return original(obj, path)

    monkeypatch.setattr(tc, "atomic_save", failing)
    with _trainer(str(tmp_path), checkpoint_every=2, checkpoint_async=True) as t:
        with pytest.raises(CheckpointWriteError, match=r"rank0\.pt.*step 2.*Input/output error"):
            _fit(t, 100)
        assert t.step <= 4  # raised by the next step's check, or at the latest by the next checkpoint
        assert t.latest_checkpoint() is None


def test_fit_and_close_wait_for_the_write(tmp_path, monkeypatch):
    import distributed_training.trainer_checkpoints_async as tc

    original = tc.atomic_save
    monkeypatch.setattr(tc, "atomic_save", lambda obj, path: (time.sleep(0.3), original(obj, path))[1])
    with _trainer(str(tmp_path), checkpoint_every=3, checkpoint_async=True) as t:
        _fit(t, 3)
        assert t.latest_checkpoint()[0].endswith("step_000000003")  # fit returned with it complete
        t._save_in_background(t.checkpoints.path_for(99), {})  # a write still in flight at close
    assert CheckpointManager(str(tmp_path)).latest_good()[0].endswith("step_000000099")


def test_checkpoint_async_arguments(tmp_path):
    with pytest.raises(ValueError, match="checkpoint_async needs a checkpoint_dir"):
        _trainer(None, checkpoint_async=True)
    with pytest.raises(TypeError, match="checkpoint_async must be True or False"):
        _trainer(str(tmp_path), checkpoint_async="yes")


# ----------------------------------------------------------------- killed midway, then resumed
_KILLED = textwrap.dedent("""
    import io, os, random, signal, sys, time
    import numpy, torch
    sys.path.insert(0, {tests!r})
    numpy.random.seed(0)  # every RNG a checkpoint holds is the same in every run of this script
    random.seed(0)
    import distributed_training.trainer_checkpoints_async as tc
    from test_async_checkpoint import _trainer, _fit

    where, directory = sys.argv[1], sys.argv[2]
    original_save, original_meta = tc.atomic_save, tc.write_meta
    from distributed_training.checkpoint import atomic_write_bytes as original_write

    def stall(message):
        # The write stops here, half done, and the process dies: SIGKILL (no cleanup, no atexit, the
        # writer thread and training cut wherever they are), as a node lost or the OOM killer would.
        print(message, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)  # never reached

    def write(obj, path):
        if where == "rank_file" and "step_000000004" in path:
            data = io.BytesIO()
            torch.save(obj, data)
            data = data.getvalue()
            with open(path + ".tmp." + str(os.getpid()), "wb") as f:  # half of it, as a write in progress
                f.write(data[: len(data) // 2])
            stall("MIDWAY")
        return original_save(obj, path)

    def write_meta(meta, path):
        if where == "meta" and "step_000000004" in path:
            original_write(b"0" * 64, os.path.join(path, "meta.pt.sha256"))  # the sidecar, then death
            stall("MIDWAY")
        return original_meta(meta, path)

    tc.atomic_save, tc.write_meta = write, write_meta
    with _trainer(directory, checkpoint_every=2, checkpoint_async=True) as t:
        _fit(t, 6)
""")


def _script(warm_python, tmp_path, where, directory, *, stop_at_midway):
    """The script in a new process forked from the warm_python server (a fresh process as torchrun's
    restart makes one, without a fresh interpreter's imports); with `stop_at_midway` it must die by
    SIGKILL in the middle of the write (it kills itself there), else finish."""
    script = tmp_path / "killed.py"
    script.write_text(_KILLED.format(tests=str(REPO / "tests")))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    proc = warm_python([str(script), where, str(directory)], cwd=tmp_path, env=env, timeout=120)
    output = proc.stdout + proc.stderr
    if stop_at_midway:
        assert proc.returncode == -signal.SIGKILL and "MIDWAY" in proc.stdout.split(), \
            f"the script was not killed in the middle of the write (status {proc.returncode}):\n{output}"
    else:
        assert proc.returncode == 0 and "MIDWAY" not in proc.stdout, output


@pytest.fixture(scope="module")
def unbroken_run(tmp_path_factory, warm_python):
    """The script's checkpoints of a run never interrupted: the same for every `where` (seeded), so made once."""
    tmp_path = tmp_path_factory.mktemp("unbroken")
    _script(warm_python, tmp_path, "none", tmp_path / "unbroken", stop_at_midway=False)
    return _files(tmp_path / "unbroken")


@pytest.mark.parametrize("where", ["rank_file", "meta"])
def test_killed_during_a_background_write_resumes_from_the_previous_one(tmp_path, where, unbroken_run, warm_python):
    directory = tmp_path / "ckpt"
    _script(warm_python, tmp_path, where, directory, stop_at_midway=True)
    with pytest.warns(UserWarning, match="step_000000004"):
        latest = CheckpointManager(str(directory)).latest_good()
    assert latest[0].endswith("step_000000002")
    # Resuming from there (a new process, as torchrun restarts one) ends where a run never interrupted
    # does: its last checkpoint holds the same state, bit for bit.
    _script(warm_python, tmp_path, "none", directory, stop_at_midway=False)
    resumed, unbroken = _files(directory), unbroken_run
    assert "step_000000006" in resumed
    _same(resumed["step_000000006"], unbroken["step_000000006"])


def resume_worker(rank, world, base, strategy):
    def params(t):
        return {k: v.clone() for k, v in t.full_state_dict().items()}

    with _trainer(os.path.join(base, "unbroken"), strategy, checkpoint_every=2, checkpoint_async=True) as t:
        _fit(t, 6)
        reference = params(t)
    with _trainer(os.path.join(base, "broken"), strategy, checkpoint_every=2, checkpoint_async=True) as t:
        _fit(t, 3)  # stops at step 3 (its checkpoint written in the background, complete when fit returns)
        assert t.latest_checkpoint()[1]["step"] == 3  # on every rank, not only on the one writing meta.pt
    with _trainer(os.path.join(base, "broken"), strategy, checkpoint_every=2, checkpoint_async=True) as t:
        _fit(t, 6)
        resumed = params(t)
    if rank == 0:
        _same(resumed, reference)
    return True


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_resume_from_a_background_checkpoint_equals_an_unbroken_run(tmp_path, strategy):
    run_distributed(resume_worker, 2, args=(str(tmp_path), strategy), timeout=180)


def test_pruning_leaves_newer_checkpoints_being_written_alone(tmp_path):
    """With background writes another rank may already be writing the next checkpoint when the
    directory's writer prunes after this one: its directory (no meta.pt yet) must survive, and so must
    the checkpoint just completed. Seen as a flake: a pruning that listed the directory twice deleted a
    step directory made between the two listings, under the rank writing into it."""
    manager = CheckpointManager(str(tmp_path), keep_last=1)
    for step in (2, 4, 6):
        os.makedirs(manager.path_for(step))
    for step in (2, 4):  # finished (meta.pt written last); 6 is still being written
        open(os.path.join(manager.path_for(step), "meta.pt"), "wb").close()
    manager.finalize(4)
    assert manager.steps() == [4, 6]  # 2 pruned; 6, being written, untouched
    manager = CheckpointManager(str(tmp_path), keep_last=2)
    os.makedirs(manager.path_for(8))
    manager.finalize(6)
    assert manager.steps() == [4, 6, 8]


# ----------------------------------------------------------------- the writer and the snapshot
def test_atomic_save_writes_what_torch_save_writes_and_hashes_it(tmp_path):
    """The streamed file is byte for byte what torch.save writes into a file object (what the writer
    used to put in memory first), its digest is that of the file on disk, and it loads weights-only."""
    import hashlib
    import io

    from distributed_training.checkpoint import atomic_save, sha256_file

    g = torch.Generator().manual_seed(0)
    obj = {"params": {"w": [(0, torch.randn(1000, generator=g)), (5, torch.randn(7, generator=g)[2:])]},
           "step": torch.tensor(3.0), "half": torch.randn(10, generator=g).half(), "n": 4, "rng": [1, [2, 3]]}
    path = str(tmp_path / "rank0.pt")
    digest = atomic_save(obj, path)
    old = io.BytesIO()  # the previous writer: torch.save into memory, then written
    torch.save(obj, old)
    assert open(path, "rb").read() == old.getvalue()
    assert digest == sha256_file(path) == hashlib.sha256(old.getvalue()).hexdigest()
    _same(torch.load(path, weights_only=True), obj)
    assert os.listdir(tmp_path) == ["rank0.pt"]  # no temporary left


def test_atomic_save_leaves_no_file_when_it_fails(tmp_path):
    from distributed_training.checkpoint import atomic_save

    path = tmp_path / "rank0.pt"
    path.write_bytes(b"the previous file")
    with pytest.raises(Exception):
        atomic_save({"bad": lambda: 0}, str(path))  # not picklable: fails midway through the file
    assert path.read_bytes() == b"the previous file" and os.listdir(tmp_path) == ["rank0.pt"]


def test_host_staging_on_the_cpu_clones_at_once():
    from distributed_training.checkpoint_async import HostStaging

    staging = HostStaging()
    staging.begin()
    live = torch.arange(6.0)
    copy, now = staging(live), staging.now(live)
    live.add_(1)
    assert staging.ready() is None
    assert torch.equal(copy, torch.arange(6.0)) and torch.equal(now, torch.arange(6.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_host_staging_copies_on_a_side_stream_see_the_checkpoint_step():
    """The deferred copies run on a side stream behind the checkpoint step; the optimizer's next step
    waits for them (its pre-hook), so they hold the state of the checkpoint step, not a later one, even
    when the compute stream is busy with long kernels queued before and after."""
    from distributed_training.checkpoint_async import HostStaging

    device = torch.device("cuda", torch.cuda.current_device())
    params = [torch.nn.Parameter(torch.randn(1 << 22, device=device)) for _ in range(8)]
    opt = torch.optim.SGD(params, lr=1.0)
    staging = HostStaging()
    for round_ in range(3):
        for p in params:
            p.grad = torch.ones_like(p)
        a = torch.randn(4096, 4096, device=device)
        for _ in range(20):  # keep the compute stream busy: the side stream must still wait for it
            a = torch.tanh(a @ a)  # bounded: a plain a @ a would overflow to inf and inf * 0 is NaN
        with torch.no_grad():
            for p in params:
                p.add_(a[0, 0] * 0 + round_)  # the checkpoint step's last change, queued behind the matmuls
        staging.begin()
        host = [staging(p) for p in params]
        expected_dev = [p.detach().clone() for p in params]
        event = staging.ready(opt)
        opt.step()  # changes every parameter: must wait for the copies on the device
        event.synchronize()
        for h, e in zip(host, expected_dev):
            assert torch.equal(h, e.cpu())
        assert all(h.is_pinned() for h in host)
    torch.cuda.synchronize()
