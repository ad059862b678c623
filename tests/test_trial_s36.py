"""Defects found in session 36 (trials and the ROADMAP's open points), each tested where it can fail on CPU."""

from __future__ import annotations

import warnings

import torch

from distributed_training.testing import run_distributed


def group_dataset_worker(rank, world):
    """A group of the job's ranks 1 and 2 (as a parameter server's workers are), each with a dataset of
    its own length: the warning names the job's ranks, not the members' indices in the group."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from distributed_training.data import ShardedSampler, agree_steps_per_epoch
    from distributed_training.runtime import DistributedContext

    group = dist.new_group([1, 2])
    if rank == 0:
        return None
    member = rank - 1
    ctx = DistributedContext(rank=member, world_size=2, local_rank=0, local_world_size=1, device=torch.device("cpu"),
                             backend="gloo", group=group)
    data = TensorDataset(torch.zeros(8 + 4 * member, 1))
    sampler = ShardedSampler(data, num_replicas=1, rank=0)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        agree_steps_per_epoch(DataLoader(data, batch_size=2, sampler=sampler), sampler, ctx)
    return [str(w.message) for w in said]


def test_the_dataset_length_warning_names_a_groups_members_by_their_job_rank():
    results = run_distributed(group_dataset_worker, 3, timeout=60)
    for said in results[1:]:
        assert len(said) == 1 and "(rank 1: 8, rank 2: 12)" in said[0], said
