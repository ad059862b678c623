"""Where a pipeline step's time goes: our engine and torch's pipelining, same stages, same run.

Run under torchrun (one process a GPU): ``torchrun --nproc_per_node=2 benchmarks/pipeline_profile.py
--out DIR``. For each variant (``ours_1f1b``, ``torch_1f1b``, ...; ``--variants``) it builds this rank's
stage of the GPT (`GPTStages`, as the suite's pipeline phase does), times `--rounds` rounds of
`--steps` steps with the variants interleaved, then records one step with torch.profiler and writes
its Chrome trace (``trace_<variant>_r<rank>.json``) and a per-rank summary: the compute stream's busy
time and its gaps (with the kernels on each side), the NCCL kernels, and the host's time blocked in
receives. ``summary.json`` holds the timings and the summaries of every rank.

Diagnostic, not part of the suite: its findings go to docs/pipeline.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from distributed_training.models import GPT_PRESETS, GPTConfig  # noqa: E402
from distributed_training.pipeline import GPTStages, PipelineEngine, lm_loss, sync_tied_grads  # noqa: E402

TORCH = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def build_variant(name, cfg, x, y, microbatches, groups, rank, world, device):
    """`name` is ``<impl>[-<option>...]_<schedule>``: impl ``ours`` or ``torch``; options ``headers`` (our
    receives wait for every header), ``nolag`` (known shapes checked only at the step's end), ``graphs``
    (each stage's forward and backward replayed as CUDA graphs: the engine's ``cuda_graphs``), ``closs`` (ours
only: the loss through ``torch.compile``), ``throttle`` (ours on CUDA: each receive posted only once the GPU
has reached the previous one, `_throttle`), ``params``
    (stages balanced by parameter count, not by compute), ``halves`` (the chain cut at half blocks), ``time`` (``trainer`` only: by each layer's measured
forward + backward, ``pipeline_balance="time"`` on one microbatch of `x`)."""
    spec, schedule = name.split("_", 1)
    impl, *options = spec.split("-")
    maker = GPTStages(cfg, seed=0, halves="halves" in options)
    costs = None if "params" in options else maker.compute_costs(x.shape[1])
    module = maker.build(rank, world, device, costs=costs)
    tied = maker.tied_groups(world, costs=costs)
    tie_group = groups["tie"]
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=device.type == "cuda")

    def sync_ties():
        sync_tied_grads(module, tied, tie_group)

    if impl == "trainer":  # the same schedule through DistributedTrainer (DDP per stage, a meta-built GPT)
        from distributed_training import DistributedTrainer
        from distributed_training.models import GPT

        with torch.device("meta"):
            whole = GPT(cfg)
        trainer = DistributedTrainer(whole, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=device.type == "cuda"),
                                     context=groups["context"], progress=False, mixed_precision="bf16",
                                     pipeline_parallel_size=world, pipeline_schedule=schedule,
                                     pipeline_balance=("parameters" if "params" in options else
                                                       "time" if "time" in options else "compute"),
                                     pipeline_sample_input=(x[:x.shape[0] // microbatches] if "time" in options
                                                            else None),
                                     microbatches=microbatches, pipeline_half_blocks="halves" in options,
                                     pipeline_cuda_graphs="graphs" in options, pipeline_compile_loss="closs" in options)
        if rank == 0:
            costs = trainer.strategy.layer_costs
            print(f"        {name}: cut {trainer.strategy.bounds}, layer costs "
                  f"{[round(c * 1e3, 3) for c in costs] if 'time' in options else costs}", flush=True)

        def step():
            trainer.train_step((x, y))
        step.engine = trainer.strategy.engine
        step.trainer = trainer
        return step
    if impl == "ours":
        loss_fn = torch.compile(lm_loss) if "closs" in options else lm_loss
        engine = PipelineEngine([module], ranks=list(range(world)), rank=rank, up_group=groups["up"],
                                down_group=groups["down"], header_group=groups["headers"], schedule=schedule,
                                microbatches=microbatches, loss_fn=loss_fn, device=device, after_backward=sync_ties,
                                cuda_graphs="graphs" in options)
        if "throttle" in options and device.type == "cuda":
            _throttle(engine.link)
        if "headers" in options:
            engine.link.known_shapes = False
        if "nolag" in options:
            engine.link.max_lag = None

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16):
                engine.step(x, y)
            opt.step()
            opt.zero_grad(set_to_none=True)
        step.engine = engine
    else:
        from torch.distributed.pipelining import PipelineStage
        import torch.distributed.pipelining.schedules as torch_schedules

        stage = PipelineStage(module, rank, world, device)
        sched = getattr(torch_schedules, TORCH[schedule])(stage, n_microbatches=microbatches, loss_fn=lm_loss)

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16):
                args = (x,) if rank == 0 else ()
                kwargs = {"target": y, "losses": []} if rank == world - 1 else {}
                sched.step(*args, **kwargs)
            sync_ties()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return step


def _throttle(link) -> None:
    """``throttle``: before each receive the host waits until the GPU has reached the point where the
    previous receive was posted, so a graphed host (far ahead of its GPU) posts each payload receive
    about one action before the GPU needs it instead of many. The question it answers: do our early
    receives' NCCL kernels, spinning beside the stage's matmuls, slow the matmuls (graphed 1F1B only at
    torch's speed when both are GPU-bound, session 27)?"""
    receive = link.recv
    last: list = [None]

    def recv(*args, **kwargs):
        if last[0] is not None:
            last[0].synchronize()
        got = receive(*args, **kwargs)
        event = torch.cuda.Event()
        event.record()
        last[0] = event
        return got

    link.recv = recv


def summarize(trace_path: str, rank: int) -> dict:
    """Compute-stream busy time and gaps, NCCL kernels, from a Chrome trace of one step."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return {"error": "no kernels in the trace"}
    nccl = [e for e in kernels if "nccl" in e["name"].lower()]
    compute = [e for e in kernels if "nccl" not in e["name"].lower()]
    streams: dict[int, list] = {}
    for e in compute:
        streams.setdefault(e["args"].get("stream", e.get("tid")), []).append(e)
    main_stream = max(streams, key=lambda s: sum(e["dur"] for e in streams[s]))
    ks = sorted(streams[main_stream], key=lambda e: e["ts"])
    t0, t1 = min(e["ts"] for e in kernels), max(e["ts"] + e["dur"] for e in kernels)
    busy = sum(e["dur"] for e in ks)
    gaps = []
    for a, b in zip(ks, ks[1:]):
        gap = b["ts"] - (a["ts"] + a["dur"])
        if gap > 200:
            gaps.append({"at_ms": round((a["ts"] + a["dur"] - t0) / 1e3, 3), "gap_ms": round(gap / 1e3, 3),
                         "before": a["name"][:80], "after": b["name"][:80]})
    nccl_summary = [{"at_ms": round((e["ts"] - t0) / 1e3, 3), "dur_ms": round(e["dur"] / 1e3, 3),
                     "name": e["name"][:60], "stream": e["args"].get("stream")} for e in sorted(nccl, key=lambda e: e["ts"])]
    cpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    blocked = {}
    for e in cpu:
        n = e["name"]
        if any(k in n for k in ("recv", "wait", "synchron", "barrier")):
            blocked[n] = blocked.get(n, 0.0) + e["dur"] / 1e3
    overlap = _nccl_overlap(ks, nccl)
    host = _host_ops(events)
    return {"rank": rank, "span_ms": round((t1 - t0) / 1e3, 3), "compute_busy_ms": round(busy / 1e3, 3),
            "nccl_overlap": overlap, "host": host,
            "compute_streams": {str(s): round(sum(e["dur"] for e in v) / 1e3, 3) for s, v in streams.items()},
            "gaps_over_0.2ms": gaps, "gaps_total_ms": round(sum(g["gap_ms"] for g in gaps), 3),
            "nccl_kernels": nccl_summary[:80], "nccl_total_ms": round(sum(e["dur"] for e in nccl) / 1e3, 3),
            "host_blocked_ms": {k: round(v, 3) for k, v in sorted(blocked.items(), key=lambda kv: -kv[1])[:12]}}


def _host_ops(events: list) -> dict:
    """The main thread's top-level torch ops (those not inside another op): their count and time by name,
    and what is left of the thread's span (Python, the engine's own code). Top-level only, so nested ops
    (aten::mm inside aten::linear) are not counted twice."""
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op" and "dur" in e]
    if not ops:
        return {}
    by_tid: dict = {}
    for e in ops:
        by_tid.setdefault(e.get("tid"), []).append(e)
    # The two busiest threads: the Python thread, and on CUDA autograd's device thread (backward's ops)
    busiest = sorted(by_tid.items(), key=lambda kv: -len(kv[1]))[:2]
    return {f"thread_{tid}": _top_level(thread_ops) for tid, thread_ops in busiest}


def _top_level(main: list) -> dict:
    main.sort(key=lambda e: (e["ts"], -e["dur"]))
    top, end = [], float("-inf")
    for e in main:
        if e["ts"] >= end:
            top.append(e)
            end = e["ts"] + e["dur"]
    span = top[-1]["ts"] + top[-1]["dur"] - top[0]["ts"]
    total: dict[str, list] = {}
    for e in top:
        t = total.setdefault(e["name"], [0, 0.0])
        t[0] += 1
        t[1] += e["dur"]
    busy = sum(e["dur"] for e in top)
    ranked = sorted(total.items(), key=lambda kv: -kv[1][1])[:30]
    return {"span_ms": round(span / 1e3, 3), "ops": len(top), "ops_ms": round(busy / 1e3, 3),
            "between_ops_ms": round((span - busy) / 1e3, 3),
            "top": {k: [n, round(d / 1e3, 3)] for k, (n, d) in ranked}}


def _nccl_overlap(compute: list, nccl: list) -> dict:
    """How much compute ran beside an NCCL kernel, and what it cost: each compute kernel that overlaps an
    NCCL kernel against the median of the same kernel (by name) where none ran; ``excess_ms`` sums the
    differences (the slowdown the NCCL kernels' SMs cost the compute)."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in nccl)
    merged: list[list[float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])

    def overlapped(e) -> bool:
        a, b = e["ts"], e["ts"] + e["dur"]
        return any(x < b and a < y for x, y in merged)

    clean: dict[str, list[float]] = {}
    beside = []
    for e in compute:
        if overlapped(e):
            beside.append(e)
        else:
            clean.setdefault(e["name"], []).append(e["dur"])
    excess, by_name = 0.0, {}
    for e in beside:
        ref = clean.get(e["name"])
        if ref:
            extra = e["dur"] - statistics.median(ref)
            excess += extra
            by_name[e["name"][:60]] = by_name.get(e["name"][:60], 0.0) + extra
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    return {"nccl_span_ms": round(sum(b - a for a, b in merged) / 1e3, 3),
            "compute_beside_nccl_ms": round(sum(e["dur"] for e in beside) / 1e3, 3),
            "kernels_beside_nccl": len(beside), "excess_ms": round(excess / 1e3, 3),
            "excess_by_kernel_ms": {k: round(v / 1e3, 3) for k, v in top}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default="ours_1f1b,torch_1f1b,ours_gpipe,torch_gpipe")
    p.add_argument("--profile", default="ours_1f1b,torch_1f1b", help="variants to trace")
    p.add_argument("--model", default="gpt-1.3b")
    p.add_argument("--layers", type=int, default=None,
                   help="the model's blocks (default: the preset's); e.g. one GPU running a stage-sized GPT")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    from distributed_training import init_distributed

    context = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    cfg = GPT_PRESETS[args.model] if args.model in GPT_PRESETS else GPTConfig(
        vocab_size=64, block_size=32, n_layer=4, n_head=2, n_embd=16, dropout=0.0)
    if args.layers is not None:
        cfg = dataclasses.replace(cfg, n_layer=args.layers)
    ranks = list(range(world))
    groups = {"up": dist.new_group(ranks), "down": dist.new_group(ranks),
              "headers": dist.new_group(ranks, backend="gloo") if device.type == "cuda" else None,
              "tie": dist.new_group(sorted({0, world - 1})), "context": context}
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    os.makedirs(args.out, exist_ok=True)
    variants = args.variants.split(",")
    times: dict[str, list[float]] = {v: [] for v in variants}

    host: dict[str, list[float]] = {v: [] for v in variants}
    timing: dict[str, dict] = {}

    def timed(step, n, issued=None):
        """Step times; `issued` gets the host's time until the step returned (before synchronizing)."""
        out = []
        for _ in range(n):
            torch.cuda.synchronize() if device.type == "cuda" else None
            dist.barrier()
            t = time.perf_counter()
            step()
            if issued is not None:
                issued.append(time.perf_counter() - t)
            torch.cuda.synchronize() if device.type == "cuda" else None
            out.append(time.perf_counter() - t)
        return out

    for r in range(args.rounds):
        for v in variants:
            step = build_variant(v, cfg, x, y, args.microbatches, groups, rank, world, device)
            timed(step, 2)
            issued = []
            ts = timed(step, args.steps, issued)
            t = torch.tensor([statistics.median(ts), statistics.median(issued)], device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[v].append(t[0].item() * 1e3)
            host[v].append(t[1].item() * 1e3)
            if rank == 0:
                print(f"round {r} {v:22s} {t[0].item() * 1e3:8.1f} ms  (host issued in {t[1].item() * 1e3:6.1f} ms)",
                      flush=True)
            engine = getattr(step, "engine", None)
            if r == args.rounds - 1 and engine is not None:  # one more step, timed by the engine
                engine.timing = True
                timed(step, 1)
                engine.timing = False
                t = engine.last_timing
                if rank == 0:
                    timing[v] = {"busy_ms": t.busy_ms, "rank_busy_ms": t.rank_busy_ms, "window_ms": t.window_ms,
                                 "bubble": t.bubble, "bubble_simulated": t.bubble_simulated,
                                 "bubble_formula": t.bubble_formula}
                    print(f"        {v} timing: {timing[v]}", flush=True)
            if r == args.rounds - 1 and v in args.profile.split(","):
                from torch.profiler import ProfilerActivity, profile
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
                with profile(activities=acts) as prof:
                    timed(step, 1)
                path = os.path.join(args.out, f"trace_{v}_r{rank}.json")
                prof.export_chrome_trace(path)
                summary = summarize(path, rank) if device.type == "cuda" else {}
                with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as z:
                    z.write(f.read())
                os.remove(path)
                gathered = [None] * world
                dist.all_gather_object(gathered, summary)
                if rank == 0:
                    with open(os.path.join(args.out, f"summary_{v}.json"), "w") as f:
                        json.dump(gathered, f, indent=1)
                timed(step, 1)  # the profiler's last step's state out of the way
            if hasattr(step, "trainer"):
                step.trainer.close()
            del step
            torch.cuda.empty_cache() if device.type == "cuda" else None
    if rank == 0:
        med = {v: statistics.median(ts) for v, ts in times.items()}
        with open(os.path.join(args.out, "timings.json"), "w") as f:
            json.dump({"per_round_ms": times, "median_ms": med, "host_issue_ms_per_round": host, "engine_timing_rank0": timing, "card": torch.cuda.get_device_name() if
                       device.type == "cuda" else "cpu", "torch": torch.__version__}, f, indent=1)
        print(json.dumps(med, indent=1))
    context.shutdown()


if __name__ == "__main__":
    main()
