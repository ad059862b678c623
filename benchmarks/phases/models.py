"""Third-party models: our DDP and trainer against torch DDP, step time of variants, interleaved.

Models are built from their configs (no downloaded weights): timm ResNet-50 and ViT-B/16 at 64 images of
224x224 per GPU, Hugging Face BERT-base MLM and GPT-2 at 16x512 tokens per GPU; ``toy_cnn`` (torch only,
the smoke run's) at 8 images of 32x32. Every variant gets its own copy of the model (same seed) and
optimizer (AdamW, fused on GPUs, bf16 autocast on GPUs, ``zero_grad(set_to_none=True)``); variants take
turns (the order reversed every other round) for `rounds` rounds of `steps` steps, and the median step time is reported with the host time
spent issuing the steps, each thread's CPU time per step (from /proc), peak memory per variant with its
parts (after construction, after the first step, between steps, the first steps' peak, a step's transient), and
(``--models-profile N``) a torch.profiler window of the first N variants.

Variants (``--variants``; default: plain,torch,ours,trainer,trainer_monitor,ours_nosync):
  plain            the bare model, no communication
  torch            torch.nn.parallel.DistributedDataParallel (torch_view: gradient_as_bucket_view)
  ours             our DDP (ours_nobcast: broadcast_buffers=False; ours_nosync: our hooks under no_sync,
                   no communication; ours_noop: the synchronised hook path with a reducer that sends
                   nothing; ours_timed: host time of each method of the hook path)
  trainer          DistributedTrainer(strategy="ddp", mixed_precision="bf16" on GPUs).train_step
  trainer_monitor  the same with a Monitor (log_dir, log_every=10), recorded as fit records each step
  trainer_read     the trainer, its loss read on the host every 10th step (a logging loop's sync, no Monitor)
  trainer_zero3    DistributedTrainer(strategy="zero3").train_step
  trainer_zero3_root  the same with the whole model one FSDP unit (``auto_wrap_policy=10**15``)
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

from common import GIB, allocated, autocast, free_memory, missing_modules, peak, peak_reset, skipped, synchronize

DEFAULT_VARIANTS = "plain,torch,ours,trainer,trainer_monitor,ours_nosync"
GPU_MODELS = "resnet50,bert,vit,gpt2"
SMOKE_MODELS = "toy_cnn"
NEEDS = {"resnet50": "timm", "vit": "timm", "bert": "transformers", "gpt2": "transformers", "toy_cnn": None}
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
    """{tid: (name, cpu seconds)} for every thread of this process, from /proc (empty elsewhere)."""
    out = {}
    if not os.path.isdir("/proc/self/task"):
        return out
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
    if name == "toy_cnn":
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(4),
            torch.nn.Flatten(), torch.nn.Linear(256, 10))
        x = torch.randn(8, 3, 32, 32, device=device)
        return model.to(device), (x, torch.randint(0, 10, (8,), device=device)), F.cross_entropy
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
    elif name == "gpt2":
        cfg = transformers.GPT2Config()
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        raise ValueError(f"unknown model {name!r} (known: {', '.join(NEEDS)})")
    ids = torch.randint(0, cfg.vocab_size, (16, 512), device=device)
    return model.to(device), {"input_ids": ids, "labels": ids}, None


def loss_of(model, batch, criterion):
    if criterion is None:
        return model(**batch).loss
    return criterion(model(batch[0]), batch[1])


class Variant:
    """One way of running a step: a wrapper + optimizer, or a trainer."""

    def __init__(self, name: str, model, ctx, log_dir: str):
        from distributed_training import DistributedTrainer

        self.name = name
        self.device = ctx.device
        self.trainer = None
        self.steps = 0
        fused = ctx.device.type == "cuda"
        factory = lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=fused)  # noqa: E731
        if name.startswith("trainer"):
            from distributed_training import FSDPStrategy

            strategy = {"trainer_zero3": "zero3",
                        # one unit for the whole model: no module holds 10**15 parameters
                        "trainer_zero3_root": FSDPStrategy(auto_wrap_policy=10 ** 15)}.get(name, "ddp")
            self.trainer = DistributedTrainer(
                model, factory, strategy=strategy,
                mixed_precision="bf16" if fused else None, context=ctx,
                log_dir=os.path.join(log_dir, name) if name == "trainer_monitor" else None, log_every=10,
                progress=False)
            return
        self.wrapped = self._wrap(model, ctx.device)
        self.opt = factory(model.parameters())

    def _wrap(self, model, device):
        from distributed_training import DDP

        v = self.name
        if v == "plain":
            return model
        if v.startswith("torch"):
            return torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None,
                gradient_as_bucket_view=v == "torch_view")
        if v == "ours_noop":
            from distributed_training.comm.reduce import CompletedWork

            return DDP(model, bucket_reducer=lambda bucket, group: CompletedWork())
        ddp = DDP(model, broadcast_buffers=v != "ours_nobcast")
        if v == "ours_timed":
            for method in ("_on_grad_ready", "_gather_bucket", "_launch_ready_buckets", "_finish_backward"):
                setattr(ddp, method, _timed(method, getattr(ddp, method)))
            ddp.bucket_reducer = _timed("bucket_reducer", ddp.bucket_reducer)
        return ddp

    def step(self, batch, criterion) -> None:
        if self.trainer is not None:
            start = time.perf_counter()
            metrics = self.trainer.train_step(batch, criterion)
            if self.name == "trainer_monitor":
                self.trainer._record_step(batch, metrics, step_time=time.perf_counter() - start, data_time=0.0)
            self.steps += 1
            if self.name == "trainer_read" and self.steps % 10 == 0:
                float(metrics["loss"])
            return
        with self.wrapped.no_sync() if self.name == "ours_nosync" else contextlib.nullcontext():
            with autocast(self.device):
                loss = loss_of(self.wrapped, batch, criterion)
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        from distributed_training import DDP

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


def measure(model_name, variants, ctx, opts, log_dir, rounds, steps) -> dict:
    from torch.profiler import ProfilerActivity, profile

    device = ctx.device
    # Peak memory of a variant alone = what it keeps between steps (model, wrapper buffers, optimizer
    # state, gradients left set) + the most a step adds on top; every variant's model stays resident.
    # Each figure is a difference of `memory_allocated` readings, so everything freed late must be freed
    # before the first reading: `_settle` (see there). `memory[v]` breaks the figure down: bytes held after
    # construction (model, wrapper, optimizer), after the first step, between steps (resident), the peak
    # of the build and warm-up steps (the first steps allocate the optimizer state and rebuild buckets),
    # and the most a steady-state step adds (transient).
    runs, resident, peak_gib, memory = {}, {}, {}, {}
    batch = criterion = None
    for v in variants:
        _settle(device)
        before = allocated(device)
        peak_reset(device)
        torch.manual_seed(0)
        model, own_batch, criterion = build(model_name, device)
        runs[v] = Variant(v, model, ctx, log_dir)
        synchronize(device)
        mem = memory[v] = {"constructed": (allocated(device) - before) / GIB}
        for i in range(3 if not opts.smoke else 1):
            runs[v].step(own_batch, criterion)
            if i == 0:
                synchronize(device)
                mem["after_first_step"] = (allocated(device) - before) / GIB
        if batch is None:
            batch = own_batch  # every variant trains on the first one's batch (same seed, same data)
        del model, own_batch   # a later variant's batch is freed here, not during the next build
        synchronize(device)
        mem["first_steps_peak"] = (peak(device) - before) / GIB
        _settle(device)
        resident[v] = allocated(device) - before
        mem["resident"] = resident[v] / GIB
    times, host = defaultdict(list), defaultdict(list)
    thread_cpu = defaultdict(lambda: defaultdict(float))
    for rnd in range(rounds):
        for v in (variants if rnd % 2 == 0 else variants[::-1]):  # no variant always runs after another
            run = runs[v]
            for _ in range(3 if not opts.smoke else 1):
                run.step(batch, criterion)
            gc.collect()  # the garbage of the variant before is not this one's to collect
            synchronize(device)
            peak_reset(device)
            in_use = allocated(device)
            if v == "ours_timed":
                TIMERS.clear()  # the timed steps of the last round only
            before = _thread_cpu()
            t0 = time.perf_counter()
            issued = 0.0
            for _ in range(steps):
                h0 = time.perf_counter()
                run.step(batch, criterion)
                issued += time.perf_counter() - h0
            synchronize(device)
            times[v].append((time.perf_counter() - t0) / steps * 1e3)
            host[v].append(issued / steps * 1e3)
            transient = peak(device) - in_use if device.type == "cuda" else 0
            peak_gib[v] = max(peak_gib.get(v, 0.0), (resident[v] + transient) / GIB)
            memory[v]["step_transient"] = max(memory[v].get("step_transient", 0.0), transient / GIB)
            for tid, (name, cpu) in _thread_cpu().items():
                used = cpu - before.get(tid, (name, 0.0))[1]
                if used > 0:
                    thread_cpu[v][name] += used / steps / rounds * 1e3
    profiles = {}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for v in variants[: opts.models_profile]:
        run = runs[v]
        synchronize(device)
        with profile(activities=activities) as prof:
            for _ in range(3):
                run.step(batch, criterion)
            synchronize(device)
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
           "peak_gib_per_variant": peak_gib, "memory_gib_per_variant": memory, "profiles": profiles,
           "timers": {k: {"ms_per_step": e[0] / steps * 1e3, "calls_per_step": e[1] / steps, "max_ms": e[2] * 1e3}
                      for k, e in TIMERS.items()}}
    if "torch" in median:
        out["speed_vs_torch"] = {v: median["torch"] / t for v, t in median.items()}
        # Paired by round: each round's torch step over the variant's in the same round (they ran next to
        # each other), then the median and range over rounds. Host-bound models drift by 10-20% between
        # rounds (CPU clocks, neighbours); a ratio within a round cancels most of that drift.
        paired = {v: sorted(a / b for a, b in zip(times["torch"], t)) for v, t in times.items()}
        out["speed_vs_torch_paired"] = {v: {"median": statistics.median(r), "min": r[0], "max": r[-1]}
                                        for v, r in paired.items()}
    if ctx.is_main:
        print(f"\n== {model_name} (world {ctx.world_size})", flush=True)
        for v in variants:
            ratio = f"  x{out['speed_vs_torch'][v]:.3f} of torch" if "speed_vs_torch" in out else ""
            print(f"  {v:16s} step {median[v]:7.2f} ms   host {out['host_ms_median'][v]:7.2f} ms   "
                  f"peak {peak_gib[v]:5.1f} GiB{ratio}")
        for v in variants:
            print(f"  memory {v:16s} " + "  ".join(f"{k} {x:.3f}" for k, x in memory[v].items()) + " GiB")
        for k, e in out["timers"].items():
            print(f"  timer {k:24s} {e['ms_per_step']:7.3f} ms/step  {e['calls_per_step']:6.1f} calls")
        for v, p in profiles.items():
            print(f"  -- {v} kernels: {json.dumps(p['kernel_ms'])}")
            print(f"     cpu self: {json.dumps(dict(list(p['cpu_self_ms_top'].items())[:10]))}", flush=True)
    for run in runs.values():
        run.close()
    del runs
    free_memory(device)
    return out


def _settle(device) -> None:
    """Let go of everything already dropped before a memory reading: Python garbage, and on NCCL the
    tensors the process group keeps for collectives already done (a previous variant's buckets) until its
    watchdog or next collective releases them. Released during the next variant's build instead, they
    made that variant's resident memory look smaller by their size (torch DDP's GPT-2 and ResNet-50
    after a previous model, 2026-11-27: by the previous model's parameter bytes)."""
    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized() and dist.get_world_size() > 1:
        probe = torch.zeros(1, device=device)
        dist.all_reduce(probe)
        del probe
    synchronize(device)
    if device.type == "cuda":
        time.sleep(0.25)  # the NCCL watchdog polls every 100 ms
    gc.collect()


def run(ctx, opts) -> dict:
    if ctx.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    variants = [v for v in (opts.variants or DEFAULT_VARIANTS).split(",") if v]
    rounds = opts.rounds or (1 if opts.smoke else 3)
    steps = opts.steps or (2 if opts.smoke else 10)
    result = {"status": "ok", "variants": variants, "rounds": rounds, "steps": steps,
              "precision": "bf16 autocast, fused AdamW" if ctx.device.type == "cuda" else "fp32 (CPU)", "models": {}}
    log_dir = tempfile.mkdtemp(prefix="suite-models-")
    for name in (opts.third_party or (SMOKE_MODELS if opts.smoke else GPU_MODELS)).split(","):
        if name not in NEEDS:
            raise ValueError(f"models: unknown model {name!r} (known: {', '.join(NEEDS)})")
        missing = missing_modules(NEEDS[name]) if NEEDS[name] else []
        if missing:
            result["models"][name] = skipped(f"{missing[0]} is not installed")
            continue
        result["models"][name] = measure(name, variants, ctx, opts, log_dir, rounds, steps)
        if getattr(opts, "save_partial", None):  # a world's job ended by its timeout keeps the models done
            opts.save_partial("models", result)
    return result
