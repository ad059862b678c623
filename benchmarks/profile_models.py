"""Our DDP and trainer against torch DDP on third-party models: step time of variants, interleaved.

    torchrun --nproc_per_node=2 benchmarks/profile_models.py --models resnet50,bert --out prof.json

For each model (timm ResNet-50 / ViT-B/16, Hugging Face BERT-base MLM / GPT-2, built from configs,
no weights), every variant gets its own copy of the model (same seed) and optimizer (fused AdamW,
bf16 autocast, ``zero_grad(set_to_none=True)``); variants take turns for `--rounds` rounds of
`--steps` steps, and the median step time is reported with the host time spent issuing the steps,
each thread's CPU time per step (from /proc), peak memory per variant, and (with `--profile`) a
torch.profiler window of the first few variants: CPU operators by self time and GPU kernel time by
category. Rank 0 prints a table and writes the JSON.

Variants (`--variants`; default: plain,torch,ours,trainer,trainer_monitor,ours_nosync):
  plain            the bare model, no communication
  torch            torch.nn.parallel.DistributedDataParallel (torch_view: gradient_as_bucket_view)
  ours             our DDP (ours_nobcast: broadcast_buffers=False; ours_nosync: our hooks under no_sync,
                   no communication; ours_noop: the synchronised hook path with a reducer that sends
                   nothing; ours_timed: host time of each method of the hook path)
  trainer          DistributedTrainer(strategy="ddp", mixed_precision="bf16").train_step
  trainer_monitor  the same with a Monitor (log_dir, log_every=10), recorded as fit records each step
  trainer_zero3    DistributedTrainer(strategy="zero3").train_step
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from distributed_training import DDP, DistributedTrainer, init_distributed  # noqa: E402

DEFAULT_VARIANTS = "plain,torch,ours,trainer,trainer_monitor,ours_nosync"
TIMERS: dict = defaultdict(lambda: [0.0, 0, 0.0])  # name -> [seconds, calls, max seconds] (ours_timed)


def _timed(name, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            entry = TIMERS[name]
            entry[0] += dt
            entry[1] += 1
            entry[2] = max(entry[2], dt)

    return wrapper


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


def build(name: str, device):
    """(model, batch, criterion) for a model built from its config, with no downloaded weights.

    `criterion` is None for the Hugging Face models, whose forward returns the loss from `labels`."""
    if name in ("resnet50", "vit"):
        import timm

        model = timm.create_model("resnet50" if name == "resnet50" else "vit_base_patch16_224", pretrained=False)
        x = torch.randn(64, 3, 224, 224, device=device)
        y = torch.randint(0, 1000, (64,), device=device)
        return model.to(device), (x, y), F.cross_entropy
    import transformers

    if name == "bert":
        cfg = transformers.BertConfig()
        model = transformers.BertForMaskedLM(cfg)
    else:
        cfg = transformers.GPT2Config()
        model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (16, 512), device=device)
    return model.to(device), {"input_ids": ids, "labels": ids}, None


def loss_of(model, batch, criterion):
    if criterion is None:
        return model(**batch).loss
    return criterion(model(batch[0]), batch[1])


class Variant:
    """One way of running a step: a wrapper + optimizer, or a trainer."""

    def __init__(self, name: str, model, ctx, log_dir: str):
        self.name = name
        self.trainer = None
        factory = lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True)  # noqa: E731
        if name.startswith("trainer"):
            self.trainer = DistributedTrainer(
                model, factory, strategy="zero3" if name == "trainer_zero3" else "ddp", mixed_precision="bf16",
                context=ctx, log_dir=os.path.join(log_dir, name) if name == "trainer_monitor" else None,
                log_every=10, progress=False)
            return
        self.wrapped = self._wrap(model, ctx.device)
        self.opt = factory(model.parameters())

    def _wrap(self, model, device):
        v = self.name
        if v == "plain":
            return model
        if v.startswith("torch"):
            return torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index], gradient_as_bucket_view=v == "torch_view")
        if v == "ours_noop":
            from distributed_training.comm.reduce import CompletedWork

            return DDP(model, bucket_reducer=lambda bucket, group: CompletedWork())
        ddp = DDP(model, broadcast_buffers=v != "ours_nobcast")
        if v == "ours_timed":
            for method in ("_on_grad_ready", "_attach_grad_to_bucket", "_launch_ready_buckets", "_finish_backward"):
                setattr(ddp, method, _timed(method, getattr(ddp, method)))
            ddp.bucket_reducer = _timed("bucket_reducer", ddp.bucket_reducer)
        return ddp

    def step(self, batch, criterion) -> None:
        if self.trainer is not None:
            start = time.perf_counter()
            metrics = self.trainer.train_step(batch, criterion)
            if self.name == "trainer_monitor":
                self.trainer._record_step(batch, metrics, step_time=time.perf_counter() - start, data_time=0.0)
            return
        with self.wrapped.no_sync() if self.name == "ours_nosync" else contextlib.nullcontext():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_of(self.wrapped, batch, criterion)
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
        elif isinstance(self.wrapped, DDP):
            self.wrapped.remove_hooks()


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in (("nccl", ("nccl",)), ("optimizer", ("adam", "multi_tensor")),
                      ("conv", ("conv", "cudnn", "implicit", "wgrad", "dgrad")),
                      ("matmul", ("gemm", "cutlass", "sm90", "nvjet", "cublas")),
                      ("copy", ("copy", "memcpy", "cat", "fill")), ("norm", ("norm", "bn_"))):
        if any(k in low for k in keys):
            return cat
    return "other"


def measure(model_name, variants, ctx, args, log_dir):
    # Peak memory of a variant alone = what it keeps between steps (model, wrapper buffers, optimizer
    # state, gradients left set) + the most a step adds on top; every variant's model stays resident.
    runs, resident, peak = {}, {}, {}
    for v in variants:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.manual_seed(0)
        model, batch, criterion = build(model_name, ctx.device)
        runs[v] = Variant(v, model, ctx, log_dir)
        for _ in range(3):
            runs[v].step(batch, criterion)
        torch.cuda.synchronize()
        resident[v] = torch.cuda.memory_allocated() - before
    times, host = defaultdict(list), defaultdict(list)
    thread_cpu = defaultdict(lambda: defaultdict(float))
    for _ in range(args.rounds):
        for v in variants:
            run = runs[v]
            for _ in range(3):
                run.step(batch, criterion)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            allocated = torch.cuda.memory_allocated()
            if v == "ours_timed":
                TIMERS.clear()  # the timed steps of the last round only
            before = _thread_cpu()
            t0 = time.perf_counter()
            issued = 0.0
            for _ in range(args.steps):
                h0 = time.perf_counter()
                run.step(batch, criterion)
                issued += time.perf_counter() - h0
            torch.cuda.synchronize()
            times[v].append((time.perf_counter() - t0) / args.steps * 1e3)
            host[v].append(issued / args.steps * 1e3)
            transient = torch.cuda.max_memory_allocated() - allocated
            peak[v] = max(peak.get(v, 0.0), (resident[v] + transient) / 2**30)
            for tid, (name, cpu) in _thread_cpu().items():
                used = cpu - before.get(tid, (name, 0.0))[1]
                if used > 0:
                    thread_cpu[v][name] += used / args.steps / args.rounds * 1e3
    profiles = {}
    for v in variants[: args.profile]:
        run = runs[v]
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                run.step(batch, criterion)
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
    median = {v: statistics.median(t) for v, t in times.items()}
    out = {"step_ms_median": median, "step_ms_all": dict(times),
           "host_ms_median": {v: statistics.median(t) for v, t in host.items()},
           "thread_cpu_ms_per_step": {v: dict(t) for v, t in thread_cpu.items()},
           "peak_gib_per_variant": peak, "profiles": profiles,
           "timers": {k: {"ms_per_step": e[0] / args.steps * 1e3, "calls_per_step": e[1] / args.steps,
                          "max_ms": e[2] * 1e3}
                      for k, e in TIMERS.items()}}
    if "torch" in median:
        out["speed_vs_torch"] = {v: median["torch"] / t for v, t in median.items()}
    if ctx.is_main:
        print(f"\n== {model_name} (world {ctx.world_size})", flush=True)
        for v in variants:
            ratio = f"  x{out['speed_vs_torch'][v]:.3f} of torch" if "speed_vs_torch" in out else ""
            print(f"  {v:16s} step {median[v]:7.2f} ms   host {out['host_ms_median'][v]:7.2f} ms   "
                  f"peak {peak[v]:5.1f} GiB{ratio}")
        for k, e in out["timers"].items():
            print(f"  timer {k:24s} {e['ms_per_step']:7.3f} ms/step  {e['calls_per_step']:6.1f} calls")
        for v, p in profiles.items():
            print(f"  -- {v} kernels: {json.dumps(p['kernel_ms'])}")
            print(f"     cpu self: {json.dumps(dict(list(p['cpu_self_ms_top'].items())[:10]))}", flush=True)
    for run in runs.values():
        run.close()
    del runs
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="resnet50,bert,vit,gpt2")
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile", type=int, default=0, help="profile the first N variants")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ctx = init_distributed()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    variants = args.variants.split(",")
    result = {"card": torch.cuda.get_device_name(), "world_size": ctx.world_size, "torch": torch.__version__,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())), "variants": variants, "models": {}}
    log_dir = tempfile.mkdtemp(prefix="profile-models-")
    for name in args.models.split(","):
        result["models"][name] = measure(name, variants, ctx, args, log_dir)
    if ctx.is_main and args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    ctx.shutdown()


if __name__ == "__main__":
    main()
