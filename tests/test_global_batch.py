"""`fit(global_batch_size=...)`: the same training at any data-parallel size (issue 17, item 2).

A job trained at world 2 for a few steps, with checkpoints, is resumed at world 1 and at world 3. After
every optimizer step the parameters must equal one process trained by a plain loop (no trainer) on the
same global batches, and every sample of each epoch must be trained exactly once across the restart:
the dataset's targets carry each sample's index, which the criterion records. Micro-batches of at most
3 samples make the accumulation differ at each size (2 at world 2, 4 at world 1, 2 at world 3).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils.data import Dataset

from distributed_training import DistributedTrainer
from distributed_training.global_batch import plan_global_batch, valid_data_parallel_sizes
from distributed_training.testing import run_distributed

REPO = Path(__file__).resolve().parents[1]

N, B, SEED, LR, MOMENTUM = 48, 12, 7, 0.1, 0.9
EPOCHS, STOP = 2, 3  # 8 steps of 12 in all (4 an epoch); the first job stops at step 3, mid-epoch


class Indexed(Dataset):
    """(x, [y, index]) pairs: the target's last column is the sample's index, for counting."""

    def __init__(self, n: int = N) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 4, generator=g)
        self.y = torch.randn(n, 2, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], torch.cat([self.y[i], torch.tensor([float(i)])])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _train(rank, world, directory, max_steps, global_batch, allow=False, strategy="ddp"):
    """Train (resuming from `directory`); return per step: (indices this rank trained, parameters, lr)."""
    seen: list[int] = []

    def criterion(out, target):
        seen.extend(int(i) for i in target[:, -1].tolist())
        return F.mse_loss(out, target[:, :-1])

    logger = logging.getLogger("distributed_training")
    logger.setLevel(logging.INFO)
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger.addHandler(handler)
    trainer = DistributedTrainer(_model(), lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM),
                                 strategy, gradient_accumulation_steps=2, seed=SEED, checkpoint_dir=directory,
                                 checkpoint_every=1, progress=False)
    steps = {}

    def on_step(step, metrics):
        steps[step] = (list(seen), _params(trainer.module), metrics["lr"])
        seen.clear()

    trainer.fit(Indexed(), epochs=EPOCHS, criterion=criterion, global_batch_size=global_batch, max_steps=max_steps,
                log_every=1, on_step=on_step, allow_global_batch_change=allow)
    plan = trainer.global_batch
    trainer.close()
    logger.removeHandler(handler)
    return steps, (plan.per_rank, plan.accumulation, plan.size), messages


def _reference(global_batch=B, lr=LR, steps=EPOCHS * N // B):
    """One process, a plain loop: step s of epoch e trains positions [s B, (s + 1) B) of the epoch's
    permutation (seeded by seed + epoch, as `ShardedSampler` draws it) as one batch."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    data = Indexed()
    out, step = {}, 0
    for epoch in range(EPOCHS):
        order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        for start in range(0, N - global_batch + 1, global_batch):
            idx = order[start:start + global_batch]
            loss = F.mse_loss(model(data.x[idx]), data.y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            out[step] = (sorted(idx), _params(model))
            if step == steps:
                return out
    return out


def _check_step(step, job, expected):
    """Every rank of `job` (what `_train` returned on each) at `step` against the reference."""
    indices = sorted(i for steps, *_ in job for i in steps[step][0])
    assert indices == expected[step][0], f"step {step}: trained samples {indices}, expected {expected[step][0]}"
    for r, (steps, *_) in enumerate(job):
        for got, want in zip(steps[step][1], expected[step][1]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"step {step} rank {r}: {m}")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_resume_at_another_world_size_keeps_the_global_batch_and_the_sample_position(tmp_path, strategy):
    expected = _reference()
    first = run_distributed(_train, 2, args=(str(tmp_path / "w2"), STOP, B, False, strategy), timeout=180)
    assert [r[1] for r in first] == [(6, 2, 12)] * 2  # 6 a rank, in 2 micro-batches of 3
    for step in range(1, STOP + 1):
        _check_step(step, first, expected)
    for world, cut in ((1, (12, 4, 12)), (3, (4, 2, 12))):
        directory = tmp_path / f"w{world}"
        shutil.copytree(tmp_path / "w2", directory)
        resumed = run_distributed(_train, world, args=(str(directory), None, B, False, strategy), timeout=180)
        assert [r[1] for r in resumed] == [cut] * world
        assert sorted(resumed[0][0]) == list(range(STOP + 1, EPOCHS * N // B + 1))
        for step in range(STOP + 1, EPOCHS * N // B + 1):
            _check_step(step, resumed, expected)
        # Each epoch's samples exactly once over both jobs (all ranks of each).
        for epoch in range(EPOCHS):
            counts = [0] * N
            for job in (first, resumed):
                for steps, *_ in job:
                    for step, (indices, *_) in steps.items():
                        if (step - 1) // (N // B) == epoch:
                            for i in indices:
                                counts[i] += 1
            assert counts == [1] * N, f"world {world}, epoch {epoch}: samples trained {counts}"
        said = " ".join(resumed[0][2])
        assert f"global batch 12 = {world} data-parallel replica(s) x {cut[0]} sample(s)" in said
        assert "the checkpoint was trained at 2 x 6 in 2 micro-batch(es) = 12; the epoch continues at sample 36" in said


def _refused(rank, world, directory):
    try:
        _train(rank, world, directory, 2, 9)
    except ValueError as err:
        return str(err)
    return None


def test_a_global_batch_the_size_cannot_keep_is_refused_naming_the_valid_sizes(tmp_path):
    messages = run_distributed(_refused, 2, args=(str(tmp_path / "c"),), timeout=120)
    for message in messages:
        assert message is not None and "global_batch_size=9" in message
        assert "the data-parallel sizes that keep it are 1, 3, 9" in message
        assert "allow_global_batch_change=True" in message


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_allowed_change_scales_the_learning_rate_linearly(tmp_path):
    # 9 at 2 replicas: 8 (4 a replica), lr x 8/9; the same as one process on batches of 8 at that rate.
    ranks = run_distributed(_train, 2, args=(str(tmp_path / "c"), 3, 9, True), timeout=180)
    expected = _reference(global_batch=8, lr=LR * 8 / 9, steps=3)
    assert [r[1] for r in ranks] == [(4, 2, 8)] * 2
    for step in (1, 2, 3):
        _check_step(step, ranks, expected)
        assert float(ranks[0][0][step][2]) == pytest.approx(LR * 8 / 9)
    assert any("training a global batch of 8, with the learning rate scaled by 8/9" in m for m in ranks[0][2])


def _bad_arguments(rank, world):
    trainer = DistributedTrainer(_model(), lambda ps: torch.optim.SGD(ps, lr=LR), progress=False)
    errors = []
    for kwargs in ({"global_batch_size": 4, "batch_size": 2}, {"micro_batch_size": 2},
                   {"global_batch_size": 4, "micro_batch_size": 0}, {"global_batch_size": 0}):
        try:
            trainer.fit(Indexed(), criterion=F.mse_loss, **kwargs)
        except ValueError as err:
            errors.append(str(err))
    for batches in ([(torch.randn(2, 4), torch.randn(2, 2))], iter([(torch.randn(2, 4), torch.randn(2, 2))])):
        try:
            trainer.fit(batches, criterion=F.mse_loss, global_batch_size=4)
        except ValueError as err:
            errors.append(str(err))
    trainer.close()
    return errors


def test_bad_arguments_name_the_parameter():
    errors = run_distributed(_bad_arguments, 1, timeout=120)[0]
    assert len(errors) == 6
    assert "batch_size=2" in errors[0] and "global_batch_size" in errors[0]
    assert "micro_batch_size=...) needs global_batch_size" in errors[1]
    assert "micro_batch_size must be a positive integer" in errors[2]
    assert "global_batch_size must be a positive integer" in errors[3]
    assert "global_batch_size=4) with a list: is it a list of samples or of batches?" in errors[4]
    assert "needs a map-style Dataset" in errors[5] and "list_iterator" in errors[5]


def test_plan():
    assert valid_data_parallel_sizes(12) == [1, 2, 3, 4, 6, 12]
    plan = plan_global_batch(12, 3).with_micro_batch(3)
    assert (plan.per_rank, plan.accumulation, plan.lr_scale) == (4, 2, 1.0)
    assert plan_global_batch(6, 4, allow_change=True).size == 4  # 1.5 a replica: the smaller on a tie
    assert plan_global_batch(10, 4, allow_change=True).size == 8  # 8 and 12 as near: the smaller
    assert plan_global_batch(11, 4, allow_change=True).size == 12
    with pytest.raises(ValueError, match=r"world sizes 2, 6, 18 at 2 ranks a replica"):
        plan_global_batch(9, 2, others=2)


# ------------------------------------------------------------------ dtrain: training.global_batch_size
@pytest.mark.parametrize("training, field", [
    ({"global_batch_size": 8, "batch_size": 4}, "training.batch_size"),
    ({"micro_batch_size": 2}, "training.micro_batch_size needs training.global_batch_size"),
    ({"global_batch_size": 0}, "training.global_batch_size"),
    ({"global_batch_size": 8, "pipeline_parallel_size": 2}, "training.global_batch_size with"),
])
def test_dtrain_global_batch_fields_are_checked(training, field):
    from distributed_training.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(field)):
        load_config({"training": training})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dtrain_resumes_a_global_batch_at_another_world_size(tmp_path, warm_python, warm_torchrun):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    # a small validation split: the final evaluation of the whole default one took most of the test's time
    config = {"model": {"preset": "tiny"}, "data": {"dataset": "repo_text", "block_size": 16, "val_fraction": 0.005},
              "training": {"strategy": "zero3", "max_steps": 2, "global_batch_size": 8, "micro_batch_size": 2,
                           "seed": 0},
              "checkpoint": {"dir": str(tmp_path / "ckpt"), "every": 1}, "logging": {"progress": False}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    out = warm_torchrun("distributed_training", [str(path)], nproc=2, env=env, cwd=REPO, timeout=180, module=True)
    said = out.stdout + out.stderr
    assert out.returncode == 0, said[-3000:]
    assert "global batch 8 = 2 data-parallel replica(s) x 4 sample(s) in 2 micro-batch(es) of at most 2" in said
    config["training"]["max_steps"] = 3
    path.write_text(yaml.safe_dump(config))
    out = warm_python(["-m", "distributed_training", str(path)], cwd=REPO, env=env, timeout=180)
    said = out.stdout + out.stderr
    assert out.returncode == 0, said[-3000:]
    assert ("global batch 8 = 1 data-parallel replica(s) x 8 sample(s) in 4 micro-batch(es) of at most 2 (the "
            "checkpoint was trained at 2 x 4 in 2 micro-batch(es) = 8; the epoch continues at sample 16)") in said, \
        said[-3000:]
    assert "finished at step 3" in said


def _resume_identically(rank, world, directory):
    """Three fits at world 1 with the same global batch of 12: micro-batches of 3 (accumulation 4) to
    step 2, the same to step 3, then micro-batches of 6 (accumulation 2) to step 4. Returns the log."""
    messages = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("distributed_training")
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    try:
        for steps, micro in ((2, 3), (3, 3), (4, 6)):
            with DistributedTrainer(_model(), lambda ps: torch.optim.SGD(ps, lr=LR), checkpoint_dir=directory,
                                    checkpoint_every=1, progress=False) as trainer:
                trainer.fit(Indexed(), epochs=EPOCHS, criterion=lambda out, t: F.mse_loss(out, t[:, :-1]),
                            global_batch_size=B, micro_batch_size=micro, max_steps=steps)
                messages.append(f"--- accumulation {trainer.gradient_accumulation_steps}")
    finally:
        logger.removeHandler(handler)
        logger.level = level
    return messages


def test_an_identical_resume_reports_no_change_of_the_accumulation(tmp_path):
    """The checkpoint records the accumulation the global batch resolved to (4), the trainer was built
    with 1: comparing those said "gradient_accumulation_steps: 4 -> 1" on an unchanged resume."""
    messages = run_distributed(_resume_identically, 1, args=(str(tmp_path / "c"),), timeout=120)[0]
    changed = [m for m in messages if "configuration changed" in m]
    assert len(changed) == 2 and all("gradient_accumulation_steps" not in m for m in changed), changed
    assert "max_steps: 2 -> 3" in changed[0] and "max_steps: 3 -> 4" in changed[1], changed
    assert [m for m in messages if m.startswith("---")] == ["--- accumulation 4"] * 2 + ["--- accumulation 2"]
    # A micro-batch that did change is said where the global batch is: with what the checkpoint trained.
    assert any("in 2 micro-batch(es) of at most 6 (the checkpoint was trained in 4 micro-batch(es) of at most 3)"
               in m for m in messages), messages


@pytest.mark.timeout(300)
def test_the_micro_batch_limit_survives_a_pass_through_a_larger_world(tmp_path):
    """Micro-batches of at most 6 (12 at world 1 over the configured 2 passes); at world 3 a replica's
    share, 4, cut them to 4, and the checkpoint kept that cut as the limit: back at world 1 the step ran
    in 3 passes of 4 instead of 2 of 6 (the same result, more passes)."""
    directory, expected = str(tmp_path / "c"), _reference()
    cuts = []
    for world, steps in ((1, 1), (3, 2), (1, 3)):
        job = run_distributed(_train, world, args=(directory, steps, B), timeout=180)
        cuts.append(job[0][1])
        _check_step(steps, job, expected)
    assert cuts == [(12, 2, 12), (4, 1, 12), (12, 2, 12)]
