"""The mesh: rank arithmetic, the members of every group on real processes, emulated nodes, and the
layout read once by the runtime (nothing reads LOCAL_WORLD_SIZE afterwards)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed_training.mesh import DIMS, Mesh, MeshLayout
from distributed_training.testing import run_distributed

# (world, sizes): several shapes per world; None leaves a data dimension to take the rest.
SHAPES = {
    4: [dict(), dict(pipeline=2, tensor=2), dict(data_replicate=2, data_shard=2), dict(tensor=4),
        dict(pipeline=4), dict(pipeline=2, data_replicate=2), dict(data_replicate=2, tensor=2)],
    6: [dict(), dict(pipeline=2, tensor=3), dict(pipeline=3, tensor=2), dict(data_replicate=3, data_shard=2),
        dict(data_replicate=2, tensor=3), dict(pipeline=2, data_replicate=3), dict(data_shard=3, tensor=2)],
}


def expected_members(world: int, sizes: dict, rank: int, dim: str) -> list[int]:
    """Brute force, independent of MeshLayout: enumerate every coordinate in the documented order
    (pipeline outermost, tensor innermost) and keep the ranks that agree with `rank` off `dim`."""
    P, T = sizes.get("pipeline", 1), sizes.get("tensor", 1)
    R = sizes.get("data_replicate") or (world // (P * T) // sizes.get("data_shard", world // (P * T)))
    S = world // (P * T * R)
    grid = {}
    for n, (p, r, s, t) in enumerate(itertools.product(range(P), range(R), range(S), range(T))):
        grid[n] = {"pipeline": p, "data_replicate": r, "data_shard": s, "tensor": t}
    fixed = {"data": ("pipeline", "tensor")}.get(dim, tuple(d for d in DIMS if d != dim))
    return [n for n in range(world) if all(grid[n][d] == grid[rank][d] for d in fixed)]


def test_layout_arithmetic_matches_brute_force():
    for world, shapes in SHAPES.items():
        for sizes in shapes:
            layout = MeshLayout.of(world, **sizes)
            assert layout.world_size == world
            for rank in range(world):
                c = layout.coords(rank)
                assert layout.rank_of(c["pipeline"], c["data_replicate"], c["data_shard"], c["tensor"]) == rank
                assert c["data"] == c["data_replicate"] * layout.data_shard + c["data_shard"]
                for dim in DIMS + ("data",):
                    assert layout.ranks_along(dim, rank) == expected_members(world, sizes, rank, dim), (sizes, dim)
                    assert layout.ranks_along(dim, rank)[c[dim]] == rank  # coordinate = rank in the group
            for dim in DIMS + ("data",):
                groups = layout.groups(dim)
                assert sorted(r for g in groups for r in g) == list(range(world))  # a partition
                assert {len(g) for g in groups} == {layout.size(dim)}


def test_layout_rank_order_is_tensor_innermost():
    layout = MeshLayout.of(8, pipeline=2, data_replicate=2, tensor=2)
    assert layout.data_shard == 1
    assert layout.ranks_along("tensor", 0) == [0, 1]
    assert layout.ranks_along("data_replicate", 0) == [0, 2]
    assert layout.ranks_along("pipeline", 0) == [0, 4]
    assert MeshLayout.of(8, data_shard=2) == MeshLayout(1, 4, 2, 1)
    assert MeshLayout.of(8, data_replicate=2, tensor=2) == MeshLayout(1, 2, 2, 2)


@pytest.mark.parametrize("sizes, message", [
    (dict(pipeline=3), "pipeline x tensor = 3 does not divide the world size 4"),
    (dict(data_shard=3), "data_shard=3 does not divide the 4 data-parallel ranks"),
    (dict(data_replicate=2, data_shard=4), "is not the world size 4"),
    (dict(tensor=0), "tensor must be a positive integer"),
    (dict(pipeline=2.0), "pipeline must be a positive integer"),
])
def test_layout_errors_name_the_degrees(sizes, message):
    with pytest.raises(ValueError, match=message):
        MeshLayout.of(4, **sizes)


def test_node_split_and_its_errors():
    layout = MeshLayout.of(8, tensor=2)  # data-parallel groups: even ranks, odd ranks
    intra, inter = layout.node_split(4)
    assert intra == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert inter == [[0, 4], [2, 6], [1, 5], [3, 7]]
    with pytest.raises(ValueError, match="must divide the world size 8"):
        layout.node_split(3)
    with pytest.raises(ValueError, match="unequal parts"):
        MeshLayout.of(12, tensor=4).node_split(6)  # one data-parallel group has 2 ranks on a node, 1 on the next
    with pytest.raises(ValueError, match="unequal parts"):
        MeshLayout.of(12, pipeline=3).node_split(6)  # stage 0 has 4 on one node, stage 1 has 2 and 2


def _members(group) -> list[int]:
    """Global ranks of `group`'s members, in group-rank order, as the group itself says (a collective)."""
    mine = torch.tensor([dist.get_rank()])
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [int(t) for t in out]


def mesh_groups_worker(rank, world, shapes):
    report = []
    for sizes in shapes:
        mesh = Mesh(world, **sizes)
        for dim in DIMS + ("data",):
            group = mesh.group(dim)
            report.append((str(sizes), dim, _members(group), mesh.rank(dim), dist.get_rank(group), mesh.size(dim),
                           dist.get_world_size(group), group is None))
        report.append((str(sizes), "dp", mesh.dp_rank, mesh.dp_size))
    # Emulated nodes: node groups of the data-parallel group, and the hybrid split, at two node sizes.
    for per_node in (1, 2, world // 2, world):
        mesh = Mesh(world, ranks_per_node=per_node)
        intra, inter = mesh.node_groups()
        hybrid = mesh.hybrid()
        report.append(("nodes", per_node, _members(intra), _members(inter), mesh.node, mesh.num_nodes,
                       _members(hybrid.group("data_shard")), _members(hybrid.group("data_replicate")),
                       hybrid.size("data_shard"), hybrid.size("data_replicate"), hybrid.dp_rank))
    # Node groups of a mesh with tensor parallelism: only the data-parallel peers on the node.
    mesh = Mesh(world, tensor=2, ranks_per_node=world // 2 if world % 4 == 0 else world)
    intra, inter = mesh.node_groups()
    report.append(("tp-nodes", _members(intra), _members(inter)))
    return report


@pytest.mark.parametrize("world", [4, 6])
def test_mesh_groups_hold_exactly_the_right_ranks(world):
    shapes = SHAPES[world]
    reports = run_distributed(mesh_groups_worker, world, args=(shapes,), timeout=180)
    for rank, report in enumerate(reports):
        entries = iter(report)
        for sizes in shapes:
            for dim in DIMS + ("data",):
                label, d, members, coord, group_rank, size, group_size, is_default = next(entries)
                assert (label, d) == (str(sizes), dim)
                want = expected_members(world, sizes, rank, dim)
                assert members == want, (rank, sizes, dim)
                assert coord == group_rank == want.index(rank)
                assert size == group_size == len(want)
                assert is_default == (len(want) == world)  # the whole world reuses the default group
            label, _, dp_rank, dp_size = next(entries)
            layout = MeshLayout.of(world, **sizes)
            assert dp_size == layout.data_replicate * layout.data_shard
            assert dp_rank == expected_members(world, sizes, rank, "data").index(rank)
        for per_node in (1, 2, world // 2, world):
            (_, n, intra, inter, node, num_nodes, shard, replicate, shard_size, replicate_size, dp_rank) = next(entries)
            assert n == per_node
            first = rank - rank % per_node
            assert intra == list(range(first, first + per_node))
            assert inter == list(range(rank % per_node, world, per_node))
            assert (node, num_nodes) == (rank // per_node, world // per_node)
            assert (shard, replicate) == (intra, inter)  # hybrid: shard in a node, replicate across
            assert (shard_size, replicate_size) == (per_node, world // per_node)
            assert dp_rank == rank
        _, intra, inter = next(entries)
        per_node = world // 2 if world % 4 == 0 else world
        same_t = [r for r in range(world) if r % 2 == rank % 2]
        assert intra == [r for r in same_t if r // per_node == rank // per_node]
        assert inter == [r for r in same_t if r % per_node == rank % per_node]


def mesh_over_subgroup_worker(rank, world):
    # A mesh over a subgroup: mesh ranks are that group's ranks; group creation involves every rank.
    sub = dist.new_group([1, 2, 3])
    if rank == 0:
        return None
    mesh = Mesh(group=sub, data_replicate=3)
    return (mesh.rank(), mesh.size(), _members(mesh.group("data_replicate")), mesh.group("data") is sub,
            _members(mesh.group("data_shard")))


def test_mesh_over_a_subgroup():
    got = run_distributed(mesh_over_subgroup_worker, 4, timeout=120)
    assert got[0] is None
    for rank in (1, 2, 3):
        mesh_rank, size, replicate, data_is_sub, shard = got[rank]
        assert (mesh_rank, size, replicate, data_is_sub, shard) == (rank - 1, 3, [1, 2, 3], True, [rank])


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6) for _ in range(2)])
        self.head = nn.Linear(6, 1)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def layout_read_once_worker(rank, world):
    from distributed_training import CommunicationOptimizer, DistributedTrainer, FSDPStrategy, init_distributed

    # The launcher says: nodes of 2. After the runtime has read it, the environment changes (to
    # nonsense): everything must follow the context, so nothing may read it again.
    os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"] = "2", str(rank % 2)
    ctx = init_distributed()
    os.environ["LOCAL_WORLD_SIZE"] = "not a number"
    os.environ["WORLD_SIZE"] = "not a number"
    os.environ["LOCAL_RANK"] = "not a number"
    assert (ctx.mesh.ranks_per_node, ctx.mesh.node) == (2, rank // 2)

    torch.manual_seed(0)
    fsdp = DistributedTrainer(_Tiny(), lambda ps: torch.optim.SGD(ps, lr=0.1), context=ctx,
                              strategy=FSDPStrategy(sharding_strategy="hybrid"))
    shard = _members(fsdp.model.shard_group)
    replicate = _members(fsdp.model.replicate_group)
    fsdp.close()

    comm = CommunicationOptimizer(hierarchical=True)
    torch.manual_seed(0)
    ddp = DistributedTrainer(_Tiny(), lambda ps: torch.optim.SGD(ps, lr=0.1), context=ctx, strategy="ddp",
                             communication=comm)
    intra, inter = (_members(g) for g in comm._groups)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
    ddp.train_step((x, y), nn.functional.mse_loss)
    after = [p.detach().clone() for p in ddp.module.parameters()]
    ddp.close()

    # Reference: the same step on every rank's batch at once, in one process.
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    batches = [(torch.randn(8, 6, generator=gg), torch.randn(8, 1, generator=gg)) for gg in gens]
    torch.manual_seed(0)
    ref = _Tiny()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    loss = sum(nn.functional.mse_loss(ref(bx), by) for bx, by in batches) / world
    loss.backward()
    opt.step()
    diff = max((a - b).abs().max().item() for a, b in zip(after, ref.parameters()))
    return shard, replicate, intra, inter, ddp.dp_rank, ddp.dp_world_size, diff


def test_layout_is_read_once_by_the_runtime():
    for rank, (shard, replicate, intra, inter, dp_rank, dp_world, diff) in enumerate(
            run_distributed(layout_read_once_worker, 4, timeout=180)):
        node = [rank - rank % 2, rank - rank % 2 + 1]
        assert shard == intra == node
        assert replicate == inter == [rank % 2, rank % 2 + 2]
        assert (dp_rank, dp_world) == (rank, 4)
        assert diff < 1e-6


def dp_sharding_worker(rank, world):
    """With tensor parallelism of 2 (the trainer lays the mesh out as data x tensor), the two
    tensor-parallel peers feed one replica: fit must give them the same samples, and the replicas
    distinct ones. The model is the identity, split between the peers (each holds half of a hidden
    layer of width 2: their partial outputs sum to x)."""
    from distributed_training import DistributedTrainer, init_distributed
    from distributed_training.data import train_loader

    ctx = init_distributed()
    model = nn.Sequential(nn.Linear(1, 2), nn.Linear(2, 1))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0], [0.0]]))
        model[1].weight.copy_(torch.tensor([[1.0, 0.0]]))
        model[0].bias.zero_()
        model[1].bias.zero_()
    trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), context=ctx, tensor_parallel_size=2,
                                 tensor_parallel_plan={"0": "colwise", "1": "rowwise"})
    assert ctx.mesh.size("tensor") == 2
    data = torch.utils.data.TensorDataset(torch.arange(12.0))
    loader = train_loader(data, ctx, batch_size=12, shuffle=True, drop_last=False, num_workers=0, seed=3,
                          dp_rank=trainer.dp_rank, dp_world_size=trainer.dp_world_size)
    seen = sorted(int(v) for (batch,) in loader for v in batch)
    # evaluate() too: every sample counted once per replica, so the mean is the whole dataset's.
    xy = torch.utils.data.TensorDataset(torch.arange(10.0).view(10, 1), torch.zeros(10, 1))
    evaluated = []

    def criterion(outputs, targets):
        evaluated.extend(int(v) for v in outputs.flatten())  # the model is the identity here
        return torch.nn.functional.mse_loss(outputs, targets)

    mean = trainer.evaluate(xy, criterion, batch_size=3)["loss"]
    trainer.close()
    return trainer.dp_rank, trainer.dp_world_size, seen, (mean, sorted(evaluated))


def test_dp_rank_shards_data_by_replica():
    got = run_distributed(dp_sharding_worker, 4, timeout=120)
    assert [(r, n) for r, n, _, _ in got] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert got[0][2] == got[1][2] and got[2][2] == got[3][2]
    assert sorted(got[0][2] + got[2][2]) == list(range(12))
    want = sum(float(i) ** 2 for i in range(10)) / 10  # (x - 0)^2 averaged over the dataset, each once
    assert all(abs(mean - want) < 1e-5 for _, _, _, (mean, _) in got), [m for *_, m in got]
    evaluated = [e for *_, (_, e) in got]
    assert evaluated[0] == evaluated[1] and evaluated[2] == evaluated[3], evaluated  # peers: the same samples
    assert sorted(evaluated[0] + evaluated[2]) == list(range(10)), evaluated


def wrappers_on_a_subgroup_worker(rank, world):
    """The public wrappers given a process group (no mesh): DDP averages over that group only, and
    FSDP's hybrid sharding with emulated nodes of one rank replicates over it."""
    from distributed_training import DDP, FSDP

    sub = dist.new_group([1, 2, 3])
    if rank == 0:
        return None
    torch.manual_seed(0)
    ddp = DDP(nn.Linear(3, 1), process_group=sub)
    torch.manual_seed(0)
    fsdp = FSDP(_Tiny(), process_group=sub, sharding_strategy="hybrid", ranks_per_node=1)
    x = torch.full((2, 3), float(rank))
    ddp(x).sum().backward()
    grad = ddp.module.weight.grad.clone()
    return grad, fsdp.shard_world, fsdp.replicate_world, _members(fsdp.process_group)


def test_public_wrappers_on_a_process_group():
    got = run_distributed(wrappers_on_a_subgroup_worker, 4, timeout=120)
    assert got[0] is None
    for rank in (1, 2, 3):
        grad, shard_world, replicate_world, members = got[rank]
        # d(sum(w.x + b))/dw = sum of x's rows = 2 * rank per entry; the mean over ranks 1..3 is 4.
        assert torch.allclose(grad, torch.full((1, 3), 4.0))
        assert (shard_world, replicate_world, members) == (1, 3, [1, 2, 3])
