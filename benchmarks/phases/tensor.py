"""Tensor parallelism through the trainer (`DistributedTrainer(tensor_parallel_size=T, sequence_parallel=sp)`)
against torch's DTensor tensor parallelism (`parallelize_module`) with the same plan on the same GPT, the
same global batches and the same initial weights, interleaved in one job: tokens/s per GPU, MFU, the most
memory a rank holds, and how far the first steps' losses of the two stray from each other.

Configurations at world W (the global batch is the same for every one of a model):

* GPT 1.3B (``gpt-1.3b``, 16 sequences of 1024 a step, bf16 autocast, AdamW, fused on CUDA) at
  T = 2 (x DP = W / 2, DDP) and T = 4 (x DP = W / 4), each with and without sequence parallelism;
  at W >= 4 also T = 2 x FSDP W / 2 without it (ours: ``strategy="zero3"``; torch: `fully_shard`
  over the data dim of the 2-D mesh after `parallelize_module`: FSDP2 + TP).
* At W >= 4 on a GPU of at least 70 GiB: a ~7B GPT (32 layers, width 4096, 32 heads) at T = 4 with
  sequence parallelism on one long sequence per tensor-parallel group (32768 tokens; 16384 on cards
  under 120 GiB): each rank keeps the activations of a quarter of it. FSDP alone (ours, ``zero3``, no
  TP) at the same batch would hold a whole sequence's activations on every rank (a sequence is the
  least a data-parallel rank can take): its estimate (16 bytes a parameter over the world, plus the
  activations: `_fsdp_alone_estimate`) is recorded, and the run made only where it fits with a margin
  (an out-of-memory on one rank only would leave the others waiting in a collective).
* ``--smoke`` (CPU, gloo, 2 processes): a tiny GPT at T = 2 with and without sequence parallelism,
  one round.

Each run is built from a freshly seeded model (`torch.manual_seed(0)`, built on the device), so both
sides start from the same weights. Each round runs every configuration's two sides back to back (ours
first in even rounds, torch's first in odd ones); a run is ``warmup`` untimed steps, then ``steps``
timed as one block (one device sync at each end). Figures: the slowest rank's step (the median over
rounds), tokens/s per GPU = global tokens / step / W, MFU = 6 x parameters x tokens/s per GPU / the
card's dense bf16 peak (`PEAK_BF16`; 6N counts neither attention's scores nor recomputation), the
peak memory of the most loaded rank over the training steps (reset after setup, where every rank
briefly holds the whole model; net of what earlier runs left), and max |loss ours - loss torch| over
the steps of round 0 (each step's loss averaged over the data-parallel replicas).

Torch's side (a reference, built only here):

* Our GPT's `qkv` is one fused [q; k; v] projection; torch's `ColwiseParallel` splits its output rows
  into T contiguous blocks, which would hand rank 0 all of q and half of k. So the rows of `qkv`
  (weight and bias) are permuted first (`_permute_qkv`) so that block t is [q_t; k_t; v_t], the
  heads of tensor rank t: the split our ``("colwise", 3)`` makes. The attention then runs with the
  local head count (`_LocalHeadsAttention`: the same modules and math as our GPT's attention, heads
  taken from the projection's output width, head size fixed).
* Plan (torch's Megatron-style one, as in its tutorial / torchtitan): `qkv` and `mlp.0` colwise,
  `attn.proj` and `mlp.2` rowwise; the token embedding `RowwiseParallel(input_layouts=Replicate())`
  (split by vocabulary rows), the head `ColwiseParallel(output_layouts=Shard(-1),
  use_local_output=False)` with the loss under `loss_parallel()` (the full logits never gathered).
  The embedding and the head both split their weight by vocabulary rows (`Shard(0)`), so the head
  is tied back to the embedding's DTensor after `parallelize_module` (which gives each its own):
  one parameter, as in ours.
* With sequence parallelism: `SequenceParallel()` on every LayerNorm; attention and MLP take their
  input through `PrepareModuleInput(Shard(1) -> Replicate())`; the rowwise layers give `Shard(1)`;
  the token and position embeddings give `Shard(1)` (the position embedding is split by rows too,
  fed positions of shape (1, T), so its gradient is whole; without SP it stays replicated: every
  rank sees the whole sequence); the head takes `Shard(1)` input.
* TP x DDP: torch's `DistributedDataParallel(model, device_mesh=mesh["dp"])` (its documented 2-D
  path: DTensor parameters swapped for their local tensors around each forward); TP x FSDP:
  `fully_shard(mesh=mesh["dp"])` on each block, then the root. Parameters that stay plain tensors
  (LayerNorms without SP) go to the optimizer in their own parameter group: fused AdamW cannot mix
  plain tensors and DTensors, or DTensors of different meshes, in one call.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from common import GIB, allocated, autocast, free_memory, gpt_units, peak, peak_reset, skipped, slowest, synchronize

GPU_MODEL = ("gpt-1.3b", 16, 1024)  # preset, global batch (sequences a step), sequence length
BIG_WIDTH = dict(n_layer=32, n_head=32, n_embd=4096)  # ~6.7B parameters with the default vocabulary
BIG_SEQ = 32768  # one long sequence per tensor-parallel group (16384 on cards under 120 GiB)
BIG_MIN_GPU_GIB = 70
#: Dense bf16 peak FLOP/s of the cards MFU is reported for (matched in the device name).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
BYTES_PER_PARAM = 16  # fp32 weight 4 + gradient 4 + AdamW's two moments 8
LR = 1e-4


@dataclass(frozen=True)
class Config:
    """One point: a model at tensor-parallel size `tp`, with or without sequence parallelism, the data-
    parallel strategy over the rest of the world (``ddp`` or ``zero3``)."""

    name: str
    model: str  # "gpt-1.3b", "gpt-7b" or "tiny"
    tp: int
    sp: bool
    strategy: str = "ddp"
    seq: int = 0  # the 7B's sequence length (one sequence per tensor-parallel group); 0: the model's default


def _configs(world: int, smoke: bool, big: bool, big_seq: int = BIG_SEQ, only: str = "") -> list[Config]:
    """The points at world `world`; `only` "big": the 7B's alone, "small": the 1.3B's alone."""
    if smoke:
        return [Config(f"TP2 {'SP' if sp else 'no SP'}", "tiny", 2, sp) for sp in (False, True)]
    configs = []
    for tp in (2, 4) if only != "big" else ():
        if tp <= world and world % tp == 0:
            dp = f"xDP{world // tp}" if world > tp else ""
            configs += [Config(f"TP{tp}{dp} {'SP' if sp else 'no SP'}", "gpt-1.3b", tp, sp) for sp in (False, True)]
    if world >= 4 and world % 2 == 0 and only != "big":
        configs.append(Config(f"TP2xFSDP{world // 2} no SP", "gpt-1.3b", 2, False, "zero3"))
    if big and world >= 4 and world % 4 == 0 and only != "small":
        dp4 = f"xDP{world // 4}" if world > 4 else ""
        configs += [Config(f"7B TP4{dp4} SP", "gpt-7b", 4, True, seq=big_seq),
                    Config(f"7B TP4{dp4} no SP", "gpt-7b", 4, False, seq=big_seq),
                    # T = 2 holds twice the model state a rank: half the sequence; a quarter without SP
                    # (each rank then keeps its sequence's whole activations).
                    Config(f"7B TP2xDP{world // 2} SP", "gpt-7b", 2, True, seq=big_seq // 2),
                    Config(f"7B TP2xDP{world // 2} no SP", "gpt-7b", 2, False, seq=big_seq // 4)]
    return configs


def _big_seq(gpu_gib: float) -> int:
    return BIG_SEQ if gpu_gib >= 120 else BIG_SEQ // 2


def _model_config(model: str, seq: int = BIG_SEQ):
    from distributed_training.models import GPT_PRESETS, GPTConfig

    if model == "tiny":
        return GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
    if model == "gpt-7b":
        return GPTConfig(block_size=seq, **BIG_WIDTH)
    return GPT_PRESETS[model]


def _peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def run(ctx, opts) -> dict:
    world, device = ctx.world_size, ctx.device
    if world < 2:
        return skipped("tensor parallelism needs 2 ranks or more")
    cuda = device.type == "cuda"
    gpu_gib = torch.cuda.get_device_properties(device).total_memory / GIB if cuda else 0.0
    big = cuda and gpu_gib >= BIG_MIN_GPU_GIB
    asked = set((opts.variants or "").split(","))
    variants = asked & {"big", "small"}
    configs = _configs(world, opts.smoke, big, _big_seq(gpu_gib), only=next(iter(variants), ""))
    only = {t.partition("=")[2] for t in asked if t.startswith("config=")}
    if only:  # e.g. config=7B TP4 no SP (the names of the table)
        configs = [c for c in configs if c.name in only]
    profile = "profile" in asked  # rank 0's kernels over 2 more steps of each side, after the timed ones
    # bias_after: ours also with the row-parallel bias added after the all-reduce (the way before session 19)
    impls = ("ours", "torch") + (("ours_bias_after",) if "bias_after" in asked else ())
    rounds = opts.rounds or (1 if opts.smoke else 2)
    steps = opts.steps or (2 if opts.smoke else 5)
    warmup = 1 if opts.smoke else 2
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    torch_ready = _torch_tp_missing()
    meshes = _Meshes(device, world)
    base = allocated(device)
    result = {"status": "ok", "world": world, "rounds": rounds, "steps": steps, "warmup": warmup,
              "mixed_precision": "bf16" if cuda else "fp32", "peak_bf16_flops": _peak_flops(device),
              "gpu_memory_gib": gpu_gib, "configs": {}}
    if not big and not opts.smoke:
        result["big_skipped"] = ("the ~7B run needs 4 GPUs of at least "
                                 f"{BIG_MIN_GPU_GIB} GiB" + (f" (this card: {gpu_gib:.0f} GiB)" if cuda else ""))
    runs: dict[tuple[str, str], list[dict]] = {}
    shapes = {}
    for config in configs:
        cfg = _model_config(config.model, _big_seq(gpu_gib))
        batch, seq = ((4, 16) if opts.smoke else (world // config.tp, config.seq) if config.model == "gpt-7b"
                      else GPU_MODEL[1:])
        shapes[config.name] = (cfg, batch, seq)
    for r in range(rounds):  # every run once a round: a slow spell of the machine hits both sides alike
        for config in configs:
            cfg, batch, seq = shapes[config.name]
            order = impls if r % 2 == 0 else impls[::-1]
            for impl in order:
                if impl == "torch" and torch_ready:
                    run_ = {"status": "skipped", "reason": torch_ready}
                else:
                    run_ = _guarded(impl, config, cfg, batch, seq, warmup, steps, ctx, meshes, base,
                                    profile and r == 0)
                runs.setdefault((config.name, impl), []).append(run_)
                if ctx.is_main:
                    print(f"[tensor] W={world} round {r} {config.name:22s} {impl:5s} {_shown(run_)}", flush=True)
    for config in configs:
        cfg, batch, seq = shapes[config.name]
        row = {"model": config.model, "tensor_parallel_size": config.tp, "sequence_parallel": config.sp,
               "data_parallel": world // config.tp, "strategy": config.strategy, "global_batch": batch, "seq": seq,
               "parameters": gpt_units(cfg)["params"]}
        for impl in impls:
            row[impl] = _summary(runs[(config.name, impl)])
        ours, ref = row["ours"], row["torch"]
        if ours.get("status") == "ok" and ref.get("status") == "ok":
            # Median of the per-round ratios: each round's pair ran back to back.
            row["speed_vs_torch"] = statistics.median(
                t / o for t, o in zip(ref["step_s_rounds"], ours["step_s_rounds"]))
            row["max_abs_loss_diff"] = max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"]))
            after = row.get("ours_bias_after", {})
            if after.get("status") == "ok":
                row["bias_after_speed_vs_torch"] = statistics.median(
                    t / o for t, o in zip(ref["step_s_rounds"], after["step_s_rounds"]))
        if config.model == "gpt-7b" and config.sp and config.tp == 4:
            row["fsdp_alone"] = _fsdp_alone(cfg, batch, seq, warmup, steps, ctx, base, gpu_gib)
        result["configs"][config.name] = row
    for row in result["configs"].values():
        for impl in impls:
            r = row[impl]
            if r.get("status") == "ok":
                r["tokens_per_s_per_gpu"] = row["global_batch"] * row["seq"] / r["step_s"] / world
                flops = result["peak_bf16_flops"]
                r["mfu"] = 6 * row["parameters"] * r["tokens_per_s_per_gpu"] / flops if flops else None
    result["note"] = ("step_s: the slowest rank's, median over rounds; peak_gib: the most loaded rank's peak "
                      "allocated memory over the training steps (reset after setup, net of earlier runs' leftovers; "
                      "setup_peak_gib: during setup, when every rank holds the whole model before it is split)"
                      + ("" if cuda else " (0 on CPU: not tracked)") +
                      "; losses: round 0, each step's loss averaged over the data-parallel replicas; MFU = 6 x "
                      "parameters x tokens/s per GPU / the card's dense bf16 peak")
    return result


def _shown(run_: dict) -> str:
    if run_.get("status") != "ok":
        return f"{run_.get('status')}: {run_.get('reason', '')[:200]}"
    return (f"{run_['step_s'] * 1e3:8.1f} ms  peak {run_['peak_gib']:6.2f} GiB  losses "
            f"{' '.join(format(x, '.4f') for x in run_['losses'][:3])}")


def _summary(runs: list[dict]) -> dict:
    ok = [r for r in runs if r.get("status") == "ok"]
    if len(ok) < len(runs):
        return next(r for r in runs if r.get("status") != "ok")
    steps = [r["step_s"] for r in ok]
    out = {"status": "ok", "step_s": statistics.median(steps), "step_s_rounds": steps,
           "peak_gib": max(r["peak_gib"] for r in ok),
           "setup_peak_gib": max(r["setup_peak_gib"] for r in ok), "losses": ok[0]["losses"]}
    if "kernels" in ok[0]:
        out["kernels"] = ok[0]["kernels"]
    return out


def _guarded(impl, config, cfg, batch, seq, warmup, steps, ctx, meshes, base, profile=False) -> dict:
    """One run; an error is recorded (with the same outcome on every rank, so no rank is left waiting)."""
    device = ctx.device
    try:
        out = _measure(impl, config, cfg, batch, seq, warmup, steps, ctx, meshes, base, profile)
    except Exception as err:  # noqa: BLE001 - recorded; the other runs go on
        out = {"status": "error", "reason": f"{type(err).__name__}: {str(err)[:400]}"}
    free_memory(device)
    failed = torch.tensor([float(out.get("status") != "ok")],
                          device=device if ctx.backend == "nccl" else "cpu")
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item() and out.get("status") == "ok":
        out = {"status": "error", "reason": "failed on another rank"}
    return out


def _batches(cfg, batch, seq, count, dp, d, device):
    """`count` global batches, the same on every rank (one generator), this replica's rows of each."""
    g = torch.Generator(device=device).manual_seed(1234)
    per = batch // dp
    out = []
    for _ in range(count):
        t = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device, generator=g)
        t = t[d * per:(d + 1) * per]
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def _kernels(step, batches, device, top: int = 30) -> dict:
    """Device time by kernel (self time, ms per step) over `batches`, the `top` largest, and the total."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for b in batches:
            step(b)
        synchronize(device)
    n = len(batches)
    rows = [(e.key, e.self_device_time_total / 1e3 / n, e.count // n) for e in prof.key_averages()
            if e.self_device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    return {"device_ms_per_step": sum(r[1] for r in rows),
            "top": [{"kernel": k[:120], "ms_per_step": ms, "calls_per_step": c} for k, ms, c in rows[:top]]}


def _measure(impl, config, cfg, batch, seq, warmup, steps, ctx, meshes, base, profile=False) -> dict:
    device = ctx.device
    free_memory(device)
    stale = allocated(device) - base
    peak_reset(device)
    if impl in ("ours", "ours_bias_after"):
        from distributed_training.tensor.layers import RowParallelLinear

        RowParallelLinear.bias_in_matmul = impl == "ours"  # read at each forward: restored below
        step, dp, d, close = _ours(config, cfg, ctx)
        if impl == "ours_bias_after":
            inner_close = close

            def close():
                inner_close()
                RowParallelLinear.bias_in_matmul = True
    else:
        step, dp, d, close = _torch(config, cfg, ctx, meshes)
    if batch % dp:
        close()
        raise ValueError(f"global batch {batch} does not split over {dp} data-parallel replicas")
    # Every rank built the whole model before it was split: that transient is the setup's, not training's.
    built = peak(device) - stale
    free_memory(device)
    peak_reset(device)
    batches = _batches(cfg, batch, seq, warmup + steps, dp, d, device)
    losses = [step(b) for b in batches[:warmup]]
    synchronize(device)
    t0 = time.perf_counter()
    losses += [step(b) for b in batches[warmup:]]
    synchronize(device)
    step_s = (time.perf_counter() - t0) / steps
    curve = torch.stack([loss.detach().float().reshape(()) for loss in losses])
    curve = curve.to(device if ctx.backend == "nccl" else "cpu")
    dist.all_reduce(curve)
    curve /= ctx.world_size  # every rank of a replica holds its replica's loss: the mean over replicas
    step_s, held, built = slowest(ctx, [step_s, peak(device) - stale, built])
    kernels = _kernels(step, batches[:2], device) if profile else None
    close()
    out = {"status": "ok", "step_s": step_s, "peak_gib": held / GIB, "setup_peak_gib": built / GIB,
           "losses": curve.tolist()}
    if kernels is not None:
        out["kernels_rank"] = ctx.rank
        out["kernels"] = kernels
    return out


# ---------------------------------------------------------------------------------------------- ours
def _ours(config: Config, cfg, ctx, tensor_parallel: bool = True):
    from distributed_training import DistributedTrainer
    from distributed_training.models import GPT

    device = ctx.device
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    kwargs = dict(tensor_parallel_size=config.tp, sequence_parallel=config.sp) if tensor_parallel else {}
    trainer = DistributedTrainer(model, lambda ps: torch.optim.AdamW(ps, lr=LR, fused=cuda),
                                 strategy=config.strategy, mixed_precision="bf16" if cuda else None, context=ctx,
                                 progress=False, **kwargs)

    def step(batch):
        return trainer.train_step(batch)["loss"]  # our GPT computes its own loss from (idx, targets)

    def close():
        trainer.close()

    return step, trainer.dp_world_size, trainer.dp_rank, close


def _fsdp_alone_estimate(cfg, batch: int, seq: int, world: int) -> dict:
    """Bytes a rank needs under FSDP alone (ZeRO-3 over the world): 16 bytes a parameter over the ranks,
    plus the activations of its batch / world sequences kept for backward (~34 x seq x width bytes a
    layer a sequence in bf16 with a fused attention kernel, Korthikanti et al.'s count without the
    score matrix) and the logits (bf16, their fp32 copy and its gradient: ~10 bytes a logit)."""
    params = gpt_units(cfg)["params"]
    per = max(1, batch // world)
    state = BYTES_PER_PARAM * params / world
    activations = 34 * seq * cfg.n_embd * cfg.n_layer * per + 10 * seq * cfg.vocab_size * per
    return {"parameters": params, "sequences_per_rank": per, "model_state_gib": state / GIB,
            "activations_gib": activations / GIB, "estimate_gib": (state + activations) / GIB}


def _fsdp_alone(cfg, batch, seq, warmup, steps, ctx, base, gpu_gib) -> dict:
    """Our FSDP (zero3) without tensor parallelism on the 7B at the same global batch: run when the
    estimate fits with a margin (80% of the card), else the estimate alone."""
    world = ctx.world_size
    estimate = _fsdp_alone_estimate(cfg, batch, seq, world)
    if batch % world and estimate["estimate_gib"] <= gpu_gib:
        return {"status": "batch does not split", **estimate,
                "reason": f"a global batch of {batch} sequences does not split over {world} ranks (FSDP alone "
                          "needs at least one sequence a rank; TP splits each sequence's activations)"}
    if estimate["estimate_gib"] > 0.8 * gpu_gib:
        return {"status": "does not fit", **estimate,
                "reason": f"estimate {estimate['estimate_gib']:.1f} GiB > 80% of the card's {gpu_gib:.0f} GiB: "
                          "not run (an out-of-memory on one rank would leave the others in a collective)"}
    config = Config("FSDP alone", "gpt-7b", 1, False, "zero3")
    device = ctx.device
    try:
        free_memory(device)
        stale = allocated(device) - base
        peak_reset(device)
        step, dp, d, close = _ours(config, cfg, ctx, tensor_parallel=False)
        free_memory(device)
        peak_reset(device)  # the training steps' peak, as for the tensor-parallel runs
        batches = _batches(cfg, batch, seq, warmup + steps, dp, d, device)
        for b in batches[:warmup]:
            step(b)
        synchronize(device)
        t0 = time.perf_counter()
        for b in batches[warmup:]:
            step(b)
        synchronize(device)
        step_s, held = slowest(ctx, [(time.perf_counter() - t0) / steps, peak(device) - stale])
        close()
        out = {"status": "fits", **estimate, "step_s": step_s, "peak_gib": held / GIB,
               "tokens_per_s_per_gpu": batch * seq / step_s / world}
    except torch.OutOfMemoryError as err:
        out = {"status": "out of memory", **estimate, "reason": str(err)[:300]}
    free_memory(device)
    return out


# --------------------------------------------------------------------------------------------- torch
def _torch_tp_missing() -> str | None:
    """Why torch's tensor parallelism cannot run here, or None."""
    try:
        from torch.distributed.tensor.parallel import loss_parallel, parallelize_module  # noqa: F401
    except ImportError as err:
        return f"torch.distributed.tensor.parallel is not available: {err}"
    return None


class _Meshes:
    """Torch's device meshes, made once per tensor-parallel size (making one is collective and builds
    communicators: not once per run)."""

    def __init__(self, device: torch.device, world: int) -> None:
        self.kind, self.world, self.made = device.type, world, {}

    def get(self, tp: int):
        from torch.distributed.device_mesh import init_device_mesh

        if tp not in self.made:
            dp = self.world // tp
            self.made[tp] = (init_device_mesh(self.kind, (tp,), mesh_dim_names=("tp",)) if dp == 1 else
                             init_device_mesh(self.kind, (dp, tp), mesh_dim_names=("dp", "tp")))
        return self.made[tp]


class _LocalHeadsAttention(nn.Module):
    """Our GPT's attention (its own `qkv` and `proj` modules), the head count taken from the projection's
    output width, which tensor parallelism makes this rank's: (B, T, 3 x local heads x head size)."""

    def __init__(self, attn: nn.Module, head_dim: int) -> None:
        super().__init__()
        self.qkv, self.proj, self.dropout, self.head_dim = attn.qkv, attn.proj, attn.dropout, head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        B, T, W = qkv.shape
        q, k, v = qkv.split(W // 3, dim=2)
        heads = W // 3 // self.head_dim
        q, k, v = (t.view(B, T, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (B, h, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, heads * self.head_dim))


class _TorchGPT(nn.Module):
    """Our GPT's modules under torch's plan: forward(idx) returns the logits, split by vocabulary (a
    DTensor); the positions go in as (1, T) so that, split by rows with SP, their embedding is
    (1, T / tp, C) and adds to the token embedding's sequence part."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop, self.blocks, self.ln_f, self.lm_head = (
            gpt.wte, gpt.wpe, gpt.drop, gpt.blocks, gpt.ln_f, gpt.lm_head)

    def forward(self, idx: torch.Tensor):
        pos = torch.arange(idx.shape[1], device=idx.device).unsqueeze(0)  # (1, T)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _permute_qkv(linear: nn.Linear, tp: int) -> None:
    """Rows [q; k; v] -> [q_0; k_0; v_0; q_1; k_1; v_1; ...]: torch's contiguous split then gives tensor
    rank t its own heads' q, k and v (ours: ``("colwise", 3)``)."""
    with torch.no_grad():
        for p in (linear.weight, linear.bias):
            if p is None:
                continue
            q, k, v = (t.chunk(tp, dim=0) for t in p.chunk(3, dim=0))
            p.copy_(torch.cat([part for t in range(tp) for part in (q[t], k[t], v[t])], dim=0))


def torch_plan(n_layer: int, sp: bool) -> dict:
    """Torch's Megatron-style plan for `_TorchGPT` (see the module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    seq_out = Shard(1) if sp else Replicate()
    plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq_out),
            "lm_head": ColwiseParallel(input_layouts=seq_out, output_layouts=Shard(-1), use_local_output=False)}
    if sp:
        plan["wpe"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        plan["ln_f"] = SequenceParallel()
    for i in range(n_layer):
        b = f"blocks.{i}"
        plan |= {f"{b}.attn.qkv": ColwiseParallel(), f"{b}.attn.proj": RowwiseParallel(output_layouts=seq_out),
                 f"{b}.mlp.0": ColwiseParallel(), f"{b}.mlp.2": RowwiseParallel(output_layouts=seq_out)}
        if sp:
            plan |= {f"{b}.ln1": SequenceParallel(), f"{b}.ln2": SequenceParallel(),
                     f"{b}.attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                     f"{b}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
    return plan


def _tie_head(model: nn.Module) -> None:
    """The head's weight := the embedding's (a Parameter, or the DTensor torch's DDP transform rebuilt)."""
    head = model.lm_head
    if head.weight is not model.wte.weight:
        head._parameters.pop("weight", None)
        head.__dict__.pop("weight", None)
        head.weight = model.wte.weight


def _torch(config: Config, cfg, ctx, meshes: _Meshes):
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from distributed_training.models import GPT

    device, tp = ctx.device, config.tp
    cuda = device.type == "cuda"
    mesh = meshes.get(tp)
    tp_mesh = mesh["tp"] if mesh.ndim > 1 else mesh
    torch.manual_seed(0)
    with torch.device(device):
        gpt = GPT(cfg)
    for block in gpt.blocks:
        _permute_qkv(block.attn.qkv, tp)
        block.attn = _LocalHeadsAttention(block.attn, cfg.n_embd // cfg.n_head)
    model = _TorchGPT(gpt)
    del gpt
    parallelize_module(model, tp_mesh, torch_plan(cfg.n_layer, config.sp))
    model.lm_head.weight = model.wte.weight  # both DTensors split by vocabulary rows (Shard(0)): one again
    wrapped = model
    if mesh.ndim > 1 and config.strategy == "ddp":
        from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
        from torch.nn.parallel import DistributedDataParallel

        # What DistributedDataParallel(device_mesh=mesh["dp"]) runs first, done here so that the head can
        # be tied again in between: the transform swaps each DTensor parameter for its local tensor, but
        # visits a shared parameter under its first name only.
        _pre_dp_module_transform(model)
        _tie_head(model)
        model.register_forward_pre_hook(lambda module, args: _tie_head(module))  # after torch's own pre-hook
        wrapped = DistributedDataParallel(model, process_group=mesh["dp"].get_group(),
                                          device_ids=[device.index] if cuda else None)
    elif mesh.ndim > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else \
            MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
        fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    groups: dict = {}
    for p in wrapped.parameters():  # one group per kind: plain tensors, DTensors of each mesh
        groups.setdefault(id(getattr(p, "device_mesh", None)), []).append(p)
    opt = torch.optim.AdamW([{"params": ps} for ps in groups.values()], lr=LR, fused=cuda)
    vocab = cfg.vocab_size

    def step(batch):
        x, y = batch
        with loss_parallel():
            with autocast(device):
                logits = wrapped(x)  # (B, T, vocab), split by vocabulary
            # The softmax in fp32, as our GPT's loss.
            loss = F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.full_tensor() if hasattr(loss, "full_tensor") else loss

    def close():
        nonlocal wrapped, model, opt
        del wrapped, model, opt

    dp = mesh["dp"].size() if mesh.ndim > 1 else 1
    return step, dp, ctx.rank // tp, close
