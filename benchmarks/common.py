"""What every benchmark here shares: the environment record, one way to build each implementation,
one training loop and one way to time a phase (so that ours and torch's are measured identically).

Implementations (`build`): ``plain`` (no wrapper: the 1-GPU baseline), ``torch_ddp``, ``ours_ddp``,
``zero1``, ``zero2``, ``zero3`` (ours), ``torch_fsdp2`` (`fully_shard` per block and root), and our DDP
with a `CommunicationOptimizer`: ``ddp_bf16``, ``ddp_topk`` (1%, error feedback), ``ddp_powersgd``
(rank 4), ``ddp_ring``, ``ddp_tree``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from distributed_training import DDP, FSDP, MixedPrecision, Zero1Strategy  # noqa: E402
from distributed_training.comm.optimizer import CommunicationOptimizer  # noqa: E402
from distributed_training.models import GPT  # noqa: E402

GIB = 2**30
COMPRESSED = {
    "ddp_bf16": dict(compression="bf16"),
    "ddp_topk": dict(compression="topk", compression_ratio=0.01),
    "ddp_powersgd": dict(compression="powersgd", powersgd_rank=4),
    "ddp_ring": dict(pattern="ring"),
    "ddp_tree": dict(pattern="tree"),
}
IMPLS = ("plain", "torch_ddp", "ours_ddp", "zero1", "zero2", "zero3", "torch_fsdp2", *COMPRESSED)


def save_figure(fig, ax, path, *, xlabel: str, ylabel: str, title: str, log2x: bool = False) -> None:
    """Label, lay out, write and close a matplotlib figure (the suite's and model_check's plots)."""
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


def environment() -> dict:
    env = {
        "card": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    try:
        env["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        ).stdout.split()[0]
    except Exception:
        pass
    return env


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_batches(cfg, micro: int, seq: int, device: torch.device, rank: int, count: int = 4) -> list:
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    batches = []
    for _ in range(count):
        idx = torch.randint(0, cfg.vocab_size, (micro, seq + 1), device=device, generator=g)
        batches.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    return batches


def _autocast(device: torch.device):
    # bf16 autocast on GPUs; CPU runs (the smoke mode) stay in fp32, where CPU kernels are fastest.
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def train_steps(wrapped, opt, batches, start, count, device, no_sync: bool, accum: int = 1):
    """`count` optimizer steps of `accum` micro-batches each; all but the last skip the gradient sync."""
    can_skip = hasattr(wrapped, "no_sync")
    loss = None
    for step in range(start, start + count):
        for micro in range(accum):
            x, y = batches[(step * accum + micro) % len(batches)]
            skip = can_skip and (no_sync or micro < accum - 1)
            with wrapped.no_sync() if skip else contextlib.nullcontext():
                with _autocast(device):
                    loss = wrapped(x, y) / accum
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss


def build(impl: str, cfg, device, ctx):
    """(wrapped model, optimizer) for one implementation, from a freshly seeded model."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    fused = device.type == "cuda"
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=fused)  # noqa: E731
    if impl == "plain":
        return model, adamw(model.parameters())
    if impl == "torch_ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[device.index] if fused else None)
        return wrapped, adamw(wrapped.parameters())
    if impl == "ours_ddp":
        wrapped = DDP(model)
        return wrapped, adamw(wrapped.parameters())
    if impl in COMPRESSED:
        wrapped = DDP(model, communication=CommunicationOptimizer(**COMPRESSED[impl]))
        return wrapped, adamw(wrapped.parameters())
    if impl == "zero1":
        strategy = Zero1Strategy()
        wrapped = strategy.setup_module(model, ctx)
        return wrapped, strategy.setup_optimizer(adamw, wrapped)
    if impl in ("zero2", "zero3"):
        mp = MixedPrecision(torch.bfloat16, torch.float32) if device.type == "cuda" else None
        wrapped = FSDP(model, mixed_precision=mp, reshard_after_forward=impl == "zero3")
        return wrapped, adamw(wrapped.parameters())
    if impl == "torch_fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if fused else \
            MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model, adamw(model.parameters())
    raise ValueError(f"unknown implementation {impl!r} (known: {', '.join(IMPLS)})")


def run_phase(impl, cfg, batches, warmup: int, steps: int, device, ctx, base_bytes: int, *,
              no_sync: bool = False, accum: int = 1) -> dict:
    """Build `impl`, warm up, time `steps` steps as one block (one host sync at each end, so the CPU runs
    ahead as in real training). Returns step seconds, peak bytes, bytes left after teardown, the last
    loss and, for a `CommunicationOptimizer`, the bytes this rank sent per step.

    The peak is counted from the memory in use before the phase, so anything an earlier phase failed
    to free is not charged to this one (and shows up as that phase's leftover)."""
    gc.collect()
    stale = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        stale = torch.cuda.memory_allocated() - base_bytes
    wrapped, opt = build(impl, cfg, device, ctx)
    train_steps(wrapped, opt, batches, 0, warmup, device, no_sync, accum)
    reducer = getattr(wrapped, "bucket_reducer", None)
    sent0 = getattr(reducer, "bytes_sent", None)
    synchronize(device)
    t0 = time.perf_counter()
    loss = train_steps(wrapped, opt, batches, warmup, steps, device, no_sync, accum)
    synchronize(device)
    step_s = (time.perf_counter() - t0) / steps
    out = {"step_s": step_s, "peak_bytes": torch.cuda.max_memory_allocated() - stale if device.type == "cuda" else 0,
           "loss": loss.item()}
    if sent0 is not None:
        out["bytes_sent_per_step"] = (reducer.bytes_sent - sent0) / steps
    if isinstance(wrapped, DDP):
        wrapped.remove_hooks()
    del wrapped, opt, loss
    gc.collect()
    out["leftover_bytes"] = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        out["leftover_bytes"] = torch.cuda.memory_allocated() - base_bytes - stale
    return out


def time_compute_and_optimizer(cfg, batches, warmup: int, steps: int, device) -> dict:
    """On the bare model: seconds of forward, of backward and of one AdamW step, each timed apart
    (with a device sync around each), for the scaling model's calibration."""
    model, opt = build("plain", cfg, device, None)
    fwd = bwd = optim = 0.0
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        synchronize(device)
        t0 = time.perf_counter()
        with _autocast(device):
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
    units = len(model.blocks)
    largest = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    del model, opt
    gc.collect()
    return {"forward_s": fwd / steps, "backward_s": bwd / steps, "optimizer_s": optim / steps, "params": params,
            "units": units, "largest_unit_params": largest}
