"""`fit` on a map-style dataset whose length differs across ranks (each rank its own file): every rank
runs the same number of steps, with a warning naming the lengths, instead of hanging."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from distributed_training import DistributedTrainer
from distributed_training.testing import run_distributed

from _models import MLP


def uneven_fit_worker(rank, world, lengths, as_loader, drop_last):
    torch.manual_seed(rank if len(set(lengths)) > 1 else 0)  # one length: one dataset (per-rank data is warned of)
    n = lengths[rank]
    data = TensorDataset(torch.randn(n, 16), torch.randn(n, 4))
    trainer = DistributedTrainer(MLP(), lambda ps: torch.optim.SGD(ps, lr=0.05))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if as_loader:
            history = trainer.fit(DataLoader(data, batch_size=2, drop_last=drop_last), epochs=2, criterion=F.mse_loss)
        else:
            history = trainer.fit(data, epochs=2, criterion=F.mse_loss, batch_size=2, drop_last=drop_last)
    params = [p.detach().clone() for p in trainer.module.parameters()]
    trainer.close()
    return trainer.step, [h["steps"] for h in history], [str(w.message) for w in caught], params


@pytest.mark.parametrize("as_loader", [False, True], ids=["dataset", "dataloader"])
def test_fit_with_a_different_dataset_length_per_rank_does_not_hang(as_loader):
    results = run_distributed(uneven_fit_worker, 2, args=([10, 17], as_loader, False), timeout=90,
                              collective_timeout=30)
    # 10 samples over 2 ranks: 5 per rank, 3 batches of 2; 17: 9 per rank, 5 batches. Everyone runs 3.
    for step, per_epoch, messages, _ in results:
        assert step == 6 and per_epoch == [3, 3], (step, per_epoch)
        assert any("rank 0: 10, rank 1: 17" in m for m in messages), messages
    for a, b in zip(results[0][3], results[1][3]):  # replicas stayed in step
        assert torch.equal(a, b)


def test_fit_with_equal_lengths_does_not_warn():
    results = run_distributed(uneven_fit_worker, 2, args=([12, 12], False, True), timeout=90, collective_timeout=30)
    for step, per_epoch, messages, _ in results:
        assert step == 6 and per_epoch == [3, 3], (step, per_epoch)
        assert not any("differs across ranks" in m for m in messages), messages
