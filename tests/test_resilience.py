"""Crash-proof training: bit-exact resume, a SIGKILLed rank under torchrun, corrupted checkpoints,
uneven inputs that must not hang, and timeouts that name the missing rank."""

from __future__ import annotations

import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.utils.data import IterableDataset

from distributed_training import DistributedTrainer
from distributed_training.checkpoint import CheckpointManager
from distributed_training.testing import run_distributed

from _models import job_main, sgd_momentum, tiny_gpt, tiny_gpt_data

REPO = Path(__file__).resolve().parents[1]


def _gpt(dropout=0.1):
    return tiny_gpt(dropout=dropout)


_data, _sgd = tiny_gpt_data, sgd_momentum


# ------------------------------------------------------------------ in-process resume
def resume_worker(rank, world, directory, strategy, interrupt_at):
    torch.manual_seed(0)
    trainer = DistributedTrainer(_gpt(), _sgd, strategy=strategy, checkpoint_dir=directory, checkpoint_every=2, seed=3)
    if interrupt_at:
        trainer.fit(_data(), epochs=2, batch_size=3, max_steps=interrupt_at)  # "crashes" after this step
        trainer.close()
        torch.manual_seed(0)  # a fresh process would start from the same seed; resume must undo the rest
        trainer = DistributedTrainer(_gpt(), _sgd, strategy=strategy, checkpoint_dir=directory,
                                     checkpoint_every=2, seed=3)
    trainer.fit(_data(), epochs=2, batch_size=3)
    state = trainer.strategy.model_state_dict(trainer.model)
    step = trainer.step
    trainer.close()
    return state, step


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero3", "zero1"])
def test_resume_mid_epoch_is_bit_identical_at_world_3(tmp_path, strategy, warm_torchrun):
    full, steps = run_distributed(resume_worker, 3, args=(str(tmp_path / "a"), strategy, 0), timeout=180)[0]
    # Interrupted at step 5: the checkpoint at step 4 is resumed and step 5 is redone.
    resumed, steps2 = run_distributed(resume_worker, 3, args=(str(tmp_path / "b"), strategy, 5), timeout=180)[0]
    assert steps == steps2 == 12
    assert list(full) == list(resumed)
    for key in full:
        assert torch.equal(full[key], resumed[key]), f"{strategy}: {key} differs after resume"


# ------------------------------------------------------------------ fault injection
@pytest.fixture(scope="module")
def sigkilled_runs(request, tmp_path_factory, warm_python):
    """The strategies of the selected `test_sigkilled_rank_restarts_and_matches_an_unbroken_run` cases, each
    with an unbroken reference run and a faulty torchrun run, all the faulty ones in ONE torchrun job:
    `fault_job.py --strategy ddp,fsdp` trains them one after the other, rank 1 SIGKILLs itself after step 5
    of each strategy on that strategy's first attempt (attempt i for the i-th), torchrun restarts the
    workers each time (--max-restarts=3: the two restarts and one to spare, as before) and the trainer
    resumes from the strategy's own latest good checkpoint. FSDP's run is ``resume=False`` in a directory an
    earlier run left a checkpoint (and its token) in: moved aside at the start, and the restarts resume from the
    run's own (session 41: they moved those aside too, and trained again from step 0). One launcher and three
    generations of fresh workers instead of two launchers and four generations. Returns ``(tmp, log)``."""
    wanted = [s for s in ("ddp", "fsdp") if any(item.originalname == "test_sigkilled_rank_restarts_and_matches_an_unbroken_run"
                                                 and item.callspec.params["strategy"] == s
                                                 for item in request.session.items if item.module is request.module)]
    tmp = tmp_path_factory.mktemp("sigkilled")
    job = str(REPO / "tests" / "jobs" / "fault_job.py")

    def references():
        # The unbroken references: the same job's main() on 2 ranks forked from a warm interpreter (no torchrun
        # processes to start), in a thread while the faulty job runs (its workers' imports, its restarts).
        for strategy in wanted:
            run_distributed(job_main, 2, args=("fault_job", ["--strategy", strategy, "--ckpt", str(tmp / f"clean_{strategy}"),
                                                              "--out", str(tmp / f"clean_{strategy}.pt")]), timeout=240)

    from distributed_training.testing import _torchrun_env

    (tmp / "faulty_fsdp" / "step_000000099").mkdir(parents=True)  # an earlier run's, and its token: not this launch's
    (tmp / "faulty_fsdp" / ".run_id").write_text("0123456789abcdef\n")
    with ThreadPoolExecutor(1) as pool:
        clean = pool.submit(references)
        out = warm_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=3",
                           job, "--strategy", ",".join(wanted), "--ckpt", str(tmp / "faulty_{strategy}"),
                           "--out", str(tmp / "faulty_{strategy}.pt"), "--kill-at", "5", "--no-resume", "fsdp"],
                          cwd=REPO, env=_torchrun_env({"CUDA_VISIBLE_DEVICES": ""}), timeout=400)
        clean.result()
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    return tmp, log


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sigkilled_rank_restarts_and_matches_an_unbroken_run(strategy, sigkilled_runs):
    tmp_path, log = sigkilled_runs
    clean, faulty = torch.load(tmp_path / f"clean_{strategy}.pt"), torch.load(tmp_path / f"faulty_{strategy}.pt")
    assert int(faulty["restarts"]) >= 1, f"the job should have been restarted:\n{log[-3000:]}"
    assert f"FAULT rank 1 kills itself after step 5 of {strategy}" in log, log[-3000:]
    assert log.count("exitcode: -9") >= log.count("FAULT rank 1 kills itself"), "rank 1 should have died of SIGKILL"
    assert clean["step"] == faulty["step"] == 12
    for key, value in clean["state"].items():
        assert torch.equal(value, faulty["state"][key]), f"{key} differs from the unbroken run"
    kept = sorted(os.listdir(tmp_path / f"faulty_{strategy}"))
    if strategy == "fsdp":  # resume=False: the earlier run's checkpoint set aside once, the run's own resumed
        assert kept == [".run_id", "previous_run_1", "step_000000009", "step_000000012"], kept
        assert os.listdir(tmp_path / "faulty_fsdp" / "previous_run_1") == ["step_000000099"]
        assert "resume is off, but torchrun restarted this run's workers" in log, log[-3000:]
        assert (tmp_path / "faulty_fsdp" / ".run_id").read_text() != "0123456789abcdef\n"
    else:
        assert kept == ["step_000000009", "step_000000012"], kept  # keep_last=2


# ------------------------------------------------------------------ corrupted checkpoints
def corrupt_worker(rank, world, directory):
    torch.manual_seed(0)
    trainer = DistributedTrainer(_gpt(0.0), _sgd, checkpoint_dir=directory, checkpoint_every=2, keep_last=2,
                                 best_metric="loss")
    trainer.fit(_data(), epochs=2, batch_size=9, max_steps=6)
    trainer.close()
    return sorted(os.listdir(directory))


def resume_after_corruption_worker(rank, world, directory):
    torch.manual_seed(0)
    trainer = DistributedTrainer(_gpt(0.0), _sgd, checkpoint_dir=directory)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = trainer.checkpoints.latest_good()
    step = int(found[1]["step"])
    trainer.load_checkpoint(found[0])
    trainer.close()
    return step, [str(w.message) for w in caught], trainer.step


def test_corrupted_checkpoint_falls_back_to_the_previous_one(tmp_path):
    directory = str(tmp_path / "ckpt")
    files = run_distributed(corrupt_worker, 2, args=(directory,))[0]
    manager = CheckpointManager(directory)
    best = manager.best()
    # keep_last=2 keeps steps 4 and 6, and the best one by loss is kept as well.
    assert {"step_000000004", "step_000000006", "best.json"} <= set(files), files
    assert best is not None and os.path.isdir(best[0]) and best[1]["metric"] == "loss"
    # Truncate the newest checkpoint's rank-1 file: it must be detected and skipped.
    victim = tmp_path / "ckpt" / "step_000000006" / "rank1.pt"
    victim.write_bytes(victim.read_bytes()[:100])
    step, messages, restored = run_distributed(resume_after_corruption_worker, 2, args=(directory,))[0]
    assert step == 4 and restored == 4
    assert any("step_000000006" in m and "rank1.pt" in m for m in messages), messages
    # A save interrupted before meta.pt counts as no checkpoint at all.
    os.remove(tmp_path / "ckpt" / "step_000000004" / "meta.pt")
    with pytest.warns(UserWarning, match="incomplete"):
        found = manager.latest_good()
    assert found is None or "step_000000004" not in found[0]


# ------------------------------------------------------------------ uneven inputs
class RankDependent(IterableDataset):
    """Rank r yields 3 + 2r batches: without evening out, the last ranks would wait forever."""

    def __init__(self, rank):
        self.rank = rank

    def __iter__(self):
        g = torch.Generator().manual_seed(self.rank)
        for _ in range(3 + 2 * self.rank):
            idx = torch.randint(0, 64, (2, 17), generator=g)
            yield idx[:, :-1], idx[:, 1:]


def uneven_worker(rank, world, strategy):
    torch.manual_seed(0)
    trainer = DistributedTrainer(_gpt(0.0), _sgd, strategy=strategy)  # (the group run_distributed made has its 60 s)
    started = time.monotonic()
    history = trainer.fit(RankDependent(rank), epochs=2)
    elapsed = time.monotonic() - started
    trainer.close()
    return [h["steps"] for h in history], elapsed


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_uneven_inputs_never_hang(strategy):
    for steps, elapsed in run_distributed(uneven_worker, 3, args=(strategy,), timeout=120, collective_timeout=60):
        assert steps == [3, 3], steps  # everyone stops with the rank that has the fewest batches
        assert elapsed < 30


# ------------------------------------------------------------------ timeouts name the missing rank
def timeout_worker(rank, world, strategy, directory):
    torch.manual_seed(0)
    trainer = DistributedTrainer(_gpt(0.0), _sgd, strategy=strategy)
    batch = next(iter(RankDependent(0)))
    trainer.train_step(batch)  # everyone takes part in step 1
    done = os.path.join(directory, "rank0_done")
    if rank == 1:
        # Rank 1 never reaches step 2's collectives, and stays alive (its sockets open) until rank 0's
        # step 2 has ended: rather than a fixed sleep, until rank 0 says so (at most 60 s).
        deadline = time.monotonic() + 60
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
        return None
    started = time.monotonic()
    try:
        trainer.train_step(batch)
    except RuntimeError as err:
        return type(err).__name__, str(err), time.monotonic() - started
    finally:
        open(done, "w").close()
    return None


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_collective_timeout_names_operation_and_missing_rank(strategy, tmp_path):
    results = run_distributed(timeout_worker, 2, args=(strategy, str(tmp_path)), timeout=90, collective_timeout=3)
    kind, message, elapsed = results[0]
    assert kind == "CollectiveTimeoutError", message
    assert "rank 1" in message and "never reached step 2" in message, message
    assert ("DDP " in message) if strategy == "ddp" else ("FSDP " in message), message
    assert elapsed < 3 * 3, elapsed
