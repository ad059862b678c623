"""Session 38's findings, each test failing on the code before its fix."""

from __future__ import annotations

import pytest
import torch

from distributed_training.testing import run_distributed


def ignored_targets_worker(rank, world, ignore_index):
    import functools

    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from distributed_training import DistributedTrainer
    from distributed_training.validation import TopKCount, correct_count

    torch.manual_seed(0)
    trainer = DistributedTrainer(torch.nn.Linear(6, 5), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False)
    x = torch.randn(23, 6, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 5, (23,), generator=torch.Generator().manual_seed(2))
    y[::3] = ignore_index  # a third of the targets ignored (padding, unlabelled samples)
    criterion = functools.partial(F.cross_entropy, ignore_index=ignore_index)
    got = trainer.evaluate(TensorDataset(x, y), criterion, batch_size=4,
                           metrics={"accuracy": correct_count, "top2": TopKCount(2)})
    with torch.no_grad():
        logits = trainer.module(x)
    trainer.close()
    return got, logits, y


@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_accuracy_leaves_out_the_targets_the_criterion_ignores(ignore_index):
    # It divided by every sample, the ignored ones too: at a third ignored, 0.65 of the true accuracy.
    for got, logits, y in run_distributed(ignored_targets_worker, 2, args=(ignore_index,), timeout=90):
        kept = y != ignore_index
        hits = int((logits.argmax(-1) == y)[kept].sum()) / int(kept.sum())
        top2 = int((logits.topk(2, -1).indices == y[:, None]).any(-1)[kept].sum()) / int(kept.sum())
        loss = torch.nn.functional.cross_entropy(logits, y, ignore_index=ignore_index).item()
        assert got["accuracy"] == pytest.approx(hits, abs=1e-12) and got["top2"] == pytest.approx(top2, abs=1e-12)
        assert got["loss"] == pytest.approx(loss, rel=1e-6)
