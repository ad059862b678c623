"""Where a DDP step's time goes, under torch.profiler: for ``plain`` (no wrapper, no communication),
``ours_nosync`` (our hooks, no communication), ``ours`` and ``torch`` (their DDPs), a few steps after
warm-up, time summed by category (matmul, attention, comm, copy: gradient copies into buckets and other
copies, optimizer, other). On GPUs the categories sum CUDA kernel time; on CPU (the smoke run), operators'
self CPU time. Also the host time of our hooks, the heaviest kernels/operators, and on GPUs the SM clock
and power draw sampled during the profiled steps (is a slower matmul beside NCCL a slower clock?)."""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import threading
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from common import build, free_memory, make_batches, synchronize, teardown, train_steps

CATEGORIES = (
    ("comm", ("nccl", "gloo", "c10d", "allreduce", "all_reduce", "broadcast")),
    ("optimizer", ("adam", "multi_tensor", "_foreach")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul", "aten::mm", "aten::addmm", "aten::bmm")),
    ("copy", ("copy", "memcpy", "cat", "fill")),
)
IMPLS = {"plain": ("plain", False), "ours_nosync": ("ours_ddp", True), "ours": ("ours_ddp", False),
         "torch": ("torch_ddp", False)}
GPU_MODEL = ("gpt-1.3b", 8, 1024)
SMOKE_MODEL = ("tiny", 4, 32)


class ClockSampler:
    """The GPU's SM clock (MHz) and power draw (W), sampled every `period_s` on a thread while in the block;
    through torch (pynvml) where it can, else `nvidia-smi`. `result()`: the means, or why there are none."""

    def __init__(self, device: torch.device, period_s: float = 0.02) -> None:
        self.device, self.period_s = device, period_s
        self.samples: list[tuple[float, float]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._read = self._pick_reader()

    def _pick_reader(self):
        try:
            torch.cuda.clock_rate(self.device), torch.cuda.power_draw(self.device)
            return lambda: (float(torch.cuda.clock_rate(self.device)), torch.cuda.power_draw(self.device) / 1e3)
        except Exception as err:  # pynvml missing: ask the driver's tool
            first = f"torch: {err}"
        index = str(self.device.index or 0)

        def smi() -> tuple[float, float]:
            out = subprocess.run(["nvidia-smi", "-i", index, "--query-gpu=clocks.sm,power.draw",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5)
            clock, power = (float(v) for v in out.stdout.strip().split(","))
            return clock, power
        try:
            smi()
            return smi
        except Exception as err:
            self.error = f"{first}; nvidia-smi: {err}"
            return None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self._read())
            except Exception as err:
                self.error = str(err)
                return
            self._stop.wait(self.period_s)

    def __enter__(self):
        if self._read is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._read is not None:
            self._thread.join()

    def result(self) -> dict:
        if not self.samples:
            return {"error": self.error or "no samples"}
        return {"sm_clock_mhz": statistics.mean(c for c, _ in self.samples),
                "power_w": statistics.mean(p for _, p in self.samples), "samples": len(self.samples)}


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def run(ctx, opts) -> dict:
    from distributed_training.models import GPT_PRESETS

    device = ctx.device
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    preset, micro, seq = (opts.models or [SMOKE_MODEL if opts.smoke else GPU_MODEL])[-1]
    cfg = GPT_PRESETS[preset]
    steps = 1 if opts.smoke else 3
    batches = make_batches(cfg, micro, seq, device, ctx.rank, count=1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    report = {}
    for name, (impl, no_sync) in IMPLS.items():
        wrapped, opt = build(impl, cfg, device, ctx)
        train_steps(wrapped, opt, batches, 0, 1 if opts.smoke else 3, device, no_sync)
        synchronize(device)
        clocks = ClockSampler(device) if cuda else None
        with profile(activities=activities) as prof, (clocks or contextlib.nullcontext()):
            t0 = time.perf_counter()
            train_steps(wrapped, opt, batches, 0, steps, device, no_sync)
            synchronize(device)
            wall = (time.perf_counter() - t0) / steps
        by_cat: dict[str, float] = defaultdict(float)
        top: dict[str, float] = defaultdict(float)
        if cuda:
            for evt in prof.events():
                if evt.device_type == torch.autograd.DeviceType.CUDA:
                    by_cat[category(evt.name)] += evt.device_time_total / 1e3 / steps
                    top[evt.name[:90]] += evt.device_time_total / 1e3 / steps
        else:
            for evt in prof.key_averages():
                by_cat[category(evt.key)] += evt.self_cpu_time_total / 1e3 / steps
                top[evt.key[:90]] += evt.self_cpu_time_total / 1e3 / steps
        hook_cpu = sum(e.cpu_time_total for e in prof.key_averages() if "hook" in e.key.lower()) / 1e3 / steps
        report[name] = {"wall_ms_profiled": wall * 1e3, "ms_by_category": dict(by_cat),
                        "top_ms": dict(sorted(top.items(), key=lambda kv: -kv[1])[:12]), "python_hook_cpu_ms": hook_cpu,
                        "gpu_clock": clocks.result() if clocks else None}
        teardown(wrapped)
        del wrapped, opt
        free_memory(device)
    if ctx.is_main:
        cats = ["matmul", "attention", "comm", "copy", "optimizer", "other"]
        print(f"[profiling] {'impl':12s} {'wall':>7s} " + " ".join(f"{c:>9s}" for c in cats) +
              f"   (ms per step; {'kernel' if cuda else 'CPU operator self'} time)")
        for name, r in report.items():
            k = r["ms_by_category"]
            print(f"[profiling] {name:12s} {r['wall_ms_profiled']:7.1f} " + " ".join(f"{k.get(c, 0.0):9.1f}" for c in cats))
    return {"status": "ok", "model": preset, "micro_batch": micro, "seq": seq, "steps": steps,
            "time_kind": "CUDA kernel time" if cuda else "CPU operator self time", "report": report}
