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


def own_data_worker(rank, world, same, augmented):
    import warnings

    import torch.nn.functional as F
    from torch.utils.data import Dataset, TensorDataset

    from distributed_training import DistributedTrainer

    class Augmented(Dataset):  # a random flip at every read: its first sample says nothing
        def __init__(self, data):
            self.data = data

        def __len__(self):
            return len(self.data)

        def __getitem__(self, i):
            x, y = self.data[i]
            return (x.flip(0) if torch.rand(()) < 0.5 else x), y

    seed = 0 if same else rank  # each rank's own file, of one length
    data = TensorDataset(torch.randn(32, 4, generator=torch.Generator().manual_seed(seed)), torch.arange(32) % 2)
    torch.manual_seed(0)
    trainer = DistributedTrainer(torch.nn.Linear(4, 2), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False)
    torch.manual_seed(rank)  # each rank's augmentations its own
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Augmented(data) if augmented else data, 1, F.cross_entropy, batch_size=4)
    trainer.close()
    return [str(w.message) for w in caught if "differs across ranks" in str(w.message)]


@pytest.mark.parametrize("same,augmented", [(False, False), (True, False), (False, True), (True, True)])
def test_a_dataset_of_each_ranks_own_of_one_length_is_warned_about(same, augmented):
    # Each rank trained 1/W of its own data, silently (only a length that differed was said). A random
    # augmentation drawn from each rank's own generator does not make one dataset look like two.
    warned = not same
    said = run_distributed(own_data_worker, 2, args=(same, augmented), timeout=90)
    for messages in said:
        assert bool(messages) == warned, messages
    if warned:
        assert "first sample on rank 1 is not rank 0's" in said[0][0] and "1/2 of its own" in said[0][0], said[0]
