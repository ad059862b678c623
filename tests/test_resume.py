"""Resume, beyond bit-exactness of the parameters (tests/test_resilience.py): every checkpoint file is
verified before use, each rank gets its own buffers back, resuming says so and applies a changed
configuration, `resume=False` / ``dtrain --no-resume`` start over, and a checkpoint is a directory."""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils.data import TensorDataset

from distributed_training import FSDP, DDPStrategy, DistributedTrainer
from distributed_training.checkpoint import CheckpointCorruptError, CheckpointManager
from distributed_training.config import ConfigError, load_config
from distributed_training.optim import WarmupSchedule
from distributed_training.testing import run_distributed

REPO = Path(__file__).resolve().parents[1]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)

    def forward(self, x):
        return torch.relu(self.bn(self.fc(x)))


class BNNet(nn.Module):
    """Two repeated blocks (two FSDP units) whose BatchNorm statistics each rank updates from its own data."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _data(n=48, width=8):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, width, generator=g) * torch.linspace(0.5, 3.0, n).unsqueeze(1)  # ranks' shards differ
    return TensorDataset(x, torch.randn(n, 3, generator=g))


def _sgd(lr=0.1):
    return lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.9)


def _strategy(name):
    return DDPStrategy(broadcast_buffers=False) if name == "ddp_local_buffers" else name


def _state(trainer) -> dict[str, torch.Tensor]:
    """This rank's full view: every parameter (gathered under FSDP) and this rank's own buffers."""
    if isinstance(trainer.model, FSDP):
        return trainer.model.full_state_dict(rank0_only=False)
    return {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _capture_logs() -> _Records:
    logger = logging.getLogger("distributed_training")
    logger.setLevel(logging.INFO)
    handler = _Records()
    logger.addHandler(handler)
    return handler


def _in_turn(rank, world, calls):
    """Several `run_distributed` targets one after the other in one launch (what separate launches did, in
    one set of processes): ``calls`` is ``[(fn, args), ...]``; returns ``[fn(rank, world, *args), ...]``, each
    result copied when its call returns (a log handler a call left on the logger appends no later message)."""
    import pickle

    return [pickle.loads(pickle.dumps(fn(rank, world, *args))) for fn, args in calls]


def _on_rank0_between_barriers(rank, world, fn, *args):
    """``fn(*args)`` on rank 0 alone, what the test did between two launches, with every rank waiting for it."""
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        fn(*args)
    dist.barrier()


# ------------------------------------------------------------------ 1. every file verified, meta.pt included
def _make_checkpoints(rank, world, directory):
    torch.manual_seed(0)
    trainer = DistributedTrainer(BNNet(), _sgd(), checkpoint_dir=directory, checkpoint_every=2)
    trainer.fit(_data(), epochs=1, criterion=F.mse_loss, batch_size=4, max_steps=4)
    trainer.close()


def _resume_after_garbage(rank, world, directory):
    logs = _capture_logs()
    torch.manual_seed(0)
    trainer = DistributedTrainer(BNNet(), _sgd(), checkpoint_dir=directory, checkpoint_every=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_data(), epochs=1, criterion=F.mse_loss, batch_size=4, max_steps=3)
    by_hand = None
    try:
        trainer.load_checkpoint(os.path.join(directory, "step_000000004"))
    except Exception as err:  # noqa: BLE001 - the test inspects whatever comes out
        by_hand = (type(err).__name__, str(err), err.__cause__ is None and (err.__context__ is None or err.__suppress_context__))
    trainer.close()
    return [str(w.message) for w in caught], logs.messages, by_hand


# Bytes that look like nothing in particular: torch.load(weights_only=True) fails on them with an
# UnpicklingError whose message advises weights_only=False.
_GARBAGE = bytes(random.Random(3).randrange(256) for _ in range(400))


def _garbage_meta(meta, sidecar):
    with open(meta, "wb") as f:
        f.write(_GARBAGE)
    if sidecar == "removed" and os.path.exists(meta + ".sha256"):
        os.remove(meta + ".sha256")  # as in a checkpoint written before meta.pt had a checksum


@pytest.mark.parametrize("sidecar", ["kept", "removed"])
def test_garbage_meta_is_skipped_with_a_warning_and_never_weights_only_advice(tmp_path, sidecar):
    directory = str(tmp_path / "ckpt")
    meta = str(tmp_path / "ckpt" / "step_000000004" / "meta.pt")
    # Checkpoints made, meta.pt overwritten with garbage, then a resume: one launch (new trainers each).
    results = [r[2] for r in run_distributed(_in_turn, 2, args=([
        (_make_checkpoints, (directory,)), (_on_rank0_between_barriers, (_garbage_meta, meta, sidecar)),
        (_resume_after_garbage, (directory,))],), timeout=180)]
    assert "resumed from step 2 (" in " ".join(results[0][1]), results[0][1]  # rank 0 reports
    for rank, (warned, logged, by_hand) in enumerate(results):
        # said once, by rank 0: every rank reads the same directory
        assert any("step_000000004" in w and "meta.pt" in w for w in warned) == (rank == 0), (rank, warned)
        kind, message, no_chained_cause = by_hand
        assert kind == "CheckpointCorruptError" and "meta.pt" in message and "step_000000004" in message, message
        assert no_chained_cause, "the original error (with torch's advice) must not be chained"
        for text in warned + logged + [message]:
            assert "weights_only" not in text, text


def _load_by_hand(rank, world, path, strategy):
    """What `load_checkpoint` raises on this rank, and whether this rank's state is untouched by it."""
    torch.manual_seed(1)  # other weights than the checkpoint's
    trainer = DistributedTrainer(BNNet(), _sgd(), strategy=strategy)
    before = _state(trainer)
    try:
        trainer.load_checkpoint(path)
        raised = None
    except Exception as err:  # noqa: BLE001 - the test inspects whatever comes out
        raised = (type(err).__name__, str(err))
    untouched = all(torch.equal(before[k], v) for k, v in _state(trainer).items())
    trainer.close()
    return raised, untouched


def _flip_a_byte(file):
    with open(file, "rb") as f:
        data = bytearray(f.read())
    data[len(data) // 2] ^= 0xFF
    with open(file, "wb") as f:
        f.write(bytes(data))


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_a_corrupt_rank_file_stops_the_load_on_every_rank_before_anything_is_copied(tmp_path, strategy):
    """One rank's file flipped: every rank raises, naming it, and no rank's model was changed (each
    rank checks its share of the files and the ranks agree before any copy)."""
    directory = str(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "step_000000004"
    # Checkpoints made, one byte of rank1.pt flipped, then the load: one launch (a new trainer for the load).
    results = run_distributed(_in_turn, 2, args=([
        (_make_checkpoints, (directory,)), (_on_rank0_between_barriers, (_flip_a_byte, str(path / "rank1.pt"))),
        (_load_by_hand, (str(path), strategy))],), timeout=180)
    for raised, untouched in (r[2] for r in results):
        assert raised is not None and raised[0] == "CheckpointCorruptError", raised
        assert "rank1.pt" in raised[1] and "nothing was loaded" in raised[1], raised[1]
        assert untouched


def test_meta_without_required_fields_counts_as_corrupt(tmp_path):
    path = tmp_path / "step_000000001"
    path.mkdir()
    torch.save({"hello": 1}, path / "meta.pt")
    (path / "meta.pt.sha256").write_text(hashlib.sha256((path / "meta.pt").read_bytes()).hexdigest())
    with pytest.raises(CheckpointCorruptError, match="it must hold"):
        CheckpointManager.verify(str(path))
    with pytest.warns(UserWarning, match="step_000000001"):
        assert CheckpointManager(str(tmp_path)).latest_good() is None


def test_meta_without_its_checksum_is_refused_even_when_it_loads(tmp_path):
    """A meta.pt whose sidecar is gone is not trusted, however well it unpickles (an edited step)."""
    directory = str(tmp_path / "ckpt")
    run_distributed(_make_checkpoints, 2, args=(directory,), timeout=120)
    path = tmp_path / "ckpt" / "step_000000004"
    meta = torch.load(path / "meta.pt", weights_only=True)
    meta["step"] += 1000
    torch.save(meta, path / "meta.pt")
    os.remove(path / "meta.pt.sha256")
    with pytest.raises(CheckpointCorruptError, match="meta.pt.sha256"):
        CheckpointManager.verify(str(path))


# ------------------------------------------------------------------ 2. buffers are per-rank state
def _bn_run(rank, world, directory, strategy, interrupt_at):
    """Every rank's parameters and buffers after every step, with a restart after `interrupt_at` steps."""
    torch.manual_seed(0)

    def trainer_and_recorder():
        trainer = DistributedTrainer(BNNet(), _sgd(), strategy=_strategy(strategy), checkpoint_dir=directory,
                                     checkpoint_every=2, seed=3)
        return trainer, lambda step, metrics: trajectory.__setitem__(step, _state(trainer))

    trajectory: dict[int, dict[str, torch.Tensor]] = {}
    trainer, record = trainer_and_recorder()
    if interrupt_at:
        trainer.fit(_data(), epochs=2, criterion=F.mse_loss, batch_size=4, max_steps=interrupt_at, log_every=1,
                    on_step=record)
        trainer.close()
        torch.manual_seed(0)
        trainer, record = trainer_and_recorder()
    trainer.fit(_data(), epochs=2, criterion=F.mse_loss, batch_size=4, log_every=1, on_step=record)
    trainer.close()
    return trajectory


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero2", "zero3", "ddp_local_buffers"])
def test_resume_restores_every_ranks_own_buffers_bit_for_bit(tmp_path, strategy):
    runs = run_distributed(_in_turn, 2, args=([(_bn_run, (str(tmp_path / "a"), strategy, 0)),
                                               (_bn_run, (str(tmp_path / "b"), strategy, 3))],), timeout=240)
    unbroken, resumed = [r[0] for r in runs], [r[1] for r in runs]
    # The ranks' statistics really differ, so restoring rank 0's everywhere would be caught.
    assert not torch.equal(unbroken[0][12]["blocks.0.bn.running_mean"], unbroken[1][12]["blocks.0.bn.running_mean"])
    for rank in range(2):
        assert sorted(unbroken[rank]) == sorted(resumed[rank]) == list(range(1, 13))
        for step, state in unbroken[rank].items():
            assert list(state) == list(resumed[rank][step])
            for key, value in state.items():
                assert torch.equal(value, resumed[rank][step][key]), f"rank {rank}, step {step}: {key} differs"


def _save_at_world(rank, world, directory):
    torch.manual_seed(0)
    trainer = DistributedTrainer(BNNet(), _sgd(), strategy="zero3", checkpoint_dir=directory, checkpoint_every=2)
    trainer.fit(_data(), epochs=1, criterion=F.mse_loss, batch_size=4, max_steps=2)
    buffers = {k: v.clone() for k, v in trainer.module.named_buffers()}
    trainer.close()
    return buffers


def _load_at_world(rank, world, directory):
    torch.manual_seed(1)
    trainer = DistributedTrainer(BNNet(), _sgd(), strategy="zero3")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # RNG states are not restored at another world size
        trainer.load_checkpoint(os.path.join(directory, "step_000000002"))
    buffers = {k: v.clone() for k, v in trainer.module.named_buffers()}
    trainer.close()
    return buffers


@pytest.mark.slow
def test_new_world_size_takes_the_matching_ranks_buffers_or_rank_0s(tmp_path):
    directory = str(tmp_path / "ckpt")
    saved = run_distributed(_save_at_world, 2, args=(directory,), timeout=120)
    loaded = run_distributed(_load_at_world, 3, args=(directory,), timeout=120)
    for rank, source in ((0, 0), (1, 1), (2, 0)):
        for key, value in saved[source].items():
            assert torch.equal(loaded[rank][key], value), f"rank {rank}: {key} should be rank {source}'s"


# ------------------------------------------------------------------ 3. resume says so, and applies changes
def _lr_run(rank, world, directory, first_lr, second_lr, restart):
    """4 steps at `first_lr`, then 4 at `second_lr`: by a restart with the new lr configured, or (reference)
    by setting the lr by hand in the same trainer."""
    logs = _capture_logs()
    torch.manual_seed(0)
    trajectory = {}
    trainer = DistributedTrainer(BNNet(), _sgd(first_lr), checkpoint_dir=directory, checkpoint_every=2)
    trainer.fit(_data(), epochs=2, criterion=F.mse_loss, batch_size=4, max_steps=4)
    if restart:
        trainer.close()
        torch.manual_seed(0)
        trainer = DistributedTrainer(BNNet(), _sgd(second_lr), checkpoint_dir=directory, checkpoint_every=2)
    else:
        for group in trainer.optimizer.param_groups:
            group["lr"] = second_lr
    trainer.fit(_data(), epochs=2, criterion=F.mse_loss, batch_size=4, max_steps=8, log_every=1,
                on_step=lambda step, metrics: trajectory.__setitem__(step, (_state(trainer), metrics["lr"])))
    trainer.close()
    return trajectory, logs.messages


def test_changed_learning_rate_applies_after_resume_and_is_reported(tmp_path):
    runs = run_distributed(_in_turn, 2, args=([(_lr_run, (str(tmp_path / "a"), 0.1, 0.03, False)),
                                               (_lr_run, (str(tmp_path / "b"), 0.1, 0.03, True))],), timeout=240)
    reference, resumed = [r[0] for r in runs], [r[1] for r in runs]
    for rank in range(2):
        expected, _ = reference[rank]
        got, logged = resumed[rank]
        assert sorted(got) == [5, 6, 7, 8]
        for step in got:
            assert got[step][1] == pytest.approx(0.03), f"step {step} trained at lr {got[step][1]}"
            for key, value in expected[step][0].items():
                assert torch.equal(value, got[step][0][key]), f"rank {rank}, step {step}: {key} differs"
        if rank == 0:
            text = "\n".join(logged)
            assert "resumed from step 4 (" in text and "step_000000004" in text, text
            assert "lr: 0.1 -> 0.03" in text, text
        else:
            assert not any("resumed" in m for m in logged), "only rank 0 reports"


def _schedule_run(rank, world, directory, schedules, steps_first):
    """Train with schedules[0] (for `steps_first` steps, then a restart with schedules[1]) and return the lr of
    every step."""
    logs = _capture_logs()
    lrs = {}
    for k, schedule in enumerate(schedules):
        torch.manual_seed(0)
        trainer = DistributedTrainer(BNNet(), _sgd(0.1), lr_scheduler=_SCHEDULES[schedule],
                                     checkpoint_dir=directory, checkpoint_every=2)
        trainer.fit(_data(), epochs=1, criterion=F.mse_loss, batch_size=4,
                    max_steps=steps_first if k == 0 and len(schedules) > 1 else None, log_every=1,
                    on_step=lambda step, metrics: lrs.__setitem__(step, metrics["lr"]))
        trainer.close()
    return lrs, logs.messages


def _warmup(steps):
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / steps))


_SCHEDULES = {
    "halve": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "slow": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9),
    "warmup4": _warmup(4),
    "warmup10": _warmup(10),
    # dtrain's schedules: a plain object, whose fields LambdaLR's state dict holds (`optim.WarmupSchedule`).
    "cosine4": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, WarmupSchedule("cosine", 4, total_steps=12)),
    "cosine6": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, WarmupSchedule("cosine", 6, total_steps=12)),
}


@pytest.mark.parametrize("old,new,reported", [("halve", "slow", "gamma: 0.5 -> 0.9"),
                                              ("warmup4", "warmup10", "learning rate at step 5"),
                                              ("cosine4", "cosine6", "lr schedule warmup_steps: 4 -> 6; learning rate")])
def test_changed_schedule_applies_after_resume_and_is_reported(tmp_path, old, new, reported):
    (unbroken, _), (changed, logged) = run_distributed(_in_turn, 1, args=([
        (_schedule_run, (str(tmp_path / "a"), [new], 0)), (_schedule_run, (str(tmp_path / "b"), [old, new], 5))],),
        timeout=180)[0]
    assert len(unbroken) == 12 and sorted(changed) == sorted(unbroken)
    for step in range(6, 13):  # after the restart: the new schedule, as if it had been there from the start
        assert changed[step] == unbroken[step], (step, changed[step], unbroken[step])
    assert changed[5] != unbroken[5]
    assert reported in "\n".join(logged), logged
    assert not any("lr_lambdas" in m or "{" in m for m in logged), logged  # said in words, not as state dicts


def test_unchanged_schedule_resumes_silently_and_exactly(tmp_path):
    (unbroken, _), (resumed, logged) = run_distributed(_in_turn, 1, args=([
        (_schedule_run, (str(tmp_path / "a"), ["halve"], 0)),
        (_schedule_run, (str(tmp_path / "b"), ["halve", "halve"], 5))],), timeout=180)[0]
    assert resumed == unbroken
    assert not any("lr_scheduler" in m or "learning rate" in m or "optimizer" in m for m in logged), logged


def _limits_run(rank, world, directory):
    logs = _capture_logs()
    results = []
    for max_steps in (4, 4, 6):
        torch.manual_seed(0)
        trainer = DistributedTrainer(BNNet(), _sgd(), checkpoint_dir=directory, checkpoint_every=2)
        before = len(logs.messages)
        history = trainer.fit(_data(), epochs=5, criterion=F.mse_loss, batch_size=4, max_steps=max_steps)
        results.append((trainer.step, len(history), logs.messages[before:]))
        trainer.close()
    return results, sorted(os.listdir(directory))


def test_complete_run_says_so_and_a_raised_max_steps_is_reported(tmp_path):
    (first, again, longer), files = run_distributed(_limits_run, 2, args=(str(tmp_path / "ckpt"),), timeout=180)[0]
    assert first[0] == 4 and first[1] >= 1
    step, epochs_trained, logged = again
    assert step == 4 and epochs_trained == 0, again
    assert any("already complete at step 4" in m for m in logged), logged
    step, _, logged = longer
    assert step == 6
    text = "\n".join(logged)
    assert "resumed from step 4" in text and "max_steps: 4 -> 6" in text, text
    assert files == ["step_000000002", "step_000000004", "step_000000006"], files


def _shape_run(rank, world, directory, strategy, width, optimizer):
    torch.manual_seed(0)
    make = _sgd() if optimizer == "sgd" else (lambda ps: torch.optim.Adam(ps, lr=0.01))
    trainer = DistributedTrainer(BNNet(width), make, strategy=strategy, checkpoint_dir=directory, checkpoint_every=2)
    try:
        trainer.fit(_data(width=width), epochs=1, criterion=F.mse_loss, batch_size=4, max_steps=2)
        return None
    except Exception as err:  # noqa: BLE001
        return type(err).__name__, str(err)
    finally:
        trainer.close()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_what_cannot_change_is_an_error_that_names_it(tmp_path, strategy):
    directory = str(tmp_path / "ckpt")
    # The run, then a wider model and another optimizer over its checkpoint: one launch, a new trainer each.
    results = run_distributed(_in_turn, 2, args=([(_shape_run, (directory, strategy, 8, "sgd")),
                                                  (_shape_run, (directory, strategy, 12, "sgd")),
                                                  (_shape_run, (directory, strategy, 8, "adam"))],), timeout=240)
    assert [r[0] for r in results] == [None, None]
    for kind, message in (r[1] for r in results):
        shapes = message.replace("torch.Size(", "").replace(")", "")
        named = re.search(r"'?(blocks\.0\.fc\.weight|head\.weight)'?", message)
        assert named and ("[12, 12]" in shapes or "[3, 12]" in shapes) and "step_000000002" in message, message
        assert kind == "CheckpointMismatchError" and "another model" in message, (kind, message)  # dtrain: one line
    for kind, message in (r[2] for r in results):
        # CheckpointMismatchError is a ValueError that dtrain reports in one line.
        assert kind == "CheckpointMismatchError" and "SGD" in message and "Adam" in message, message


def _fresh_run(rank, world, directory, resume):
    logs = _capture_logs()
    torch.manual_seed(0)
    trainer = DistributedTrainer(BNNet(), _sgd(), checkpoint_dir=directory, checkpoint_every=2, resume=resume)
    history = trainer.fit(_data(), epochs=1, criterion=F.mse_loss, batch_size=4, max_steps=2)
    trainer.close()
    return sum(h["steps"] for h in history), logs.messages


def test_resume_false_starts_over_and_sets_the_old_run_aside(tmp_path):
    directory = tmp_path / "ckpt"
    _, (steps, logged) = run_distributed(_in_turn, 2, args=([(_make_checkpoints, (str(directory),)),
                                                             (_fresh_run, (str(directory), False))],), timeout=180)[0]
    assert steps == 2, "a run that does not resume trains from step 0"
    assert any("previous_run_1" in m for m in logged), logged
    assert sorted(os.listdir(directory)) == [".run_id", "previous_run_1", "step_000000002"]  # (its token: trainer_resume)
    assert sorted(os.listdir(directory / "previous_run_1")) == ["step_000000002", "step_000000004"]


def _file_as_checkpoint_dir(rank, world, path):
    try:
        DistributedTrainer(nn.Linear(4, 2), _sgd(), checkpoint_dir=path).close()
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.timeout(60)
def test_a_checkpoint_dir_that_is_a_file_is_refused_before_training(tmp_path):
    """It failed at fit's first save (NotADirectoryError), after the steps before it had trained."""
    path = tmp_path / "ckpt"
    path.write_text("not a directory")
    [said] = run_distributed(_file_as_checkpoint_dir, world_size=1, args=(str(path),), timeout=50)
    assert said is not None and f"checkpoint_dir {str(path)!r} is a file" in said, said


def test_config_resume_and_save_on_preemption_fields():
    cfg = load_config({"checkpoint": {"dir": "c", "resume": False, "save_on_preemption": False}})
    assert cfg.checkpoint.resume is False and cfg.checkpoint.save_on_preemption is False
    assert load_config({}).checkpoint.resume is True and load_config({}).checkpoint.save_on_preemption is True
    for field in ("resume", "save_on_preemption"):
        with pytest.raises(ConfigError, match=f"checkpoint.{field}"):
            load_config({"checkpoint": {field: "no"}})


def _dtrain(warm_python, args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    proc = warm_python(["-m", "distributed_training", *args], cwd=cwd, env=env, timeout=240)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dtrain_rerun_of_a_finished_job_trains_nothing_and_no_resume_starts_over(tmp_path, warm_python):
    config = {
        "model": {"target": "torch.nn:Linear", "kwargs": {"in_features": 64, "out_features": 10}},
        "data": {"dataset": "digits"},
        "training": {"max_steps": 4, "batch_size": 16},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "every": 2},
    }
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(config))
    code, out = _dtrain(warm_python, [str(job)], tmp_path)
    assert code == 0 and "finished at step 4" in out, out[-3000:]
    code, out = _dtrain(warm_python, [str(job)], tmp_path)  # the job is done: nothing to train, success
    assert code == 0 and "the run is already complete at step 4" in out and "| loss" not in out, out[-3000:]
    assert "finished at step" not in out, out[-3000:]  # nor evaluated again
    # another model over the finished run: not "already complete" (it was another run), a config error
    code, out = _dtrain(warm_python, [str(job), "--set", "model.kwargs.bias=false"], tmp_path)
    assert code != 0 and "holds a finished run of another model" in out and "'bias'" in out, out[-3000:]
    assert "--no-resume" in out and "already complete" not in out, out[-3000:]
    code, out = _dtrain(warm_python, [str(job), "--no-resume"], tmp_path)
    assert code == 0 and "step      4 | loss" in out, out[-3000:]
    assert (tmp_path / "ckpt" / "previous_run_1" / "step_000000004").is_dir()
    assert (tmp_path / "ckpt" / "step_000000004").is_dir()


# ------------------------------------------------------------------ 5. a checkpoint is a directory
def _file_named_checkpoint(rank, world, directory):
    torch.manual_seed(0)
    trainer = DistributedTrainer(BNNet(), _sgd())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.save_checkpoint(os.path.join(directory, "last.pt"))
        trainer.save_checkpoint(os.path.join(directory, "last"))
    torch.save(trainer.module.state_dict(), os.path.join(directory, "weights.pt"))
    try:
        trainer.load_checkpoint(os.path.join(directory, "weights.pt"))
        error = None
    except Exception as err:  # noqa: BLE001
        error = (type(err).__name__, str(err))
    trainer.load_checkpoint(os.path.join(directory, "last.pt"))  # still a valid checkpoint, if oddly named
    trainer.close()
    return [str(w.message) for w in caught], error


def test_a_file_like_checkpoint_name_is_warned_about_and_a_file_is_not_a_checkpoint(tmp_path):
    warned, error = run_distributed(_file_named_checkpoint, 1, args=(str(tmp_path),), timeout=60)[0]
    assert len(warned) == 1 and "directory" in warned[0] and "/last'" in warned[0] and ".pt" in warned[0], warned
    assert (tmp_path / "last.pt" / "meta.pt").is_file()
    kind, message = error
    assert kind == "CheckpointCorruptError" and "weights.pt" in message and "not a checkpoint directory" in message


def _fit_twice_ending_on_an_epoch_checkpoint(rank, world, directory):
    """Checkpoints every epoch (6 steps: 48 samples, 2 ranks x 4): the last one is the run's end."""
    results = []
    for _ in range(2):
        logs = _capture_logs()
        torch.manual_seed(0)
        trainer = DistributedTrainer(BNNet(), _sgd(), checkpoint_dir=directory, checkpoint_every=6)
        history = trainer.fit(_data(), epochs=2, criterion=F.mse_loss, batch_size=4)
        results.append(([(h["epoch"], h["steps"]) for h in history], trainer.step, trainer.epoch, logs.messages))
        trainer.close()
    return results


def test_a_run_whose_last_checkpoint_ends_an_epoch_is_complete_on_the_next_start(tmp_path):
    """The checkpoint written after an epoch's last batch records the next epoch's start, so running the
    same fit again trains nothing (it used to resume into an empty epoch: a history row of 0 steps and a
    nan loss)."""
    first, second = run_distributed(_fit_twice_ending_on_an_epoch_checkpoint, 2, args=(str(tmp_path / "c"),),
                                     timeout=120)[0]
    assert first[:3] == ([(0, 6), (1, 6)], 12, 2), first[:3]
    assert second[:3] == ([], 12, 2), second[:3]
    assert any("already complete" in m for m in second[3]), second[3]
    meta = torch.load(tmp_path / "c" / "step_000000006" / "meta.pt", weights_only=True)
    assert (meta["epoch"], meta["batch_in_epoch"], meta["samples_in_epoch"]) == (1, 0, 0)
