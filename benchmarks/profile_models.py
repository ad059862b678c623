"""Where our DDP loses time on third-party models: step time of variants, interleaved, plus a profile.

    torchrun --nproc_per_node=2 benchmarks/profile_models.py --models resnet50,bert --out prof.json

For each model (timm ResNet-50 / ViT-B/16, Hugging Face BERT-base MLM / GPT-2, built from configs,
no weights) and each variant below, the median step time over interleaved rounds (bf16 autocast,
fused AdamW, ``zero_grad(set_to_none=True)``), then one profiled window of ours and torch's: the CPU
operators with the most self time (host cost on the autograd thread shows up here) and GPU kernel
time by category. Rank 0 prints a table and writes the JSON.

Variants: plain (no wrapper), torch (DistributedDataParallel), torch_view (gradient_as_bucket_view),
ours, ours_nobcast (broadcast_buffers=False), ours_keepgrad (zero_grad(set_to_none=False)),
ours_nosync (our hooks, no communication).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from distributed_training import DDP, init_distributed  # noqa: E402

VARIANTS = ("plain", "torch", "torch_view", "ours", "ours_nobcast", "ours_keepgrad", "ours_nosync", "ours_noop",
            "ours_timed", "ours_noop_nobcast", "plain_bcast")
TIMERS: dict = defaultdict(lambda: [0.0, 0, 0.0])  # name -> [seconds, calls, max seconds] (ours_timed)


THREAD_CPU = defaultdict(lambda: defaultdict(float))  # variant -> thread -> CPU ms per step


def _thread_cpu() -> dict:
    """{tid: (name, cpu seconds)} for every thread of this process, from /proc."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
        except OSError:
            pass
    return out


GC_SECONDS = defaultdict(float)  # variant -> seconds in Python's cyclic garbage collector
_gc_state = {"variant": None, "start": 0.0}


def _gc_callback(phase, info):
    if phase == "start":
        _gc_state["start"] = time.perf_counter()
    elif _gc_state["variant"] is not None:
        GC_SECONDS[_gc_state["variant"]] += time.perf_counter() - _gc_state["start"]


def _timed(name, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        c0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            entry = TIMERS[name]
            entry[0] += dt
            entry[1] += 1
            entry[2] = max(entry[2], dt)
            TIMERS[name + " (thread cpu)"][0] += time.thread_time() - c0

    return wrapper


def build(name: str, device):
    """(model, make_batch, loss_fn) for a model built from its config, with no downloaded weights."""
    if name in ("resnet50", "vit"):
        import timm

        model = timm.create_model("resnet50" if name == "resnet50" else "vit_base_patch16_224", pretrained=False)
        batch = 64
        x = torch.randn(batch, 3, 224, 224, device=device)
        y = torch.randint(0, 1000, (batch,), device=device)
        return model.to(device), (x, y), lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])
    import transformers

    if name == "bert":
        cfg = transformers.BertConfig()
        model = transformers.BertForMaskedLM(cfg)
    else:
        cfg = transformers.GPT2Config()
        model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (16, 512), device=device)
    return model.to(device), (ids,), lambda m, b: m(input_ids=b[0], labels=b[0]).loss


def wrap(variant: str, model, device):
    if variant == "plain":
        return model
    if variant.startswith("torch"):
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index], gradient_as_bucket_view=variant == "torch_view")
    if variant.startswith("ours_noop"):  # the synchronised hook path with a reducer that sends nothing
        from distributed_training.comm.reduce import CompletedWork

        return DDP(model, bucket_reducer=lambda bucket, group: CompletedWork(),
                   broadcast_buffers=variant == "ours_noop")
    if variant == "plain_bcast":  # no wrapper, but rank 0's buffers broadcast before each forward
        from distributed_training.comm.collectives import broadcast_coalesced

        buffers = list(model.buffers())

        class Bcast(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = model

            def forward(self, *a, **k):
                broadcast_coalesced(buffers, 0)
                return self.inner(*a, **k)

        return Bcast()
    ddp = DDP(model, broadcast_buffers=variant != "ours_nobcast")
    # ours_gcoff / ours_switch: the same wrapper, run with Python's cyclic GC off / a 0.1 ms GIL switch
    # interval (see `conditions`), to tell garbage collection and GIL hand-offs apart.
    if variant == "ours_timed":  # host time of each piece of our hook path
        for name in ("_on_grad_ready", "_attach_grad_to_bucket", "_launch_ready_buckets", "_finish_backward",
                     "forward"):
            setattr(ddp, name, _timed(name, getattr(ddp, name)))
        ddp.bucket_reducer = _timed("bucket_reducer", ddp.bucket_reducer)
    return ddp


@contextlib.contextmanager
def conditions(variant: str):
    import gc as gc_module

    interval = sys.getswitchinterval()
    if variant == "ours_gcoff":
        gc_module.disable()
    if variant == "ours_switch":
        sys.setswitchinterval(1e-4)
    try:
        yield
    finally:
        gc_module.enable()
        sys.setswitchinterval(interval)


def step(wrapped, opt, batch, loss_fn, variant):
    with wrapped.no_sync() if variant == "ours_nosync" else contextlib.nullcontext():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(wrapped, batch)
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=variant != "ours_keepgrad")


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in (("nccl", ("nccl",)), ("optimizer", ("adam", "multi_tensor")),
                      ("conv", ("conv", "cudnn", "implicit", "wgrad", "dgrad")),
                      ("matmul", ("gemm", "cutlass", "sm90", "nvjet", "cublas")),
                      ("copy", ("copy", "memcpy", "cat", "fill")), ("norm", ("norm", "bn_"))):
        if any(k in low for k in keys):
            return cat
    return "other"


def measure(model_name, device, rounds, steps, is_main):
    # One model, optimizer and wrapper per variant (same seed, so the same weights): no variant's hooks
    # can fire in another's backward.
    runs = {}
    for v in VARIANTS:
        torch.manual_seed(0)
        model, batch, loss_fn = build(model_name, device)
        runs[v] = (wrap(v, model, device), torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    times = defaultdict(list)
    host = defaultdict(list)
    GC_SECONDS.clear()
    THREAD_CPU.clear()
    for _ in range(rounds):
        for v in VARIANTS:
            w, opt = runs[v]
            for _ in range(3):
                step(w, opt, batch, loss_fn, v)
            torch.cuda.synchronize()
            if v == "ours_timed":
                TIMERS.clear()
            _gc_state["variant"] = v
            before = _thread_cpu()
            with conditions(v):
                t0 = time.perf_counter()
                hsum = 0.0
                for _ in range(steps):
                    h0 = time.perf_counter()
                    step(w, opt, batch, loss_fn, v)
                    hsum += time.perf_counter() - h0
                torch.cuda.synchronize()
            _gc_state["variant"] = None
            after = _thread_cpu()
            for tid, (name, cpu) in after.items():
                used = cpu - before.get(tid, (name, 0.0))[1]
                if used > 0:
                    THREAD_CPU[v][f"{name}:{tid}"] += used / steps * 1e3
            times[v].append((time.perf_counter() - t0) / steps * 1e3)
            host[v].append(hsum / steps * 1e3)
            if v == "ours_timed":
                timers = {k: {"ms_per_step": e[0] / steps * 1e3, "calls_per_step": e[1] / steps,
                              "max_ms": e[2] * 1e3} for k, e in TIMERS.items()}
    profiles = {}
    for v in ("ours", "torch", "ours_nosync", "plain"):
        if v not in runs:
            continue
        w, opt = runs[v]
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step(w, opt, batch, loss_fn, v)
            torch.cuda.synchronize()
        cpu = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:18]
        kernels = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[category(e.name)] += e.device_time_total / 1e3 / 3
        profiles[v] = {
            "cpu_self_ms_top": {e.key[:70]: [round(e.self_cpu_time_total / 1e3 / 3, 3), e.count // 3] for e in cpu},
            "kernel_ms": {k: round(x, 3) for k, x in kernels.items()},
        }
    model = runs["plain"][0]
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    out = {"params_tensors": n_params, "buffers": sum(1 for _ in model.buffers()),
           "step_ms_median": {v: statistics.median(t) for v, t in times.items()},
           "step_ms_all": dict(times), "host_ms_median": {v: statistics.median(t) for v, t in host.items()},
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "profiles": profiles, "timers": timers,
           "thread_cpu_ms_per_step": {v: dict(t) for v, t in THREAD_CPU.items()},
           "gc_ms_per_step": {v: 1e3 * t / (rounds * steps) for v, t in GC_SECONDS.items()},
           "buckets": [len(g) for g in runs["ours"][0].bucket_groups()]}
    if is_main:
        import threading

        print("python threads:", [(t.name, t.daemon) for t in threading.enumerate()])
        print(f"\n== {model_name}: {n_params} parameter tensors, {out['buffers']} buffers", flush=True)
        for v in VARIANTS:
            print(f"  {v:14s} step {out['step_ms_median'][v]:7.2f} ms   host {out['host_ms_median'][v]:7.2f} ms")
        print("  affinity:", sorted(os.sched_getaffinity(0))[:8], "... of", len(os.sched_getaffinity(0)))
        for v in ("plain", "torch", "ours", "ours_nosync", "ours_noop_nobcast", "plain_bcast"):
            busy = {k: round(x, 1) for k, x in sorted(THREAD_CPU[v].items(), key=lambda kv: -kv[1])[:6]}
            print(f"  thread cpu ms/step {v}: {busy}")
        print("  gc ms/step:", {v: round(t, 2) for v, t in out["gc_ms_per_step"].items()})
        print(f"  buckets (params each): {out['buckets']}")
        for k, e in timers.items():
            print(f"  timer {k:24s} {e['ms_per_step']:7.3f} ms/step  {e['calls_per_step']:6.1f} calls  max {e['max_ms']:.3f} ms")
        for v, p in profiles.items():
            print(f"  -- {v} kernels: {json.dumps(p['kernel_ms'])}")
            print(f"     cpu self: {json.dumps(dict(list(p['cpu_self_ms_top'].items())[:12]))}", flush=True)
    for w, _ in runs.values():
        if isinstance(w, DDP):
            w.remove_hooks()
    del runs, model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="resnet50,bert,vit,gpt2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ctx = init_distributed()
    import gc as gc_module

    gc_module.callbacks.append(_gc_callback)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    result = {"card": torch.cuda.get_device_name(), "world_size": ctx.world_size, "torch": torch.__version__,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())), "models": {}}
    for name in args.models.split(","):
        result["models"][name] = measure(name, ctx.device, args.rounds, args.steps, ctx.is_main)
    if ctx.is_main and args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    ctx.shutdown()


if __name__ == "__main__":
    main()
