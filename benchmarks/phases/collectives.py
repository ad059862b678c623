"""Collective micro-benchmarks: seconds per call (slowest rank, fastest of three timed blocks) of NCCL's
all-reduce, all-gather and reduce-scatter, our ring, tree and hierarchical all-reduce (two emulated
nodes of W/2) and our bf16 / Top-K 1% / PowerSGD reductions, at each size; then how much of an
all-reduce hides under a matmul loop of about its length (the scaling model's overlap)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from common import MB, slowest, synchronize, time_best_block

GPU_SIZES = [MB * s for s in (1, 4, 16, 64, 256, 1024)]
SMOKE_SIZES = [2**12, 2**16, 2**20, 2**22]  # up to 4 MB: enough growth to fit a line on a loaded CPU


def run(ctx, opts) -> dict:
    from distributed_training.comm.optimizer import CommunicationOptimizer
    from distributed_training.comm.patterns import hierarchical_all_reduce, ring_all_reduce, tree_all_reduce
    from distributed_training.comm.collectives import all_gather_single, reduce_scatter_single
    from distributed_training.strategies.fsdp import make_hybrid_groups

    n, device = ctx.world_size, ctx.device
    sizes = SMOKE_SIZES if opts.smoke else GPU_SIZES
    # Two emulated "nodes" of n/2 so both levels run (at n = 2 each "node" is one rank: the inter-node
    # all-reduce alone); an odd world is n nodes of one.
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
            "hierarchical_all_reduce": lambda: hierarchical_all_reduce(x, intra, inter),
            "all_gather": lambda: all_gather_single(gathered, shard),
            "reduce_scatter": lambda: reduce_scatter_single(shard, gathered),
        }
        for name, r in reducers.items():
            ops[f"{name}_reduce"] = (lambda r=r: r.all_reduce_compressed(x, None, key=0))
        budget = 2e7 if opts.smoke else 2e10  # bytes per op and size: more repetitions for small messages
        reps = int(max(3, min(50, budget / size)))
        for op, fn in ops.items():
            x.normal_()  # the summing all-reduces grow it by n per call: start every op from the same scale
            s, = slowest(ctx, [time_best_block(fn, device, reps)])
            # Compressed reductions stand in for an all-reduce of the same tensor: the same bus factor.
            factor = 2 * (n - 1) / n if op.endswith("_reduce") else (n - 1) / n
            rows.append({"op": op, "bytes": size, "world": n, "seconds": s, "algbw_gbs": size / s / 1e9,
                         "busbw_gbs": size / s / 1e9 * factor})
    return {"status": "ok", "rows": rows, "overlap": overlap_efficiency(ctx, sizes[-1] if opts.smoke else 256 * MB)}


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
