"""Top-K compression's selection on one device, and PowerSGD's cost beside it.

For each `topk_select` method (blockmax, exact, chunked, sampled; on a GPU with Triton also
``blockmax_eager``, the same selection without the fused kernel) at the Top-K ratio: milliseconds of
`CommunicationOptimizer.compress_topk` (accumulation into the residual, selection, the sent values,
the residual's update) for buckets of 1, 6.5 and 26 M fp32 values (DDP's first bucket, a 25 MiB
bucket, a 100 MiB one); and for GPT-2 124M's and a 1.3B model's whole gradients split into 25 MiB
and into 100 MiB buckets: the selection cost of one step. PowerSGD (rank 4) is timed the same way,
compression and decoding together (one device: no collective).

Two numbers per step: ``step_ms`` (wall time of the calls alone, host launches included: what it
costs when nothing else keeps the GPU busy) and ``step_gpu_ms`` (the device's own time, each group of
calls queued behind a device-side sleep so the host's launch cost is hidden, as it is under a
backward pass that keeps the GPU busy). The smoke run uses small buckets and a small model."""

from __future__ import annotations

import time

import torch

from common import MB, free_memory, synchronize, time_median_ms

METHODS = ("blockmax", "exact", "chunked", "sampled")
GPU_BUCKETS = (1 << 20, 25 * MB // 4, 100 * MB // 4)
GPU_GRADIENTS = (("gpt2_124m", 124_439_808), ("gpt_1.3b", 1_315_575_808))
GPU_BUCKET_MB = (25, 100)
SMOKE_BUCKETS = (1 << 12, 1 << 15)
SMOKE_GRADIENTS = (("tiny", 3 * (1 << 15) + 123),)
SMOKE_BUCKET_VALUES = (1 << 15, 1 << 17)


def _methods(device) -> tuple[str, ...]:
    from distributed_training.comm import _topk_kernels

    fused = device.type == "cuda" and _topk_kernels._kernel() is not None
    return METHODS + (("blockmax_eager",) if fused else ())


def _compressor(method: str, ratio: float):
    """(CommunicationOptimizer, call(grad, key)) for a row of the table."""
    from distributed_training import CommunicationOptimizer
    from distributed_training.comm import _topk_kernels

    if method == "powersgd":
        comm = CommunicationOptimizer("powersgd", powersgd_rank=4)
        return comm, lambda g, key: comm._powersgd_mean(g, None, key, 1).wait()
    select = "blockmax" if method == "blockmax_eager" else method
    comm = CommunicationOptimizer("topk", compression_ratio=ratio, topk_select=select)
    if method == "blockmax_eager":
        def call(g, key):
            _topk_kernels.ENABLED = False
            try:
                return comm.compress_topk(g, key=key)
            finally:
                _topk_kernels.ENABLED = True
        return comm, call
    return comm, lambda g, key: comm.compress_topk(g, key=key)


def _gpu_ms(calls, device, group: int = 24) -> float | None:
    """Device milliseconds of `calls` with the host's launch time hidden: each group is queued behind
    a `torch.cuda._sleep` longer than the host needs to queue it, so the events around the group time
    its kernels back to back. Groups stay well under the launch queue's depth (about 1,000 kernels)."""
    if device.type != "cuda" or not hasattr(torch.cuda, "_sleep"):
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    cycles_per_ms = 10_000_000 / max(start.elapsed_time(end), 1e-3)
    total = 0.0
    for first in range(0, len(calls), group):
        chunk = calls[first:first + group]
        synchronize(device)
        t0 = time.perf_counter()
        for call in chunk:
            call()
        host_ms = (time.perf_counter() - t0) * 1e3
        synchronize(device)
        torch.cuda._sleep(int(cycles_per_ms * (2 * host_ms + 1)))
        start.record()
        for call in chunk:
            call()
        end.record()
        end.synchronize()
        total += start.elapsed_time(end)
    return total


def run(ctx, opts) -> dict:
    device = ctx.device
    ratio = opts.topk_ratio
    methods = _methods(device)
    buckets = SMOKE_BUCKETS if opts.smoke else GPU_BUCKETS
    bucket_values = SMOKE_BUCKET_VALUES if opts.smoke else tuple(mb * MB // 4 for mb in GPU_BUCKET_MB)
    result = {"status": "ok", "ratio": ratio, "methods": list(methods), "bucket_values": bucket_values[0],
              "step_bucket_values": list(bucket_values), "buckets": {}, "step_ms": {}, "step_ms_by_bucket": {},
              "step_gpu_ms_by_bucket": {}, "powersgd": {"rank": 4, "buckets": {}, "step_ms_by_bucket": {},
                                                        "step_gpu_ms_by_bucket": {}}}
    for n in buckets:
        grad = torch.randn(n, device=device)
        row = {}
        for method in (*methods, "powersgd"):
            comm, call = _compressor(method, ratio)
            g = grad.clone() if method == "powersgd" else grad  # PowerSGD decodes into its input
            row[method] = time_median_ms(lambda: call(g, 0), device)
        result["powersgd"]["buckets"][str(n)] = row.pop("powersgd")
        result["buckets"][str(n)] = row
        print(f"[topk] {n:>10d} values: " + "  ".join(f"{k} {v:6.3f} ms" for k, v in row.items()) +
              f"  | powersgd {result['powersgd']['buckets'][str(n)]:6.3f} ms", flush=True)
        del grad, g
    for name, total in (SMOKE_GRADIENTS if opts.smoke else GPU_GRADIENTS):
        for bucket in bucket_values:
            sizes = [bucket] * (total // bucket) + ([total % bucket] if total % bucket else [])
            grads = [torch.randn(s, device=device) for s in sizes]
            wall, gpu = {}, {}
            for method in (*methods, "powersgd"):
                comm, call = _compressor(method, ratio)
                wall[method] = time_median_ms(lambda: [call(g, i) for i, g in enumerate(grads)], device, repeat=3)
                gpu[method] = _gpu_ms([lambda g=g, i=i: call(g, i) for i, g in enumerate(grads)], device)
                del comm, call
                free_memory(device)  # this method's residuals before the next one's
            key = str(bucket)
            ps_wall, ps_gpu = wall.pop("powersgd"), gpu.pop("powersgd")
            result["step_ms_by_bucket"].setdefault(key, {})[name] = {"params": total, "buckets": len(sizes), **wall}
            result["step_gpu_ms_by_bucket"].setdefault(key, {})[name] = {"params": total, "buckets": len(sizes), **gpu}
            result["powersgd"]["step_ms_by_bucket"].setdefault(key, {})[name] = ps_wall
            result["powersgd"]["step_gpu_ms_by_bucket"].setdefault(key, {})[name] = ps_gpu
            if bucket == bucket_values[0]:
                result["step_ms"][name] = {"params": total, **wall}  # the 25 MiB table, as before
            fmt = lambda d: "  ".join(f"{k} {v:7.2f}" if v is not None else f"{k} -" for k, v in d.items())  # noqa: E731
            print(f"[topk] {name}, {len(sizes)} buckets of {bucket:,}: per step ms {fmt(wall)} | powersgd {ps_wall:7.2f}",
                  flush=True)
            if device.type == "cuda":
                print(f"[topk]   device-only ms {fmt(gpu)} | powersgd {ps_gpu:7.2f}", flush=True)
            grads.clear()  # free this model's gradients before the next
            free_memory(device)
    return result
