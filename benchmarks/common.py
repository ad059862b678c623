"""What every phase of the suite shares: the environment record, one way to build each GPT
implementation, one training loop, one way to time a phase, and the small timing helpers, so that ours
and torch's are measured identically whatever phase measures them.

Implementations (`build`): ``plain`` (no wrapper: the 1-GPU baseline), ``torch_ddp`` and
``torch_ddp_gav`` (torch's DDP, default and with ``gradient_as_bucket_view=True``, which ours always
does), ``ours_ddp``, ``zero1``, ``zero2``, ``zero3`` (ours), ``torch_fsdp2`` (`fully_shard` per block
and root), and our DDP with a `CommunicationOptimizer`: ``ddp_bf16``, ``ddp_topk`` (1%, error feedback),
``ddp_powersgd`` (rank 4), ``ddp_ring``, ``ddp_tree``; ``ours_ddp_b100`` (our DDP with 100 MiB buckets) and
``torch_ddp_bf16`` (torch's DDP with its bf16 compression hook, the reference for ``ddp_bf16``),
``torch_ddp_powersgd`` (torch's DDP with its PowerSGD hook at rank 4, error feedback and warm start, compressing
from the third step: the reference for ``ddp_powersgd``). A suffix on a
plain DDP name (``ours_ddp``, ``torch_ddp``, ``torch_ddp_gav``) puts its communication on an NCCL group built
differently (`GROUP_SUFFIXES`): ``_hp`` high-priority streams, ``_ctas8`` at most 8 CTAs per collective (fewer SMs
taken from the overlapped backward), ``_ctas32`` exactly 32 (more bandwidth while backward competes).
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from distributed_training import DDP, FSDP, MixedPrecision, Zero1Strategy  # noqa: E402
from distributed_training.comm.optimizer import CommunicationOptimizer  # noqa: E402
from distributed_training.models import GPT  # noqa: E402

GIB = 2**30
MB = 2**20
COMPRESSED = {
    "ddp_bf16": dict(compression="bf16"),
    "ddp_topk": dict(compression="topk", compression_ratio=0.01),
    "ddp_powersgd": dict(compression="powersgd", powersgd_rank=4),
    "ddp_ring": dict(pattern="ring"),
    "ddp_tree": dict(pattern="tree"),
}
IMPLS = ("plain", "torch_ddp", "torch_ddp_gav", "torch_ddp_bf16", "torch_ddp_powersgd", "ours_ddp", "ours_ddp_b100", "zero1", "zero2", "zero3", "torch_fsdp2", *COMPRESSED)

# The suite runs compressed DDP on one process on purpose (compression's cost alone, nothing sent): the
# package's warning about compression over a one-rank data group is expected there.
warnings.filterwarnings("ignore", message=r"compression .* over a data-parallel group of one rank")


# ------------------------------------------------------------------------------------ environment
def environment(world_size: int | None = None) -> dict:
    """Card, versions and driver: recorded in every results file, so a figure names its machine."""
    cuda = torch.cuda.is_available()
    env = {
        "card": torch.cuda.get_device_name() if cuda else "cpu",
        "gpus_visible": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "driver": None,
    }
    if world_size is not None:
        env["world_size"] = world_size
    if cuda:
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            ).stdout.split()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            pass
    return env


def skipped(reason: str) -> dict:
    """What a phase returns when it cannot run here (no GPU, a library missing, one rank only)."""
    return {"status": "skipped", "reason": reason}


def missing_modules(*names: str) -> list[str]:
    import importlib.util

    return [n for n in names if importlib.util.find_spec(n) is None]


# ---------------------------------------------------------------------------------------- timing
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device: torch.device):
    """bf16 autocast on GPUs; CPU runs (the smoke mode) stay in fp32, where CPU kernels are fastest."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def time_best_block(fn, device, reps: int, warmup: int = 2, blocks: int = 3) -> float:
    """Seconds per call: the fastest of `blocks` timed blocks (noise on a shared machine only adds)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    per_block = max(1, reps // blocks)
    for _ in range(blocks):
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(per_block):
            fn()
        synchronize(device)
        best = min(best, (time.perf_counter() - t0) / per_block)
    return best


def time_median_ms(fn, device, repeat: int = 10) -> float:
    """Median milliseconds of one call after one warm-up: CUDA events on a GPU, the wall clock on CPU."""
    fn()
    synchronize(device)
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def median_interval(values: list[float], reps: int = 2000) -> tuple[float, float]:
    """Bootstrap 95% interval of the median of `values` (fixed seed: the same data, the same interval)."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(reps))
    return meds[int(0.025 * reps)], meds[int(0.975 * reps) - 1]


MIN_ROUNDS = 5  # (a bootstrap interval of 2 values is their range, not 95% of anything)


def one_percent_verdict(low: float, high: float, rounds: int) -> str:
    """"yes" / "no" on an overhead (the monitor's, an asynchronous checkpoint's) being at most 1% of a step,
    from the 95% interval of the paired rounds' median, or why it cannot say: too few rounds, or an
    interval wholly below zero (the overhead cannot make a step faster: the rounds' noise is larger than
    what is measured; a smoke run's 2 rounds of the monitor gave -21% to -12%, and it said "yes")."""
    if rounds < MIN_ROUNDS:
        return f"undecided ({rounds} rounds: {MIN_ROUNDS} or more give an interval)"
    if high < 0.0:
        return f"undecided (the interval, {low:+.1f}% to {high:+.1f}%, is below zero: noise over the effect)"
    return "yes" if high <= 1.0 else "no" if low > 1.0 else "undecided (the interval holds 1%)"


def slowest(ctx, values: list[float]) -> list[float]:
    """Each value's maximum over ranks: a job is as slow (and needs as much memory) as its worst rank."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_collective_device(ctx))
    if ctx.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _collective_device(ctx) -> torch.device:
    return ctx.device if ctx.backend == "nccl" else torch.device("cpu")


def peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ GPT training
def make_batches(cfg, micro: int, seq: int, device: torch.device, rank: int, count: int = 4) -> list:
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    batches = []
    for _ in range(count):
        idx = torch.randint(0, cfg.vocab_size, (micro, seq + 1), device=device, generator=g)
        batches.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    return batches


def train_steps(wrapped, opt, batches, start, count, device, no_sync: bool, accum: int = 1):
    """`count` optimizer steps of `accum` micro-batches each; all but the last skip the gradient sync."""
    can_skip = hasattr(wrapped, "no_sync")
    loss = None
    for step in range(start, start + count):
        for micro in range(accum):
            x, y = batches[(step * accum + micro) % len(batches)]
            skip = can_skip and (no_sync or micro < accum - 1)
            with wrapped.no_sync() if skip else contextlib.nullcontext():
                with autocast(device):
                    loss = wrapped(x, y) / accum
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss


def high_priority_group():
    """An NCCL group whose streams have high priority: its kernels get SMs ahead of backward's."""
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return dist.new_group(backend="nccl", pg_options=options)


def limited_ctas_group(max_ctas: int, min_ctas: int | None = None):
    """An NCCL group whose collectives use at most `max_ctas` CTAs (thread blocks, one SM each), and at
    least `min_ctas` when given."""
    options = dist.ProcessGroupNCCL.Options()
    options.config.max_ctas = max_ctas
    if min_ctas is not None:
        options.config.min_ctas = min_ctas
    return dist.new_group(backend="nccl", pg_options=options)


#: implementation-name suffix -> how its NCCL group is made (collective: every rank builds the same, in order)
GROUP_SUFFIXES = {"_hp": high_priority_group, "_ctas8": lambda: limited_ctas_group(8),
                  "_ctas32": lambda: limited_ctas_group(32, 32)}


def split_group_suffix(impl: str) -> tuple[str, str | None]:
    """(base implementation, group suffix or None): ``"ours_ddp_ctas8"`` -> ``("ours_ddp", "_ctas8")``."""
    for suffix in GROUP_SUFFIXES:
        if impl.endswith(suffix):
            return impl[: -len(suffix)], suffix
    return impl, None


def make_groups(impls, backend: str) -> tuple[dict, dict]:
    """(suffix -> NCCL group for every suffix `impls` use, notes on those that cannot be built here)."""
    groups, notes = {}, {}
    for suffix in sorted({split_group_suffix(i)[1] for i in impls} - {None}):
        if backend != "nccl":
            notes[suffix] = f"an NCCL group option: not measured on {backend}"
            continue
        try:
            groups[suffix] = GROUP_SUFFIXES[suffix]()
        except (AttributeError, RuntimeError) as err:  # an option this torch / NCCL lacks
            notes[suffix] = f"could not build the group: {err}"
    return groups, notes


def build(impl: str, cfg, device, ctx, groups: dict | None = None):
    """(wrapped model, optimizer) for one implementation, from a freshly seeded model.

    `groups` maps a name suffix (``"_hp"``, ``"_ctas8"``) to the NCCL group its variants use."""
    base, suffix = split_group_suffix(impl)
    group = None
    if suffix is not None:
        if not groups or groups.get(suffix) is None:
            raise ValueError(f"{impl!r} needs its NCCL group (groups[{suffix!r}]): NCCL only")
        if base not in ("torch_ddp", "torch_ddp_gav", "ours_ddp"):
            raise ValueError(f"the {suffix} suffix applies to torch_ddp, torch_ddp_gav and ours_ddp, not {impl!r}")
        group = groups[suffix]
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    fused = device.type == "cuda"
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=fused)  # noqa: E731
    if base == "plain":
        return model, adamw(model.parameters())
    if base in ("torch_ddp", "torch_ddp_gav", "torch_ddp_bf16", "torch_ddp_powersgd"):
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[device.index] if fused else None,
                                          gradient_as_bucket_view=base == "torch_ddp_gav", process_group=group)
        if base == "torch_ddp_bf16":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

            wrapped.register_comm_hook(None, bf16_compress_hook)
        if base == "torch_ddp_powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

            state = torch_powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=4,
                                                 start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
            wrapped.register_comm_hook(state, torch_powersgd.powerSGD_hook)
        return wrapped, adamw(wrapped.parameters())
    if base in ("ours_ddp", "ours_ddp_b100"):
        wrapped = DDP(model, process_group=group, bucket_cap_mb=100 if base == "ours_ddp_b100" else None)
        return wrapped, adamw(wrapped.parameters())
    if base in COMPRESSED:
        wrapped = DDP(model, communication=CommunicationOptimizer(**COMPRESSED[base]))
        return wrapped, adamw(wrapped.parameters())
    if base == "zero1":
        strategy = Zero1Strategy()
        wrapped = strategy.setup_module(model, ctx)
        return wrapped, strategy.setup_optimizer(adamw, wrapped)
    if base in ("zero2", "zero3"):
        mp = MixedPrecision(torch.bfloat16, torch.float32) if fused else None
        wrapped = FSDP(model, mixed_precision=mp, reshard_after_forward=base == "zero3")
        return wrapped, adamw(wrapped.parameters())
    if base == "torch_fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if fused else \
            MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model, adamw(model.parameters())
    raise ValueError(f"unknown implementation {impl!r} (known: {', '.join(IMPLS)}, and the DDPs with a suffix "
                     f"of {', '.join(GROUP_SUFFIXES)})")


def teardown(wrapped) -> None:
    if isinstance(wrapped, DDP):
        wrapped.remove_hooks()


def run_phase(impl, cfg, batches, warmup: int, steps: int, device, ctx, base_bytes: int, *,
              no_sync: bool = False, accum: int = 1, groups: dict | None = None) -> dict:
    """Build `impl`, warm up, time `steps` steps as one block (one host sync at each end, so the CPU runs
    ahead as in real training). Returns step seconds, peak bytes, bytes left after teardown, the last
    loss and, for a `CommunicationOptimizer`, the bytes this rank sent per step.

    The peak is counted from the memory in use before the phase, so anything an earlier phase failed
    to free is not charged to this one (and shows up as that phase's leftover)."""
    free_memory(device)
    stale = allocated(device) - base_bytes
    peak_reset(device)
    wrapped, opt = build(impl, cfg, device, ctx, groups)
    train_steps(wrapped, opt, batches, 0, warmup, device, no_sync, accum)
    reducer = getattr(wrapped, "bucket_reducer", None)
    sent0 = getattr(reducer, "bytes_sent", None)
    synchronize(device)
    t0 = time.perf_counter()
    loss = train_steps(wrapped, opt, batches, warmup, steps, device, no_sync, accum)
    synchronize(device)
    out = {"step_s": (time.perf_counter() - t0) / steps, "peak_bytes": peak(device) - stale if device.type == "cuda"
           else 0, "loss": loss.item()}
    if sent0 is not None:
        out["bytes_sent_per_step"] = (reducer.bytes_sent - sent0) / steps
    teardown(wrapped)
    del wrapped, opt, loss
    free_memory(device)
    out["leftover_bytes"] = allocated(device) - base_bytes - stale
    return out


def run_solo(ctx, cpu_group, fn) -> dict | None:
    """`fn()` on rank 0 alone while the other ranks wait on a CPU barrier: the 1-GPU baseline measured
    inside a multi-GPU job, interleaved with its other phases. Returns fn's result on rank 0."""
    result = fn() if ctx.rank == 0 else None
    if ctx.world_size > 1:
        dist.barrier(group=cpu_group)
    return result


def time_compute_and_optimizer(cfg, batches, warmup: int, steps: int, device) -> dict:
    """On the bare model: seconds of forward, of backward and of one AdamW step, each timed apart
    (with a device sync around each): what the scaling model's calibration takes from one GPU."""
    model, opt = build("plain", cfg, device, None)
    fwd = bwd = optim = 0.0
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        synchronize(device)
        t0 = time.perf_counter()
        with autocast(device):
            loss = model(x, y)
        synchronize(device)
        t1 = time.perf_counter()
        loss.backward()
        synchronize(device)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize(device)
        t3 = time.perf_counter()
        if i >= warmup:
            fwd, bwd, optim = fwd + t1 - t0, bwd + t2 - t1, optim + t3 - t2
    params = sum(p.numel() for p in model.parameters())
    del model, opt
    free_memory(device)
    return {"forward_s": fwd / steps, "backward_s": bwd / steps, "optimizer_s": optim / steps, "params": params,
            **gpt_units(cfg)}


def gpt_units(cfg) -> dict:
    """Parameters, ZeRO-3 units (blocks) and the largest unit of a GPT config, counted on the meta device."""
    with torch.device("meta"):
        meta = GPT(cfg)
    params = sum(p.numel() for p in meta.parameters())
    blocks = [sum(p.numel() for p in b.parameters()) for b in meta.blocks]
    return {"params": params, "units": len(blocks),
            "largest_unit_params": max(max(blocks), params - sum(blocks))}


# ----------------------------------------------------------------------------------------- plots
def save_figure(fig, ax, path, *, xlabel: str, ylabel: str, title: str, log2x: bool = False) -> None:
    """Label, lay out, write and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    if log2x:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
