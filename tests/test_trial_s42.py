"""Session 42: hardening from the session's trials and the ROADMAP's open points."""

from __future__ import annotations

import torch

from distributed_training.testing import run_distributed


def _chain():
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def resumed_fit_worker(rank, world, directory, fits):
    """Each of `fits` (keyword arguments of `fit`, with ``derived``: what a job derived its epochs from)
    trains a new trainer on `directory`'s checkpoints; returns what rank 0 logged."""
    import logging

    import torch.nn.functional as F

    from distributed_training import DistributedTrainer

    g = torch.Generator().manual_seed(2)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g))
    said = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    logging.getLogger("distributed_training").addHandler(Keep())
    for fit in fits:
        fit = dict(fit)
        trainer = DistributedTrainer(_chain(), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False,
                                     checkpoint_dir=directory, checkpoint_every=1)
        if "derived" in fit:
            trainer._fit_derived["epochs"] = fit.pop("derived")  # as dtrain does
        trainer.fit(data, criterion=F.mse_loss, **fit)
        trainer.close()
    return said


def _changes(said: list[str]) -> list[str]:
    return [m for m in said if "the configuration changed since checkpoint" in m]


def test_a_resume_at_another_world_size_says_its_global_batch_changed(tmp_path):
    # fit(batch_size=...) is per replica: resumed at another world size, the global batch changed without a word
    # (session 41's "Left"). With global_batch_size it is kept (and fit says how it is cut), not said here.
    ckpt = str(tmp_path / "ckpt")
    run_distributed(resumed_fit_worker, 2, args=(ckpt, [dict(batch_size=4, max_steps=2)]), timeout=90)
    said = run_distributed(resumed_fit_worker, 1, args=(ckpt, [dict(batch_size=4, max_steps=3)]), timeout=90)[0]
    changed = _changes(said)
    assert len(changed) == 1 and ("data-parallel replicas: 2 -> 1, so the global batch changed (2 x 4 = 8 samples "
                                  "-> 1 x 4 = 4)") in changed[0] and "max_steps: 2 -> 3" in changed[0], said

    kept = str(tmp_path / "kept")
    run_distributed(resumed_fit_worker, 2, args=(kept, [dict(global_batch_size=8, max_steps=2)]), timeout=90)
    said = run_distributed(resumed_fit_worker, 1, args=(kept, [dict(global_batch_size=8, max_steps=3)]), timeout=90)[0]
    assert not any("data-parallel replicas" in m for m in said) and _changes(said), said


def test_a_limit_a_job_derived_is_said_as_derived_when_it_changes_on_resume(tmp_path):
    # dtrain derives its epochs from training.max_steps; a resume whose epochs were not derived said
    # "epochs: 3 -> 1", a 3 the user never wrote.
    fits = [dict(batch_size=8, epochs=3, max_steps=2, derived="derived from training.max_steps"),
            dict(batch_size=8, epochs=1, max_steps=3)]
    said = run_distributed(resumed_fit_worker, 1, args=(str(tmp_path / "ckpt"), fits), timeout=90)[0]
    changed = _changes(said)
    assert len(changed) == 1 and "epochs: 3 (derived from training.max_steps) -> 1" in changed[0], said
