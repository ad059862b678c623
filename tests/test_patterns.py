"""Hand-built ring, tree and hierarchical all-reduce equal torch.distributed.all_reduce."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed_training.comm import patterns
from distributed_training.comm.patterns import hierarchical_all_reduce, ring_all_reduce, ring_lanes, tree_all_reduce
from distributed_training.strategies.fsdp import make_hybrid_groups
from distributed_training.testing import run_distributed

from _once import once_per_key

# Each world's parts (the workers of the selected tests at that world size) run in one job, `world_job`
# at the end: a job per test made 15 launches of 2-5 processes and their process groups. Its limit is
# the sum of its parts' former limits, at most 600 s (world 4's six parts take ~15 s on 2 loaded
# cores): a hang stays a failure; the tests wait for it within pytest's own limit, raised past that.
LIMITS = {"patterns_worker": 120, "sums_worker": 180, "lanes_worker": 120, "subgroup_worker": 120,
          "hierarchical_worker": 120, "flat_path_worker": 60, "bad_knobs_worker": 60}
JOB_LIMIT = 600
waits_for_its_world = pytest.mark.timeout(JOB_LIMIT + 60)

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
            # Tiny segments: many messages (on 1000 elements 13-63 segments a ring chunk, 8-16 a tree
            # half, all more than the buffers). On the long input 16x larger ones keep about as many
            # (ring 10-49, tree 7-13); 64 B there cut a chunk into 155-772, 1,000-6,000 messages a call
            # on gloo: four fifths of this test, for nothing the ring or the tree does by length.
            long = n > 1000
            candidates = {
                "ring": ring_all_reduce(x.clone(), segment_bytes=1024 if long else 64),
                "tree": tree_all_reduce(x.clone(), segment_bytes=4096 if long else 256),
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
@waits_for_its_world
def test_patterns_equal_all_reduce(world, ranks_per_node, world_job):
    for failures in world_job(world, "patterns_worker", ranks_per_node):
        assert not failures, failures[:5]


# Lengths below the world size, not divisible by the world or by any segment, and a 2-D one. (257,) is
# the long one: 12-byte segments cut its chunk into 11-43 of them (1031's 43-172 were 4x the messages, a
# third of the sums test and half the lanes test, for nothing the ring or the tree does by length).
SHAPES = [(1,), (3,), (5,), (97,), (257,), (33, 7)]
# (pattern, keyword arguments): automatic and tiny segments (many messages, several in flight), one
# message at a time, more buffers than segments, segments that are not a whole number of elements.
VARIANTS = [("ring", {}), ("ring", {"segment_bytes": 12, "in_flight": 1}), ("ring", {"segment_bytes": 40, "in_flight": 2}),
            ("ring", {"segment_bytes": 64, "in_flight": 7}), ("ring", {"segment_bytes": 2}),
            ("tree", {}), ("tree", {"segment_bytes": 12}), ("tree", {"segment_bytes": 100}), ("tree", {"segment_bytes": 2})]
PATTERNS = {"ring": ring_all_reduce, "tree": tree_all_reduce}


def _exact_sum(x: torch.Tensor, group=None) -> tuple[torch.Tensor, float]:
    """The sum of every rank's `x` in float64 (one all-gather of the inputs), and the largest |input|."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    stacked = torch.stack([p.double() for p in parts])
    return stacked.sum(0), stacked.abs().max().item()


def _same_on_every_rank(t: torch.Tensor, group=None) -> bool:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return all(torch.equal(p, parts[0]) for p in parts)


def _check_sum(name, got, x, exact, scale, group, failures):
    world = dist.get_world_size(group)
    eps = torch.finfo(x.dtype).eps
    tol = 2 * world * eps * scale  # each of the W - 1 adds rounds once, to at most the sum of |inputs|
    err = (got.double() - exact).abs().max().item()
    if got.shape != x.shape or got.dtype != x.dtype or not err <= tol:
        failures.append(f"{name} {x.dtype} {tuple(x.shape)}: max error {err:.3g} > {tol:.3g}")
    if not _same_on_every_rank(got, group):
        failures.append(f"{name} {x.dtype} {tuple(x.shape)}: ranks disagree")


def sums_worker(rank, world):
    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES:
            g = torch.Generator().manual_seed(7919 * rank + sum(shape))
            x = (torch.randn(shape, generator=g) * 10).to(dtype)
            exact, scale = _exact_sum(x)
            for pattern, kw in VARIANTS:
                if kw.get("segment_bytes") == 2 and x.numel() > 256:
                    # Segments below one element send one element a message: on the long input that is
                    # one message an element, for what (97,) and (33, 7) show already (the rounding up
                    # to whole elements, more segments than buffers, a 2-D input).
                    continue
                got = x.clone()
                back = PATTERNS[pattern](got, **kw)
                if back is not got:
                    failures.append(f"{pattern} {kw}: did not return its input (in place)")
                _check_sum(f"{pattern} {kw}", got, x, exact, scale, None, failures)
            if x.dim() == 2:
                for pattern in PATTERNS:  # a non-contiguous input is reduced through a copy
                    got = x.clone().t()
                    PATTERNS[pattern](got, segment_bytes=20)
                    _check_sum(f"{pattern} non-contiguous", got, x.t(), exact.t(), scale, None, failures)
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
@waits_for_its_world
def test_ring_and_tree_sum_exactly_enough_and_agree(world, world_job):
    """fp32 and bf16, lengths below the world size and not divisible by the world or the segment,
    every knob: the float64 sum of all inputs within the rounding of W - 1 adds, the same bits on
    every rank."""
    for failures in world_job(world, "sums_worker"):
        assert not failures, failures[:5]


def subgroup_worker(rank, world):
    """A group that is not the world, with ranks out of order: group ranks must map to global ranks."""
    failures = []
    members = [3, 1, 0] if world == 4 else [1, 0]
    group = dist.new_group(members)
    if rank in members:
        x = torch.arange(11, dtype=torch.float32) * (rank + 1)
        exact, scale = _exact_sum(x, group)
        for pattern, kw in VARIANTS:
            got = PATTERNS[pattern](x.clone(), group, **kw)
            _check_sum(f"{pattern} {kw} subgroup", got, x, exact, scale, group, failures)
    dist.barrier()
    return failures


def lanes_worker(rank, world):
    """The ring with its segments spread over lanes (more groups over the same ranks; on NCCL each
    has its own stream): explicit and automatic segments, fewer buffers than lanes, on the world and
    on a subgroup with ranks out of order; `ring_lanes` makes none on gloo."""
    failures = []
    if ring_lanes() != []:
        failures.append("ring_lanes made lanes on gloo")
    members = [3, 1, 0] if world == 4 else list(range(world))
    sub = dist.new_group(members)
    sub_lanes = [dist.new_group(members) for _ in range(3)]
    world_lanes = [dist.new_group(list(range(world))) for _ in range(3)]
    saved = patterns._LANE_MIN, patterns._sendrecv
    used = []  # the group of every message posted

    def recording(ops, group):
        used.append(group)
        return saved[1](ops, group)

    patterns._LANE_MIN = 16  # automatic segments: one per lane of at least 16 bytes
    patterns._sendrecv = recording
    try:
        for group, lanes in ((None, world_lanes), (sub, sub_lanes)):
            if group is not None and rank not in members:
                continue
            for shape in [(5,), (97,), (257,), (33, 7)]:
                g = torch.Generator().manual_seed(17 * rank + sum(shape))
                x = torch.randn(shape, generator=g) * 10
                exact, scale = _exact_sum(x, group)
                for kw in ({}, {"segment_bytes": 12}, {"segment_bytes": 40, "in_flight": 1}, {"in_flight": 2}):
                    for count in (1, 2, 3):
                        used.clear()
                        got = ring_all_reduce(x.clone(), group, lanes=lanes[:count], **kw)
                        where = "world" if group is None else "subgroup"
                        _check_sum(f"ring {kw} lanes={count + 1} {where}", got, x, exact, scale, group, failures)
                        # A chunk long enough for a segment per lane sends through every lane.
                        if shape == (257,) and {id(g) for g in used} != {id(g) for g in [group, *lanes[:count]]}:
                            failures.append(f"ring {kw} lanes={count + 1} {where} {shape}: messages went through "
                                            f"{len({id(g) for g in used})} groups, not {count + 1}")
    finally:
        patterns._LANE_MIN, patterns._sendrecv = saved
    dist.barrier()
    return failures


@pytest.mark.parametrize("world", [3, 4])
@waits_for_its_world
def test_ring_over_lanes(world, world_job):
    for failures in world_job(world, "lanes_worker"):
        assert not failures, failures[:5]


@pytest.mark.parametrize("world", [3, 4])
@waits_for_its_world
def test_patterns_on_a_subgroup(world, world_job):
    for failures in world_job(world, "subgroup_worker"):
        assert not failures, failures[:5]


def hierarchical_worker(rank, world):
    """Every node layout: one node (the flat all-reduce), nodes of one rank, and real splits; odd
    lengths (padding) and lengths divisible by the node size (no copy)."""
    failures = []
    layouts = [n for n in range(1, world + 1) if world % n == 0]
    for per_node in layouts:
        intra, inter = make_hybrid_groups(per_node)
        for dtype in (torch.float32, torch.bfloat16):
            for shape in [(1,), (5,), (12,), (1031,), (6, 4)]:
                g = torch.Generator().manual_seed(31 * rank + sum(shape))
                x = (torch.randn(shape, generator=g) * 10).to(dtype)
                exact, scale = _exact_sum(x)
                got = x.clone()
                if hierarchical_all_reduce(got, intra, inter) is not got:
                    failures.append("hierarchical: did not return its input")
                _check_sum(f"hierarchical per_node={per_node}", got, x, exact, scale, None, failures)
    return failures


@pytest.mark.parametrize("world", [2, 4])
@waits_for_its_world
def test_hierarchical_every_node_layout(world, world_job):
    for failures in world_job(world, "hierarchical_worker"):
        assert not failures, failures[:5]


def flat_path_worker(rank, world):
    """On one node the hierarchical all-reduce is the flat all-reduce itself: it must not call the
    reduce-scatter / all-gather of the two-level path (what made it cost more than flat)."""
    import distributed_training.comm.patterns as patterns

    calls = []
    saved = patterns.reduce_scatter_single, patterns.all_gather_single
    patterns.reduce_scatter_single = lambda *a, **k: calls.append("reduce_scatter") or saved[0](*a, **k)
    patterns.all_gather_single = lambda *a, **k: calls.append("all_gather") or saved[1](*a, **k)
    try:
        one_node = make_hybrid_groups(world)
        x = torch.full((7,), rank + 1.0)
        hierarchical_all_reduce(x, *one_node)
        two_nodes = make_hybrid_groups(world // 2)
        y = torch.full((7,), rank + 1.0)
        hierarchical_all_reduce(y, *two_nodes)
    finally:
        patterns.reduce_scatter_single, patterns.all_gather_single = saved
    total = world * (world + 1) / 2
    return calls, x.tolist() == [total] * 7, y.tolist() == [total] * 7


@waits_for_its_world
def test_hierarchical_on_one_node_is_the_flat_all_reduce(world_job):
    for calls, one_ok, two_ok in world_job(4, "flat_path_worker"):
        assert one_ok and two_ok
        assert calls == ["reduce_scatter", "all_gather"]  # from the two-node call only


def bad_knobs_worker(rank, world):
    messages = []
    for fn, kw in [(ring_all_reduce, {"segment_bytes": 0}), (ring_all_reduce, {"in_flight": 0}),
                   (tree_all_reduce, {"segment_bytes": -4}), (ring_all_reduce, {"segment_bytes": 1.5})]:
        try:
            fn(torch.ones(4), **kw)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return messages


@waits_for_its_world
def test_bad_knobs_name_the_parameter(world_job):
    messages = world_job(2, "bad_knobs_worker")[0]
    assert [m.split(" ")[0] for m in messages] == ["segment_bytes", "in_flight", "segment_bytes", "segment_bytes"]


# ------------------------------------------------------------------ one job per world size
def _part_of(item) -> tuple | None:
    """(world, worker's name, its arguments) of one of this module's tests."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    world = params.get("world")
    return {"test_patterns_equal_all_reduce": (world, "patterns_worker", (params.get("ranks_per_node"),)),
            "test_ring_and_tree_sum_exactly_enough_and_agree": (world, "sums_worker", ()),
            "test_ring_over_lanes": (world, "lanes_worker", ()),
            "test_patterns_on_a_subgroup": (world, "subgroup_worker", ()),
            "test_hierarchical_every_node_layout": (world, "hierarchical_worker", ()),
            "test_hierarchical_on_one_node_is_the_flat_all_reduce": (4, "flat_path_worker", ()),
            "test_bad_knobs_name_the_parameter": (2, "bad_knobs_worker", ()),
            }.get(getattr(item, "originalname", item.name))


def world_job_worker(rank, world, parts):
    """Each part's worker in turn, as its own job ran it (each returns its failures rather than raising;
    the process groups a part makes stay, as other groups do in a user's job)."""
    return [globals()[name](rank, world, *args) for name, args in parts]


@pytest.fixture(scope="module")
def world_job(request):
    """``world_job(world, name, *args)``: every rank's result of worker `name`, from the one job that ran
    the parts of the selected tests at that world size. A rank that raises fails that world's job and
    each of its tests (the later ones re-raise the first's error rather than rerun the job)."""
    parts: dict[int, list] = {}
    for item in request.session.items:
        part = _part_of(item) if item.module is request.module else None
        if part is not None and (part[1], part[2]) not in parts.setdefault(part[0], []):
            parts[part[0]].append((part[1], part[2]))
    def launch(world):
        per_rank = run_distributed(world_job_worker, world, args=(parts[world],),
                                   timeout=min(JOB_LIMIT, sum(LIMITS[n] for n, _ in parts[world])))
        return {part: [r[i] for r in per_rank] for i, part in enumerate(parts[world])}

    job = once_per_key(launch)
    return lambda world, name, *args: job(world)[(name, tuple(args))]
