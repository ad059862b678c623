"""Image classifiers under our DDP and torch's, images/s per GPU, from synthetic batches and from JPEGs.

Models (our own definitions, `distributed_training.models.vision`), batch 64 a GPU at 224x224, bf16
autocast: ``resnet50`` (channels_last, SGD with momentum, the optimizer of its published recipes) and
``vit_b16`` (fused AdamW, as ViTs are trained). The smoke run (CPU, fp32) takes a resnet18 of width 8
and a one-block ViT of width 48 at 32x32, batch 8. Each variant gets its own copy of the model (same
seed) and optimizer, and ``zero_grad(set_to_none=True)``. The SGD is torch's default (foreach), not the
fused kernel: CUDA's fused SGD refuses a gradient whose strides differ from its parameter's, and our
DDP's gradients (views into a flat bucket, in NCHW order) differ from channels_last weights; each
model records ``grads_unlike_params``, how many such gradients each variant leaves after a backward.

  torch        torch.nn.parallel.DistributedDataParallel: the reference
  ours         our DDP
  ours_folder  our DDP fed by our `ImageFolder` reader: a DataLoader of ``workers`` processes per rank
               (pinned memory, persistent workers, `TrainTransform`: random-resized crop and flip),
               batches copied to the GPU in the step
  ours_nosync  our DDP with every step under ``no_sync()`` (world >= 2 only): the same work with nothing
               sent, i.e. each GPU's compute while the node's other GPUs compute too (the scaling
               model's compute for a loaded node: `phases.imagenet_projection`)

At world >= 2 the phase also times NCCL's all-reduce over a range of sizes up to the model's gradient
(``link``: what the projection calibrates the link inside a node from).

``torch`` and ``ours`` train on one synthetic uint8 batch already on the GPU (a different one per rank),
so they measure the model and the gradient synchronisation; ``ours_folder`` adds decoding and the copy.
Its folder (``jpegs`` random 256x256 JPEGs in 10 classes, 2,048 by default; smooth colour fields with
noise, about 20 KB each) is written once per machine under the temporary directory by each node's
local rank 0 while the others wait, and reused by later jobs (the suite runs each world size in its own
job). Its files are in the page cache after the first pass: the figure is the decode pipeline's, not
the disk's. The images are smaller than ImageNet's typical ones (about 400x350), so the decode rate
here is above what the same workers would reach on ImageNet.

Variants take turns, in reversed order every other round, for `rounds` rounds (3) of `steps` timed
steps (8) after 3 warm-up steps at build and one before each timed block. A timed block is wrapped in
device synchronisations and timed by the wall clock; the per-round time is the slowest rank's and the
median over rounds is reported. Before ``ours_folder``'s block the batches its workers prefetched while
the other variants ran are drained (fetched, not trained), so the block starts in the steady state
rather than on a full queue that would hide an input limit.

The decode rate comes from the reader's `DecodeMeter` (images and seconds spent decoding, counted in
the workers) over the timed blocks: images/s of one process, and times the workers what the pipeline
could deliver per rank. ``input_bound`` is True when ``ours_folder`` ran below 90% of ``ours`` on
synthetic batches. Scaling efficiency needs the world-1 figures: each world size is its own job, so the
report computes it from the world-1 entry of the same results.

``--variants`` (shared with other phases: tokens that are not this phase's are ignored, and recorded):
the variant names above (default all three), ``workers=N`` (loader processes per rank; default 8, 1 in
the smoke run), ``jpegs=N`` (images in the folder) and ``model=NAME`` (only this model; repeatable).
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Sampler

from common import (GIB, allocated, autocast, free_memory, missing_modules, peak, peak_reset, skipped, slowest,
                    synchronize)

VARIANTS = ("torch", "ours", "ours_folder", "ours_nosync")
WARMUP_STEPS = 3     # after building a variant (cudnn's autotuning, the allocator, the loader's workers)
CLASSES = 10         # of the JPEG folder
PREFETCH = 2         # batches each loader worker keeps ready (the DataLoader's prefetch_factor)


def _spec(name: str, smoke: bool) -> dict:
    """How one model is built and trained: preset, shape overrides, image side, batch, optimizer."""
    if name == "resnet50" and not smoke:
        return dict(preset="resnet50", kwargs=dict(channels_last=True), image=224, batch=64, optim="sgd")
    if name == "vit_b16" and not smoke:
        return dict(preset="vit_b16", kwargs={}, image=224, batch=64, optim="adamw")
    if name == "resnet18" and smoke:
        return dict(preset="resnet18", kwargs=dict(width=8, channels_last=True), image=32, batch=8, optim="sgd")
    if name == "vit_tiny" and smoke:
        return dict(preset="vit_b16", kwargs=dict(depth=1, dim=48), image=32, batch=8, optim="adamw")
    known = "resnet18, vit_tiny (smoke)" if smoke else "resnet50, vit_b16"
    raise ValueError(f"images: --variants model={name!r} is not a model of this run (known: {known})")


def _options(opts) -> dict:
    """This phase's settings from ``--variants`` (tokens of other phases ignored, and listed)."""
    asked = [v for v in (opts.variants or "").split(",") if v]
    variants = [v for v in asked if v in VARIANTS] or list(VARIANTS)
    out = {"variants": variants, "workers": 1 if opts.smoke else 8, "jpegs": 64 if opts.smoke else 2048,
           "models": [], "ignored": []}
    for token in asked:
        key, eq, value = token.partition("=")
        if not eq:
            if token not in VARIANTS:
                out["ignored"].append(token)
            continue
        if key == "model":
            out["models"].append(value)
        elif key in ("workers", "jpegs"):
            try:
                out[key] = int(value)
            except ValueError:
                raise ValueError(f"images: --variants {key}= takes an integer, got {value!r}") from None
            if out[key] < (0 if key == "workers" else CLASSES):
                raise ValueError(f"images: --variants {key}={value} must be at least "
                                 f"{0 if key == 'workers' else CLASSES}")
        else:
            out["ignored"].append(token)
    out["models"] = out["models"] or (["resnet18", "vit_tiny"] if opts.smoke else ["resnet50", "vit_b16"])
    return out


# ------------------------------------------------------------------------------------- the JPEG folder
def _write_folder(root: str, count: int, side: int) -> None:
    """`count` JPEGs of `side` x `side` in `CLASSES` class folders under `root`: each an 8x8 random
    colour field upsampled (bicubic) plus noise, so they compress and decode like photographs more than
    white noise does. Written to a sibling folder then renamed: a concurrent writer's folder wins whole."""
    from PIL import Image

    staging = tempfile.mkdtemp(prefix=os.path.basename(root) + ".", dir=os.path.dirname(root))
    rng = np.random.default_rng(0)
    for i in range(count):
        folder = os.path.join(staging, f"class_{i % CLASSES:02d}")
        os.makedirs(folder, exist_ok=True)
        field = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize((side, side), Image.BICUBIC)
        pixels = np.asarray(field, dtype=np.int16) + rng.integers(-12, 13, (side, side, 3), dtype=np.int16)
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(os.path.join(folder, f"{i:05d}.jpg"),
                                                                       quality=90)
    try:
        os.rename(staging, root)
    except OSError:  # another job wrote it first
        import shutil

        shutil.rmtree(staging, ignore_errors=True)


def jpeg_folder(ctx, count: int, side: int) -> tuple[str, float]:
    """(folder, seconds this job spent writing it): written by each node's local rank 0 unless an
    earlier job on this machine left it; every rank waits at a barrier."""
    root = os.path.join(tempfile.gettempdir(), f"dt-suite-images-{count}x{side}")
    seconds = 0.0
    if ctx.local_rank == 0 and not os.path.isdir(root):
        t0 = time.perf_counter()
        _write_folder(root, count, side)
        seconds = time.perf_counter() - t0
    ctx.barrier()
    return root, seconds


class _Endless(Sampler):
    """This rank's shard of a fresh permutation each epoch, epoch after epoch: one loader iterator for
    the whole phase, so no epoch boundary (workers idle while the next epoch's prefetch starts) is timed."""

    def __init__(self, dataset, ctx) -> None:
        from distributed_training.data import ShardedSampler

        self.shards = ShardedSampler(dataset, ctx.world_size, ctx.rank, shuffle=True, seed=0, drop_last=True)

    def __iter__(self):
        epoch = 0
        while True:
            self.shards.set_epoch(epoch)
            yield from self.shards
            epoch += 1


class FolderInput:
    """The image-folder reader behind a DataLoader, one iterator for the phase, and its decode meter."""

    def __init__(self, root: str, image: int, batch: int, workers: int, ctx) -> None:
        from distributed_training.datasets.images import ImageFolder, TrainTransform

        self.dataset = ImageFolder(root, TrainTransform(image))
        self.workers, self.batch, self.device = workers, batch, ctx.device
        extra = dict(persistent_workers=True, prefetch_factor=PREFETCH) if workers > 0 else {}
        self.loader = DataLoader(self.dataset, batch_size=batch, sampler=_Endless(self.dataset, ctx),
                                 num_workers=workers, pin_memory=ctx.device.type == "cuda", drop_last=True, **extra)
        self.it = iter(self.loader)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = next(self.it)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def drain(self) -> None:
        """Fetch (and drop) the batches the workers could have ready: the queue is then empty."""
        for _ in range(self.workers * PREFETCH):
            next(self.it)

    def close(self) -> None:
        del self.it, self.loader
        gc.collect()


# ------------------------------------------------------------------------------------------- variants
class Variant:
    """One variant of one model: the wrapped model, its optimizer, where its batches come from."""

    def __init__(self, name: str, spec: dict, ctx, synthetic, folder: FolderInput | None) -> None:
        from distributed_training import DDP
        from distributed_training.models import build_vision_model

        self.name, self.device = name, ctx.device
        torch.manual_seed(0)  # every variant (and rank) starts from the same weights
        model = build_vision_model(spec["preset"], 1000, spec["image"], **spec["kwargs"]).to(ctx.device)
        if name == "torch":
            self.model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        else:
            self.model = DDP(model)
        if spec["optim"] == "sgd":
            # Not fused: CUDA's fused SGD refuses gradients laid out unlike their parameters, which our
            # DDP's bucket views are for channels_last weights (see `grads_unlike_params`).
            self.opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-5)
        else:
            self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05,
                                         fused=ctx.device.type == "cuda")
        self.synthetic, self.folder = synthetic, folder if name == "ours_folder" else None
        self.loss = None
        self.params = sum(p.numel() for p in model.parameters())

    def step(self) -> None:
        x, y = self.folder.next() if self.folder is not None else self.synthetic
        with self.model.no_sync() if self.name == "ours_nosync" else contextlib.nullcontext():
            with autocast(self.device):
                loss = F.cross_entropy(self.model(x), y)
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.loss = loss.detach()

    def grads_unlike_params(self) -> int:
        """Parameters whose gradient, after one synchronised backward, is laid out unlike the parameter
        (strides differ along a dimension longer than 1): fused and foreach optimizers want them alike."""
        x, y = self.synthetic
        with autocast(self.device):
            loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        unlike = sum(1 for p in self.model.parameters() if p.grad is not None and any(
            n > 1 and a != b for n, a, b in zip(p.shape, p.stride(), p.grad.stride())))
        self.opt.zero_grad(set_to_none=True)
        return unlike

    def close(self) -> None:
        from distributed_training import DDP

        if isinstance(self.model, DDP):
            self.model.remove_hooks()


def measure(model_name: str, ctx, opts, o: dict, folder: FolderInput | None, rounds: int, steps: int) -> dict:
    spec = _spec(model_name, opts.smoke)
    device, batch = ctx.device, spec["batch"]
    g = torch.Generator(device=device).manual_seed(1000 + ctx.rank)
    synthetic = (torch.randint(0, 256, (batch, 3, spec["image"], spec["image"]), dtype=torch.uint8, device=device,
                               generator=g),
                 torch.randint(0, 1000, (batch,), device=device, generator=g))
    runs, resident, unlike = {}, {}, {}
    for v in o["variants"]:
        if v == "ours_nosync" and ctx.world_size == 1:
            continue  # nothing to leave out: at one GPU our DDP sends nothing anyway
        free_memory(device)
        synchronize(device)
        before = allocated(device)
        runs[v] = Variant(v, spec, ctx, synthetic, folder)
        for _ in range(WARMUP_STEPS if not opts.smoke else 1):
            runs[v].step()
        synchronize(device)
        resident[v] = allocated(device) - before
        unlike[v] = runs[v].grads_unlike_params()
    times = {v: [] for v in runs}
    peak_bytes = dict.fromkeys(runs, 0)
    decoded = [0.0, 0.0, 0.0]  # images, decoding seconds (every worker), wall seconds of ours_folder's blocks
    for rnd in range(rounds):
        for v in (list(runs) if rnd % 2 == 0 else list(runs)[::-1]):  # no variant always runs after another
            run = runs[v]
            if run.folder is not None:
                run.folder.drain()
            run.step()
            gc.collect()  # the garbage of the variant before is not this one's to collect
            synchronize(device)
            peak_reset(device)
            in_use = allocated(device)
            meter0 = folder.dataset.meter.totals() if run.folder is not None else None
            t0 = time.perf_counter()
            for _ in range(steps):
                run.step()
            synchronize(device)
            seconds = time.perf_counter() - t0
            times[v].append(seconds / steps)
            peak_bytes[v] = max(peak_bytes[v], resident[v] + peak(device) - in_use if device.type == "cuda" else 0)
            if meter0 is not None:
                images, busy = folder.dataset.meter.totals()
                decoded = [decoded[0] + images - meter0[0], decoded[1] + busy - meter0[1], decoded[2] + seconds]
    losses = {v: float(run.loss) for v, run in runs.items()}
    params = next(iter(runs.values())).params
    for run in runs.values():
        run.close()
    del runs
    free_memory(device)

    # The slowest rank's time of each round; the largest peak; each rank's decode rates, the slowest's.
    names = list(times)
    flat = slowest(ctx, [t for v in names for t in times[v]] + [peak_bytes[v] for v in names] +
                        [-(decoded[0] / decoded[1]) if decoded[1] > 0 else 0.0,
                         -(decoded[0] / decoded[2]) if decoded[2] > 0 else 0.0])
    step_s = {v: flat[i * rounds:(i + 1) * rounds] for i, v in enumerate(names)}
    peaks = dict(zip(names, flat[len(names) * rounds:len(names) * (rounds + 1)]))
    median = {v: statistics.median(t) for v, t in step_s.items()}
    ips = {v: batch / median[v] for v in names}
    out = {"preset": spec["preset"], "shape": spec["kwargs"], "image_size": spec["image"], "batch_per_gpu": batch,
           "params": params,
           "optimizer": "SGD momentum 0.9 (foreach)" if spec["optim"] == "sgd" else "AdamW (fused on GPUs)",
           "step_ms_median": {v: median[v] * 1e3 for v in names},
           "step_ms_rounds": {v: [t * 1e3 for t in step_s[v]] for v in names},
           "images_per_s_per_gpu": ips, "images_per_s_total": {v: ips[v] * ctx.world_size for v in names},
           "peak_gib": {v: peaks[v] / GIB for v in names}, "last_loss_rank0": losses,
           "grads_unlike_params": unlike}
    if "torch" in ips:
        out["vs_torch"] = {v: ips[v] / ips["torch"] for v in names}
        # Paired by round: the variants of one round ran next to each other, so their ratio cancels drift.
        paired = {v: sorted(a / b for a, b in zip(step_s["torch"], step_s[v])) for v in names}
        out["vs_torch_paired"] = {v: {"median": statistics.median(r), "min": r[0], "max": r[-1]}
                                  for v, r in paired.items()}
    if "ours_folder" in ips:
        per_process = -flat[-2]  # the slowest rank's
        out["input"] = {
            "workers_per_rank": o["workers"],
            "decoded_images_per_s_per_process": per_process,
            # With no workers the training process decodes, between steps: one process's rate is the limit.
            "decode_capacity_images_per_s_per_rank": per_process * max(1, o["workers"]),
            "decoded_images_per_s_during_blocks": -flat[-1],
        }
        if "ours" in ips:
            out["input"]["folder_vs_synthetic"] = ips["ours_folder"] / ips["ours"]
            out["input"]["input_bound"] = ips["ours_folder"] < 0.9 * ips["ours"]
    if ctx.is_main:
        print(f"\n== {model_name} (world {ctx.world_size}, batch {batch} a GPU)", flush=True)
        for v in names:
            vs = f"  x{out['vs_torch'][v]:.3f} of torch" if "vs_torch" in out else ""
            print(f"  {v:12s} step {median[v] * 1e3:8.2f} ms  {ips[v]:9,.0f} images/s/GPU  peak "
                  f"{peaks[v] / GIB:5.2f} GiB{vs}", flush=True)
        if "input" in out:
            i = out["input"]
            print(f"  input: {i['decoded_images_per_s_per_process']:,.0f} images/s decoded per process, "
                  f"{i['decode_capacity_images_per_s_per_rank']:,.0f}/s with {o['workers']} workers a rank"
                  + (f"; folder / synthetic {i['folder_vs_synthetic']:.2f} (input-bound: {i['input_bound']})"
                     if "input_bound" in i else ""), flush=True)
    return out


def link_sweep(ctx, largest: int, smoke: bool) -> dict:
    """NCCL's (gloo's) all-reduce of fp32 tensors from 1/256 of `largest` bytes up to it, by fours: the
    median of 5 timed calls after 2 untimed, the slowest rank's."""
    import torch.distributed as dist

    sizes, size = [], largest
    while len(sizes) < 5 and size >= 4096:
        sizes.append(size)
        size //= 4
    seconds = []
    for nbytes in sorted(sizes):
        t = torch.ones(nbytes // 4, device=ctx.device)
        times = []
        for i in range(7):
            synchronize(ctx.device)
            t0 = time.perf_counter()
            dist.all_reduce(t)
            synchronize(ctx.device)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        seconds.append(statistics.median(times))
        del t
    slow = slowest(ctx, seconds)
    return {"world": ctx.world_size, "op": "ring_all_reduce", "bytes": sorted(sizes), "seconds": slow,
            "backend": "gloo" if smoke else "nccl"}


def run(ctx, opts) -> dict:
    o = _options(opts)
    no_folder = None
    if "ours_folder" in o["variants"] and missing_modules("PIL"):
        no_folder = "ours_folder not run: it reads JPEGs with Pillow, which is not installed (the images extra)"
        o["variants"] = [v for v in o["variants"] if v != "ours_folder"]
        if not o["variants"]:
            return skipped(no_folder)
    rounds = opts.rounds or (1 if opts.smoke else 3)
    steps = opts.steps or (2 if opts.smoke else 8)
    specs = {name: _spec(name, opts.smoke) for name in o["models"]}
    result = {"status": "ok", "variants": o["variants"], "rounds": rounds, "steps": steps,
              "warmup_steps": WARMUP_STEPS if not opts.smoke else 1,
              "precision": "bf16 autocast" if ctx.device.type == "cuda" else "fp32 (CPU)", "models": {}}
    if no_folder:
        result["note"] = no_folder
    if o["ignored"]:
        result["variants_ignored"] = o["ignored"]
    benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = ctx.device.type == "cuda"  # fixed shapes: let cudnn pick its kernels
    folders: dict = {}  # (image side, batch) -> FolderInput: one loader serves every model of that shape
    try:
        for name, spec in specs.items():
            folder = None
            if "ours_folder" in o["variants"]:
                key = (spec["image"], spec["batch"])
                if key not in folders:
                    side = 256 if spec["image"] == 224 else spec["image"] + spec["image"] // 4
                    root, seconds = jpeg_folder(ctx, o["jpegs"], side)
                    result["folder"] = {"root": root, "jpegs": o["jpegs"], "side": side, "classes": CLASSES,
                                        "write_s": result.get("folder", {}).get("write_s", 0.0) + seconds,
                                        "workers_per_rank": o["workers"], "pin_memory": ctx.device.type == "cuda"}
                    folders[key] = FolderInput(root, spec["image"], spec["batch"], o["workers"], ctx)
                folder = folders[key]
            result["models"][name] = measure(name, ctx, opts, o, folder, rounds, steps)
        if ctx.world_size > 1:
            largest = max(4 * m["params"] for m in result["models"].values())  # the fp32 gradient's bytes
            result["link"] = link_sweep(ctx, largest, opts.smoke)
    finally:
        for folder in folders.values():
            folder.close()
        torch.backends.cudnn.benchmark = benchmark
    return result
