"""Collective micro-benchmarks: seconds per call (slowest rank, fastest of three timed blocks) of NCCL's
all-reduce, all-gather and reduce-scatter, our ring, tree and hierarchical all-reduce (on the job's
real nodes, and on two emulated nodes of W/2) and our bf16 / Top-K 1% / PowerSGD reductions, at each
size; at the largest size, a sweep of the ring's and the tree's segment size and in-flight depth, with
the ceiling of any point-to-point ring (one exchange of a chunk with both neighbours); then how much
of an all-reduce hides under a matmul loop of about its length (the scaling model's overlap)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from common import MB, slowest, synchronize, time_best_block

GPU_SIZES = [MB * s for s in (1, 4, 16, 64, 256, 1024)]
SMOKE_SIZES = [2**12, 2**16, 2**20, 2**22]  # up to 4 MB: enough growth to fit a line on a loaded CPU
# The sweep at the largest size: segment sizes (ring and tree; 256 MiB is a whole chunk of a 1 GB ring
# at 4 ranks: no pipelining, what it buys) and in-flight depths (ring).
GPU_SEGMENTS, SMOKE_SEGMENTS = [MB * s for s in (4, 16, 64, 256)], [2**16, 2**18, 2**20]
IN_FLIGHT = (2, 4)


def run(ctx, opts) -> dict:
    from distributed_training.comm.optimizer import CommunicationOptimizer
    from distributed_training.comm.patterns import hierarchical_all_reduce, ring_all_reduce, tree_all_reduce
    from distributed_training.comm.collectives import all_gather_single, reduce_scatter_single
    from distributed_training.runtime import launcher_ranks_per_node
    from distributed_training.strategies.fsdp import make_hybrid_groups

    n, device = ctx.world_size, ctx.device
    sizes = SMOKE_SIZES if opts.smoke else GPU_SIZES
    # The job's real nodes (one host: one node, where hierarchical must cost what flat costs), and two
    # emulated "nodes" of n/2 so both levels run (at n = 2 each "node" is one rank: the inter-node
    # all-reduce alone); an odd world is n nodes of one.
    real = make_hybrid_groups(launcher_ranks_per_node(None), None)
    per_node = n // 2 if n % 2 == 0 else 1
    intra, inter = make_hybrid_groups(per_node, None)
    reducers = {name: CommunicationOptimizer(**kw) for name, kw in
                (("topk", dict(compression="topk", compression_ratio=0.01)), ("bf16", dict(compression="bf16")),
                 ("powersgd", dict(compression="powersgd", powersgd_rank=4)))}
    rows = []
    for size in sizes:
        numel = size // 4
        x = torch.randn(numel, device=device)
        shard = torch.randn(-(-numel // n), device=device)
        gathered = torch.empty(shard.numel() * n, device=device)
        ops = {
            "nccl_all_reduce": lambda: dist.all_reduce(x),
            "ring_all_reduce": lambda: ring_all_reduce(x),
            "tree_all_reduce": lambda: tree_all_reduce(x),
            "hierarchical_all_reduce": lambda: hierarchical_all_reduce(x, *real),
            "hierarchical_2node_all_reduce": lambda: hierarchical_all_reduce(x, intra, inter),
            "all_gather": lambda: all_gather_single(gathered, shard),
            "reduce_scatter": lambda: reduce_scatter_single(shard, gathered),
        }
        for name, r in reducers.items():
            ops[f"{name}_reduce"] = (lambda r=r: r.all_reduce_compressed(x, None, key=0))
        reps = _reps(size, opts)
        for op, fn in ops.items():
            x.normal_()  # the summing all-reduces grow it by n per call: start every op from the same scale
            s, = slowest(ctx, [time_best_block(fn, device, reps)])
            # Compressed reductions stand in for an all-reduce of the same tensor: the same bus factor.
            factor = 2 * (n - 1) / n if op.endswith("_reduce") else (n - 1) / n
            rows.append({"op": op, "bytes": size, "world": n, "seconds": s, "algbw_gbs": size / s / 1e9,
                         "busbw_gbs": size / s / 1e9 * factor})
    nccl = next(r["seconds"] for r in rows if r["op"] == "nccl_all_reduce" and r["bytes"] == sizes[-1])
    return {"status": "ok", "rows": rows, "sweep": segment_sweep(ctx, opts, sizes[-1], nccl),
            "overlap": overlap_efficiency(ctx, sizes[-1] if opts.smoke else 256 * MB)}


def _reps(size: int, opts) -> int:
    budget = 2e7 if opts.smoke else 2e10  # bytes per op and size: more repetitions for small messages
    return int(max(3, min(50, budget / size)))


def segment_sweep(ctx, opts, size: int, nccl_seconds: float) -> list[dict]:
    """At `size` bytes: the ring at each segment size x in-flight depth, the tree at each segment size,
    both at their automatic defaults (``segment_bytes=None``), and ``p2p_exchange``: one message of a
    ring step carrying a whole chunk (send size/W to the next rank, receive size/W from the previous,
    one batch). A ring of point-to-point messages moves 2 (W - 1) such chunks one after another, so
    chunk / exchange time is the highest bus bandwidth any of them can reach: if the ring is near it,
    what is left is the point-to-point transport, not the pipeline. ``vs_nccl`` is NCCL's all-reduce
    time / this one (for the exchange: the same ratio of bus bandwidths)."""
    from distributed_training.comm.patterns import ring_all_reduce, tree_all_reduce

    n, device = ctx.world_size, ctx.device
    x = torch.randn(size // 4, device=device)
    runs = [("ring", None, None), ("ring_one_lane", None, None)]
    runs += [("ring", seg, depth) for seg in (SMOKE_SEGMENTS if opts.smoke else GPU_SEGMENTS) for depth in IN_FLIGHT]
    runs += [("tree", None, None)] + [("tree", seg, None) for seg in (SMOKE_SEGMENTS if opts.smoke else GPU_SEGMENTS)]
    chunk = torch.tensor_split(x, n)[0]
    inbox = torch.empty_like(chunk)
    rank = dist.get_rank()

    def exchange():
        ops = [dist.P2POp(dist.isend, chunk, (rank + 1) % n), dist.P2POp(dist.irecv, inbox, (rank - 1) % n)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    reps = _reps(size, opts)
    nccl_bus = size / nccl_seconds * 2 * (n - 1) / n
    rows = []
    for op, seg, depth in runs:
        if op == "ring":
            fn = (lambda seg=seg, depth=depth: ring_all_reduce(x, segment_bytes=seg, in_flight=depth))
        elif op == "ring_one_lane":  # one communicator, as before lanes (session 19: 0.77x at 4 GPUs)
            fn = (lambda: ring_all_reduce(x, lanes=()))
        else:
            fn = (lambda seg=seg: tree_all_reduce(x, segment_bytes=seg))
        x.normal_()
        s, = slowest(ctx, [time_best_block(fn, device, reps)])
        rows.append({"op": op, "segment_bytes": seg, "in_flight": depth, "bytes": size, "world": n, "seconds": s,
                     "busbw_gbs": size / s / 1e9 * 2 * (n - 1) / n, "vs_nccl": nccl_seconds / s})
    s, = slowest(ctx, [time_best_block(exchange, device, reps * 2 * (n - 1))])
    bus = chunk.numel() * chunk.element_size() / s / 1e9
    rows.append({"op": "p2p_exchange", "segment_bytes": chunk.numel() * chunk.element_size(), "in_flight": None,
                 "bytes": size, "world": n, "seconds": s, "busbw_gbs": bus, "vs_nccl": bus * 1e9 / nccl_bus})
    return rows


def overlap_efficiency(ctx, nbytes: int) -> dict:
    """How much of an all-reduce hides under a matmul loop of about the same length:
    (comm alone + compute alone - both at once) / the shorter of the two, clamped to [0, 1]; the
    smallest over ranks."""
    device = ctx.device
    x = torch.randn(nbytes // 4, device=device)
    side = 1024 if device.type == "cuda" else 256
    a = torch.randn(side, side, device=device)

    def timed(fn) -> float:
        synchronize(device)
        ctx.barrier()
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        return time.perf_counter() - t0

    timed(lambda: dist.all_reduce(x))
    comm = min(timed(lambda: dist.all_reduce(x)) for _ in range(3))

    def twenty():
        for _ in range(20):
            a @ a

    one = min(timed(twenty) for _ in range(3)) / 20  # a loop, so launch and sync overheads do not count
    reps = max(1, round(comm / max(one, 1e-9)))

    def compute():
        for _ in range(reps):
            a @ a

    def both():
        work = dist.all_reduce(x, async_op=True)
        compute()
        work.wait()

    comp = min(timed(compute) for _ in range(3))
    together = min(timed(both) for _ in range(3))
    eff = max(0.0, min(1.0, (comm + comp - together) / min(comm, comp)))
    eff = -slowest(ctx, [-eff])[0]  # the smallest over ranks
    return {"bytes": nbytes, "comm_s": comm, "compute_s": comp, "both_s": together, "efficiency": eff}
