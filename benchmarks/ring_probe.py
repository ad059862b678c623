"""Where a point-to-point ring all-reduce loses time on NCCL (issue 14, item 4): run under torchrun on
the GPUs of one host, writes ``ring_probe.json`` under ``--out``.

* ``exchange``: one ring step without the add (send a piece to rank + 1, receive one from rank - 1, one
  batch), back to back, at several sizes: the fixed cost of a message and the bandwidth it reaches.
* ``ring``: `ring_all_reduce` of 1 GB at several segment counts: GPU time per call, and the host's time
  to queue one call (no synchronisation), which bounds the ring when messages are small.
* ``trace``: rank 0's kernels (stream, name, start, duration) during one ring call at each segment
  count, from the profiler: whether the messages run back to back and the adds beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MB, environment, time_best_block  # noqa: E402


def _slowest(value: float) -> float:
    t = torch.tensor([value], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--size-mb", type=int, default=1024)
    args = p.parse_args()
    from distributed_training.comm.patterns import ring_all_reduce

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    device = torch.device("cuda")
    size = args.size_mb * MB
    x = torch.randn(size // 4, device=device)
    dist.all_reduce(x)
    out: dict = {"environment": environment(world), "world": world, "bytes": size}

    t0 = time.perf_counter()
    dist.all_reduce(x)
    nccl = _slowest(time_best_block(lambda: dist.all_reduce(x), device, 12))
    out["nccl_all_reduce_s"] = nccl

    rows = []
    for mb in (16, 64, 128, 192, 256, 512):
        send = torch.randn(mb * MB // 4, device=device)
        recv = torch.empty_like(send)

        def exchange():
            ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        s = _slowest(time_best_block(exchange, device, max(6, int(2e9 / (mb * MB)))))
        rows.append({"mb": mb, "seconds": s, "gbs": mb * MB / s / 1e9})
    out["exchange"] = rows

    chunk_mb = size / world / MB
    ring_rows = []
    for k in (1, 2, 4):
        seg = int(-(-size // world // k))
        fn = (lambda seg=seg: ring_all_reduce(x, segment_bytes=seg))
        x.normal_()
        s = _slowest(time_best_block(fn, device, 9))
        torch.cuda.synchronize()
        # The host's time to queue one call: blocked only where a wait blocks the host.
        h0 = time.perf_counter()
        fn()
        host = time.perf_counter() - h0
        torch.cuda.synchronize()
        ring_rows.append({"segments": k, "segment_mb": chunk_mb / k, "seconds": s, "host_queue_s": _slowest(host),
                          "vs_nccl": nccl / s, "busbw_gbs": size / s / 1e9 * 2 * (world - 1) / world})
    out["ring"] = ring_rows

    # Several messages at once: in one batch to the same peer, or on separate communicators (lanes).
    lanes = [dist.new_group(list(range(world))) for _ in range(3)]
    for g in lanes:  # create each communicator before timing
        dist.all_reduce(torch.ones(1, device=device), group=g)
    multi = []
    for pieces, mb in ((1, 256), (2, 128), (4, 64), (8, 32)):
        sends = [torch.randn(mb * MB // 4, device=device) for _ in range(pieces)]
        recvs = [torch.empty_like(t) for t in sends]
        for how in ("batch", "lanes"):
            if how == "lanes" and pieces > 1 + len(lanes):
                continue

            def exchange(how=how, sends=sends, recvs=recvs):
                works = []
                if how == "batch":
                    ops = [op for a, b in zip(sends, recvs) for op in
                           (dist.P2POp(dist.isend, a, (rank + 1) % world), dist.P2POp(dist.irecv, b, (rank - 1) % world))]
                    works += dist.batch_isend_irecv(ops)
                else:
                    for g, a, b in zip([None, *lanes], sends, recvs):
                        works += dist.batch_isend_irecv([dist.P2POp(dist.isend, a, (rank + 1) % world, g),
                                                         dist.P2POp(dist.irecv, b, (rank - 1) % world, g)])
                for w in works:
                    w.wait()

            s = _slowest(time_best_block(exchange, device, 24))
            multi.append({"how": how, "pieces": pieces, "mb": mb, "seconds": s, "gbs": pieces * mb * MB / s / 1e9})
    out["exchange_multi"] = multi
    lane_rows = []
    for n_lanes, k in ((2, 2), (2, 4), (4, 4), (4, 8), (3, 3)):
        seg = int(-(-size // world // k))
        fn = (lambda seg=seg, n_lanes=n_lanes, k=k: ring_all_reduce(x, segment_bytes=seg, in_flight=max(3, k),
                                                                   lanes=lanes[:n_lanes - 1]))
        x.normal_()
        s = _slowest(time_best_block(fn, device, 9))
        lane_rows.append({"lanes": n_lanes, "segments": k, "segment_mb": chunk_mb / k, "seconds": s,
                          "vs_nccl": nccl / s, "busbw_gbs": size / s / 1e9 * 2 * (world - 1) / world})
    out["ring_lanes"] = lane_rows
    # Correctness of the lane ring against NCCL's all-reduce (same input on every call).
    y = torch.randn(1000003, device=device)
    ref = y.clone()
    dist.all_reduce(ref)
    got = ring_all_reduce(y.clone(), segment_bytes=1000003 * 4 // world // 4, lanes=lanes[:3])
    out["lanes_max_abs_err"] = float((got - ref).abs().max())

    traces = {}
    from torch.profiler import ProfilerActivity, profile
    for k in (2,):
        seg = int(-(-size // world // k))
        ring_all_reduce(x, segment_bytes=seg, lanes=lanes[:1])
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            ring_all_reduce(x, segment_bytes=seg, lanes=lanes[:1])
            torch.cuda.synchronize()
        if rank == 0:
            events = []
            for e in prof.events():
                if e.device_type.name == "CUDA" or "nccl" in e.name.lower() or "add_" in e.name:
                    events.append({"name": e.name[:60], "device": e.device_type.name, "start_us": e.time_range.start,
                                   "dur_us": e.time_range.end - e.time_range.start,
                                   "stream": getattr(e, "device_index", None)})
            t_first = min(ev["start_us"] for ev in events) if events else 0
            for ev in events:
                ev["start_us"] -= t_first
            traces[str(k)] = sorted(events, key=lambda ev: ev["start_us"])
    out["trace"] = traces
    out["total_s"] = time.perf_counter() - t0
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "ring_probe.json").write_text(json.dumps(out, indent=1))
        print(json.dumps({k: v for k, v in out.items() if k != "trace"}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
