"""Hand-built ring, tree and hierarchical all-reduce equal torch.distributed.all_reduce."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed_training.comm.patterns import hierarchical_all_reduce, ring_all_reduce, tree_all_reduce
from distributed_training.strategies.fsdp import make_hybrid_groups
from distributed_training.testing import run_distributed

LENGTHS = [1, 2, 7, 1000, 12347]
DTYPES = [torch.float32, torch.float64, torch.int64]


def patterns_worker(rank, world, ranks_per_node):
    groups = make_hybrid_groups(ranks_per_node) if ranks_per_node else None
    failures = []
    for dtype in DTYPES:
        for n in LENGTHS:
            g = torch.Generator().manual_seed(1000 * rank + n)
            x = (torch.randn(n, generator=g) * 100).to(dtype)
            expected = x.clone()
            dist.all_reduce(expected)
            candidates = {
                "ring": ring_all_reduce(x.clone(), segment_bytes=64),  # tiny segments: many messages
                "tree": tree_all_reduce(x.clone(), segment_bytes=256),
                "ring_2d": ring_all_reduce(x.clone().view(-1, 1)).view(-1),
            }
            if groups:
                candidates["hierarchical"] = hierarchical_all_reduce(x.clone(), *groups)
            for name, got in candidates.items():
                exact = not dtype.is_floating_point
                ok = torch.equal(got, expected) if exact else torch.allclose(got, expected, rtol=1e-5, atol=1e-4)
                if not ok:
                    failures.append(f"{name} {dtype} n={n}: max diff {(got - expected).abs().max().item()}")
    return failures


@pytest.mark.parametrize("world, ranks_per_node", [(2, 1), (3, None), (4, 2), (5, None)])
def test_patterns_equal_all_reduce(world, ranks_per_node):
    for failures in run_distributed(patterns_worker, world, args=(ranks_per_node,), timeout=120):
        assert not failures, failures[:5]
