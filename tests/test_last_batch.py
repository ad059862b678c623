"""An epoch's short last step trains exactly the samples left, as one process on them would.

`fit` used to pad that step by wrapping around to a multiple of the data-parallel size (as torch's
`DistributedSampler` does): a few samples trained twice, and the step departed from one process (3.4e-3
in session 43's trial; a resize changed which samples repeated). Now the samples left are split as they
fall, a replica holding one more or one fewer, and each replica's loss is weighed by its rows. Padding
remains only where a replica would get fewer samples than it can run (none; one for a model training
BatchNorm layers).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from distributed_training import DistributedTrainer
from distributed_training.data import ShardedSampler
from distributed_training.testing import run_distributed

from _models import MLP, ConvBN

N, SEED = 23, 5


@pytest.mark.parametrize("n, world, batch, min_rows, expect_padded, short", [
    (23, 3, 3, 1, False, 1),   # 5 left for 3 replicas: 2, 2, 1
    (20, 3, 3, 1, True, 1),    # 2 left: one replica would get none, so padded to 3 (one sample twice)
    (25, 3, 3, 2, False, 2),   # 7 left, at least two a replica: 3, 2, 2
    (22, 3, 3, 2, True, 2),    # 4 left, not two a replica: padded to 6 (2, 2, 2)
    (14, 2, 3, 2, True, 2),    # 2 left, not two a replica: padded to 4 (2, 2), not to a multiple of W (1, 1)
    (13, 2, 4, 4, True, 0),    # 5 left, 4 a replica needed (BatchNorm in 2 micro-batches): padded to 8, whole
    (18, 3, 3, 1, False, 0),   # whole steps
])
def test_the_short_last_step_is_split_as_it_falls(n, world, batch, min_rows, expect_padded, short):
    samplers = [ShardedSampler(range(n), world, r, seed=1, batch_size=batch, min_rows=min_rows)
                for r in range(world)]
    shards = [list(s) for s in samplers]
    steps = {-(-len(shard) // batch) for shard in shards}
    assert len(steps) == 1, f"every replica must run as many steps: {shards}"
    flat = [i for shard in shards for i in shard]
    assert set(flat) == set(range(n))
    assert (len(flat) > n) == expect_padded, shards
    # Step k's global batch is the permutation's positions k*B*W .. (k+1)*B*W - 1, whichever replica holds them.
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1)).tolist()
    if not expect_padded:
        for k in range(steps.pop()):
            held = sorted(i for shard in shards for i in shard[k * batch:(k + 1) * batch])
            assert held == sorted(order[k * batch * world:(k + 1) * batch * world])
    assert min(len(s) % batch or batch for s in shards) == (short or batch)  # the smallest replica's short batch


@pytest.mark.parametrize("n, world, batch, min_rows", [
    (25, 2, 4, 1), (11, 4, 2, 1), (13, 3, 2, 1), (8, 4, 2, 1), (1, 4, 1, 1), (22, 3, 3, 1),
    (14, 2, 3, 2), (13, 2, 4, 4), (20, 3, 3, 2), (3, 4, 2, 2), (25, 2, 4, 2)])  # (BatchNorm: two a micro-batch)
def test_dtrains_iterable_pads_a_last_step_with_fewer_samples_than_replicas_as_the_sampler(n, world, batch,
                                                                                            min_rows):
    """dtrain deals an iterable's samples round-robin (`ShardedIterable`): where fewer than W were left for
    the last step (25 samples, batch 4, W = 2: the 25th), the replicas without one ran out first, every
    rank stopped with them and those samples were never trained (fit warned: session 44's "Left"). Now such
    a replica takes one from the stream's start, as `ShardedSampler` pads in order: every replica runs as
    many steps, and each step holds the samples the sampler deals (without shuffling)."""
    from distributed_training.user_job import ShardedIterable

    dealt = [list(ShardedIterable(range(n), r, world, batch, min_rows)) for r in range(world)]
    sampled = [list(ShardedSampler(range(n), world, r, shuffle=False, batch_size=batch, min_rows=min_rows))
               for r in range(world)]
    assert dealt == sampled, (dealt, sampled)
    assert len({-(-len(shard) // batch) for shard in dealt}) == 1
    assert set(i for shard in dealt for i in shard) == set(range(n))


def _data(n: int = N, shape=(16,), classes: int = 4) -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    return TensorDataset(torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g))


def _reference(base, make_optimizer, data, global_batch: int, epochs: int, seed: int):
    """One process on each whole global batch: the epoch's permutation cut in consecutive runs."""
    model = copy.deepcopy(base)
    optimizer = make_optimizer(model.parameters())
    after = []
    for epoch in range(epochs):
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, len(data), global_batch):
            x, y = data[order[start:start + global_batch]]
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            after.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return after


def exact_tail_worker(rank, world):
    results = {}
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    cases = [("ddp", sgd, dict(batch_size=3)),
             ("zero3", adamw, dict(batch_size=3)),
             # 9 a step in micro-batches of at most 2: the short step's replicas hold 2, 2 and 1
             ("zero2", sgd, dict(global_batch_size=9, micro_batch_size=2))]
    data = _data()
    for strategy, make_optimizer, batching in cases:
        torch.manual_seed(0)
        base = MLP()
        trainer = DistributedTrainer(copy.deepcopy(base), make_optimizer, strategy, seed=SEED, progress=False)
        seen = []
        trainer.fit(data, epochs=2, criterion=F.cross_entropy, shuffle=True, log_every=1,
                    on_step=lambda step, metrics: seen.append(trainer.full_state_dict()), **batching)
        trainer.close()
        reference = _reference(base, make_optimizer, data, 3 * world, 2, SEED)
        assert len(seen) == len(reference) == 6, (len(seen), len(reference))
        if rank == 0:  # (full_state_dict: the whole state on rank 0 only)
            results[strategy] = [max((got[k] - ref[k]).abs().max().item() for k in ref)
                                 for got, ref in zip(seen, reference)]
    return results


def test_fit_trains_the_short_last_step_as_one_process():
    """At W = 3, 23 samples in global batches of 9 leave 5 for each epoch's last step: after every step
    the parameters equal one process on the same global batches (DDP with SGD and momentum, ZeRO-3 with
    AdamW, ZeRO-2 with a global batch cut in micro-batches)."""
    results = run_distributed(exact_tail_worker, 3, timeout=180)
    for strategy, diffs in results[0].items():
        assert max(diffs) < 1e-5, (strategy, diffs)


def batch_norm_tail_worker(rank, world):
    torch.manual_seed(0)
    steps = []
    # 3 left at an epoch's end for 2 replicas (1 and 2), 2 left (1 and 1), and 5 left cut in 2 micro-batches
    # (3 and 2: micro-batches of 2, 1 and 1, 1): each would give a BatchNorm layer one sample.
    for n, batch, accumulation in ((21, 3, 1), (14, 3, 1), (13, 4, 2)):
        trainer = DistributedTrainer(ConvBN(), lambda ps: torch.optim.SGD(ps, lr=0.1), seed=SEED, progress=False,
                                     gradient_accumulation_steps=accumulation)
        history = trainer.fit(_data(n, shape=(3, 4, 4), classes=5), epochs=1, criterion=F.cross_entropy,
                              batch_size=batch)
        trainer.close()
        steps.append(history[0]["steps"])
    return steps


def test_a_batch_norm_model_keeps_two_samples_a_replica_and_micro_batch_in_the_short_step():
    """Split as they fell, the samples left gave a replica (or a micro-batch) one sample, on which training
    BatchNorm fails ("Expected more than 1 value per channel"); that step is padded instead, to two a
    micro-batch (the trial: padded to a multiple of W only, 1 + 1, it still failed)."""
    assert run_distributed(batch_norm_tail_worker, 2, timeout=120) == [[4, 3, 2]] * 2


def pipeline_tail_worker(rank, world):
    from torch import nn

    said = {}
    # interleaved 1F1B needs a sample per pipeline rank: 9 = 8 + 1 left for 2 replicas (batch 4) was refused
    for name, n, schedule, model in (
            ("interleaved", 9, "interleaved_1f1b",
             nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))),
            # BatchNorm in the first stage only: the stages decided apart (one padded, one split: other batches)
            ("batch norm in one stage", 11, "1f1b",
             nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                           nn.Linear(16, 4)))):
        torch.manual_seed(0)
        trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), seed=SEED, progress=False,
                                     pipeline_parallel_size=2, pipeline_schedule=schedule, microbatches=2,
                                     pipeline_split_points=["3"] if schedule == "1f1b" else None)
        history = trainer.fit(_data(n), epochs=1, criterion=F.cross_entropy, batch_size=4)
        trainer.close()
        said[name] = history[0]["steps"]
    return said


def test_a_pipelines_short_step_is_padded_alike_on_every_stage():
    """World 4 = 2 stages x 2 replicas, batches of 4: interleaved 1F1B refused 1 sample left (fewer than its
    2 ranks) instead of padding; with BatchNorm in the first stage only, that stage padded the 3 left to
    2 + 2 and the second split them 2 + 1 ("the ranks of one pipeline passed batches of 1 to 2 samples")."""
    assert run_distributed(pipeline_tail_worker, 4, timeout=180) == [{"interleaved": 2, "batch norm in one stage": 2}] * 4
