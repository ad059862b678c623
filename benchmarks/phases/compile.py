"""torch.compile under our DDP: GPT tokens/s eager and compiled, in both orders and per block, against
torch's DDP (eager and compiled) as the reference, every variant built from the same seed and timed in
interleaved rounds (reversed every other round) in the same processes.

Variants (``--impls`` picks among them; default all that apply):

* ``ours_ddp``: our DDP, eager.
* ``ours_compile(ddp)``: ``torch.compile(DDP(model))``, the order most users write.
* ``ours_ddp(compile)``: ``DDP(torch.compile(model))``.
* ``ours_ddp(blocks)``: our DDP over a model whose blocks are compiled one by one. A whole-model graph
  has one backward, so every gradient (and so every bucket's all-reduce) comes at its end; compiled
  per block, each block's gradients arrive when its backward ends and buckets overlap as in eager.
* ``torch_ddp``, ``torch_compile(ddp)``: torch's DDP eager, and compiled (dynamo's DDP optimizer splits
  the graph at bucket boundaries to keep the overlap); world >= 2 only (torch's own reference).
* ``torch_ddp(blocks)``: torch's DDP over per-block compiled blocks (the 1.3B model).

Compilation is excluded from the timings: each variant trains `warmup` steps first, and their seconds
are recorded as ``warmup_s`` (compile included, so it shows what compiling costs). The GPT-124M model
(micro-batch 8 x 1024) runs at every world; GPT-1.3B (8 x 1024, as the training phase) only at the
largest world and only eager and per block (ours and torch's), whose one block graph compiles in seconds, where the whole
unrolled model takes minutes. Figures: the slowest rank's median step over rounds, tokens/s per GPU,
each variant's speed over ``ours_ddp``, and its last loss (same seed and batches: compiled variants
should match eager to bf16 accuracy).

On CPU (``--smoke``): the tiny GPT with the ``aot_eager`` backend (no C++ compiler needed).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from common import GIB, free_memory, make_batches, slowest, synchronize, train_steps

GPU_MODELS = [("gpt2-124m", 8, 1024)]
GPU_LARGE = ("gpt-1.3b", 8, 1024)
SMOKE_MODELS = [("tiny", 4, 32)]
WHOLE = ["ours_ddp", "ours_compile(ddp)", "ours_ddp(compile)", "ours_ddp(blocks)", "torch_ddp", "torch_compile(ddp)"]
LARGE = ["ours_ddp", "ours_ddp(blocks)", "torch_ddp(blocks)"]
KNOWN = sorted(set(WHOLE) | set(LARGE))


def build(variant: str, cfg, device, backend: str):
    """(what to call, optimizer) for one variant, from a freshly seeded model."""
    from distributed_training import DDP
    from distributed_training.models import GPT

    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    fused = device.type == "cuda"
    if variant.endswith("(blocks)"):
        for block in model.blocks:
            block.compile(backend=backend)
    inner = torch.compile(model, backend=backend) if variant.endswith("ddp(compile)") else model
    if variant.startswith("torch"):
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(inner, device_ids=[device.index] if fused else None)
    else:
        wrapped = DDP(inner)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4, fused=fused)
    call = torch.compile(wrapped, backend=backend) if "compile(ddp)" in variant else wrapped
    return call, opt


def run(ctx, opts) -> dict:
    device, world = ctx.device, ctx.world_size
    if not dist.is_initialized():
        from common import skipped

        return skipped("needs a process group (our DDP and torch's)")
    smoke = opts.smoke or device.type != "cuda"
    backend = "aot_eager" if smoke else "inductor"
    rounds = opts.rounds or (1 if smoke else 2)
    steps = opts.steps or (2 if smoke else 10)
    warmup = 2 if smoke else 3
    # --impls picks this phase's variants only when it names a compiled one: a list meant for the training
    # phase (torch_ddp, ours_ddp, ...) would otherwise leave nothing compiled to measure (session 20's run).
    asked = [i for i in (opts.impls or "").split(",") if i in KNOWN]
    if not any("(" in i for i in asked):
        asked = []
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    # Several variants share the model's code objects (GPT.forward, Block.forward) in one process: room for
    # each one's cache entries, so that none falls back to eager past dynamo's default limit of 8.
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 64))
    top = smoke or world == torch.cuda.device_count()
    plan = [(m, WHOLE) for m in (opts.models or (SMOKE_MODELS if smoke else GPU_MODELS))]
    if not smoke and not opts.models and top:
        plan.append((GPU_LARGE, LARGE))
    models = {}
    for (preset, micro, seq), variants in plan:
        variants = [v for v in (asked or variants) if world > 1 or not v.startswith("torch")]
        models[preset] = _measure(ctx, preset, micro, seq, variants, backend, rounds, steps, warmup)
    return {"status": "ok", "backend": backend, "rounds": rounds, "steps_per_round": steps, "warmup": warmup,
            "precision": "bf16 autocast, fp32 weights, fused AdamW" if device.type == "cuda" else "fp32 (CPU)",
            "models": models}


def _measure(ctx, preset, micro, seq, variants, backend, rounds, steps, warmup) -> dict:
    from distributed_training.models import GPT_PRESETS

    device, world = ctx.device, ctx.world_size
    cfg = GPT_PRESETS[preset]
    batches = make_batches(cfg, micro, seq, device, ctx.rank)
    entry = {"micro_batch": micro, "seq": seq, "variants": {}, "errors": {}}
    # Every variant alive at once (interleaved rounds) where memory allows; else one after another.
    per_variant = 20 * sum(p.numel() for p in _meta(cfg).parameters())  # weights, grads, buckets, Adam
    together = device.type != "cuda" or len(variants) * per_variant < 0.7 * torch.cuda.mem_get_info(device)[0]
    entry["interleaved"] = together
    built, warm, timed, losses = {}, {}, {}, {}

    def start(v):
        try:
            if not together:
                torch._dynamo.reset()  # the variant before is gone: drop its compiled code too
            built[v] = build(v, cfg, device, backend)
            synchronize(device)
            t0 = time.perf_counter()
            train_steps(*built[v], batches, 0, warmup, device, no_sync=False)
            synchronize(device)
            warm[v] = time.perf_counter() - t0
        except Exception as err:  # a variant that fails to compile is a result, not the end of the phase
            entry["errors"][v] = f"{type(err).__name__}: {str(err).splitlines()[0][:500] if str(err) else ''}"
            built.pop(v, None)
            if ctx.is_main:
                print(f"[compile] world {world} {preset} {v}: FAILED {entry['errors'][v]}", flush=True)

    def step_round(v, rnd):
        call, opt = built[v]
        synchronize(device)
        t0 = time.perf_counter()
        loss = train_steps(call, opt, batches, warmup + rnd * steps, steps, device, no_sync=False)
        synchronize(device)
        timed.setdefault(v, []).append((time.perf_counter() - t0) / steps)
        losses[v] = loss.item()
        if ctx.is_main:
            print(f"[compile] world {world} {preset} round {rnd} {v:20s} {timed[v][-1] * 1e3:9.2f} ms  "
                  f"loss {losses[v]:.4f}", flush=True)

    def drop(v):
        built.pop(v, None)
        free_memory(device)

    if together:
        for v in variants:
            start(v)
        for rnd in range(rounds):
            for v in (variants if rnd % 2 == 0 else variants[::-1]):
                if v in built:
                    step_round(v, rnd)
    else:
        for v in variants:
            start(v)
            for rnd in range(rounds):
                if v in built:
                    step_round(v, rnd)
            drop(v)
    for v in list(built):
        drop(v)
    # Ranks agree on which variants ran (a failure on one rank only shows in its errors).
    ran = [v for v in variants if v in timed]
    figures = slowest(ctx, [statistics.median(timed[v]) for v in ran] + [warm[v] for v in ran])
    for i, v in enumerate(ran):
        step_s = figures[i]
        entry["variants"][v] = {"step_s": step_s, "tokens_per_s_per_gpu": micro * seq / step_s,
                                "warmup_s": figures[len(ran) + i], "rank0_round_step_s": timed[v],
                                "last_loss": losses[v]}
    base = entry["variants"].get("ours_ddp")
    for v, fig in entry["variants"].items():
        if base:
            fig["speed_vs_ours_ddp"] = base["step_s"] / fig["step_s"]
    if device.type == "cuda":
        entry["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    return entry


def _meta(cfg):
    from distributed_training.models import GPT

    with torch.device("meta"):
        return GPT(cfg)
