"""The benchmark suite: one command measures us against torch on the GPUs at hand and calibrates the
scaling model (`distributed_training.scaling`) from what it measured.

    python benchmarks/suite.py                 # every GPU here: worlds 1, 2, 4, ... up to all of them
    python benchmarks/suite.py --smoke         # CPU, gloo, 2 processes, a tiny GPT: what CI runs
    python benchmarks/suite.py --report DIR    # redo the markdown, plots and model from DIR/results.json

For each world size it starts `torchrun --nproc_per_node=W` on this script (`--worker`), which runs

* collective micro-benchmarks (W >= 2): NCCL's all-reduce, all-gather and reduce-scatter, and our ring,
  tree and hierarchical all-reduce and compressed reductions, over a range of sizes;
* training phases, interleaved over rounds in the same processes: the bare model (W = 1, with forward,
  backward and optimizer timed apart for the model), torch DDP, our DDP (and under ``no_sync``: its
  compute-only time, so exposed communication = step - compute-only), ZeRO-1/2/3, torch FSDP2 and our
  DDP with bf16 / Top-K / PowerSGD compression.

Then it merges the parts into ``results.json`` under ``--out`` (default
``benchmarks/results/<date>-<card>/``), fits the model (links from the micro-benchmarks, compute and
optimizer from the 1-GPU run), prints its error on every measured point, projects 8-256 GPUs and writes
``results.md`` and PNG plots (when matplotlib is installed; ``--report`` can add them later elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

MB = 2**20
GPU_SIZES = [MB * s for s in (1, 4, 16, 64, 256, 1024)]
SMOKE_SIZES = [2**12, 2**14, 2**16, 2**18, 2**20, 2**22]
GPU_MODELS = [("gpt2-124m", 16, 1024), ("gpt-1.3b", 8, 1024)]
SMOKE_MODELS = [("tiny", 4, 32)]
TRAIN_IMPLS = ["torch_ddp", "ours_ddp", "zero1", "zero2", "zero3", "torch_fsdp2", "ddp_bf16", "ddp_topk",
               "ddp_powersgd"]
PROJECT_GPUS = [1, 2, 8, 16, 32, 64, 128, 256]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, 2 processes, tiny sizes (CI)")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/<date>-<card>)")
    p.add_argument("--max-gpus", type=int, default=None)
    p.add_argument("--models", default=None, help="comma-separated preset:micro_batch:seq (default per mode)")
    p.add_argument("--impls", default=",".join(TRAIN_IMPLS))
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--timeout", type=float, default=None, help="seconds per world size before it counts as hung")
    p.add_argument("--report", default=None, help="only rebuild the report from this folder's results.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _models(args) -> list[tuple[str, int, int]]:
    if args.models:
        return [(m.split(":")[0], int(m.split(":")[1]), int(m.split(":")[2])) for m in args.models.split(",")]
    return SMOKE_MODELS if args.smoke else GPU_MODELS


# ------------------------------------------------------------------------------------------ worker
def _time_collective(fn, device, reps: int, warmup: int = 2, blocks: int = 3) -> float:
    """Seconds per call: the fastest of `blocks` timed blocks (noise on a shared machine only adds)."""
    from common import synchronize

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


def collectives(ctx, sizes: list[int], smoke: bool) -> list[dict]:
    """Seconds per call (slowest rank) of each collective at each size in bytes (fp32 payloads)."""
    import torch
    import torch.distributed as dist

    from distributed_training.comm.optimizer import CommunicationOptimizer
    from distributed_training.comm.patterns import hierarchical_all_reduce, ring_all_reduce, tree_all_reduce
    from distributed_training.strategies.fsdp import make_hybrid_groups

    n, device = ctx.world_size, ctx.device
    # Two emulated "nodes" of n/2 so both levels run (at n = 2 each "node" is one rank: the inter-node
    # all-reduce alone); an odd world is n nodes of one.
    per_node = n // 2 if n % 2 == 0 else 1
    intra, inter = make_hybrid_groups(per_node, None)
    reducers = {name: CommunicationOptimizer(**kw) for name, kw in
                (("topk", dict(compression="topk", compression_ratio=0.01)), ("bf16", dict(compression="bf16")),
                 ("powersgd", dict(compression="powersgd", powersgd_rank=4)))}
    rows = []
    for size in sizes:
        numel = size // 4
        x = torch.randn(numel, device=device)
        shard = torch.randn(-(-numel // n), device=device)
        gathered = torch.empty(shard.numel() * n, device=device)
        ops = {
            "nccl_all_reduce": lambda: dist.all_reduce(x),
            "ring_all_reduce": lambda: ring_all_reduce(x),
            "tree_all_reduce": lambda: tree_all_reduce(x),
            "hierarchical_all_reduce": lambda: hierarchical_all_reduce(x, intra, inter),
            "all_gather": lambda: dist.all_gather_into_tensor(gathered, shard),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, gathered),
        }
        for name, r in reducers.items():
            ops[f"{name}_reduce"] = (lambda r=r: r.all_reduce_compressed(x, None, key=0))
        budget = 2e8 if smoke else 2e10  # bytes per op and size: more repetitions for small messages
        reps = int(max(3, min(50, budget / size)))
        for op, fn in ops.items():
            x.normal_()  # the summing all-reduces grow it by n per call: start every op from the same scale
            seconds = torch.tensor([_time_collective(fn, device, reps)], device=device)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            s = seconds.item()
            # Compressed reductions stand in for an all-reduce of the same tensor: the same bus factor.
            factor = 2 * (n - 1) / n if op.endswith("_reduce") else (n - 1) / n
            rows.append({"op": op, "bytes": size, "world": n, "seconds": s, "algbw_gbs": size / s / 1e9,
                         "busbw_gbs": size / s / 1e9 * factor})
    return rows


def overlap_efficiency(ctx, nbytes: int) -> dict:
    """How much of an all-reduce hides under a matmul loop of about the same length:
    (comm alone + compute alone - both at once) / the shorter of the two, clamped to [0, 1]."""
    import torch
    import torch.distributed as dist

    from common import synchronize

    device = ctx.device
    x = torch.randn(nbytes // 4, device=device)
    a = torch.randn(1024 if device.type == "cuda" else 256, 1024 if device.type == "cuda" else 256, device=device)

    def timed(fn) -> float:
        synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        return time.perf_counter() - t0

    timed(lambda: dist.all_reduce(x))
    comm = min(timed(lambda: dist.all_reduce(x)) for _ in range(3))

    def twenty():
        for _ in range(20):
            a @ a

    one = min(timed(twenty) for _ in range(3)) / 20  # a loop, so launch and sync overheads do not count
    reps = max(1, round(comm / max(one, 1e-9)))

    def compute():
        for _ in range(reps):
            a @ a

    def both():
        work = dist.all_reduce(x, async_op=True)
        compute()
        work.wait()

    comp = min(timed(compute) for _ in range(3))
    together = min(timed(both) for _ in range(3))
    eff = torch.tensor([max(0.0, min(1.0, (comm + comp - together) / min(comm, comp)))], device=device)
    dist.all_reduce(eff, op=dist.ReduceOp.MIN)
    return {"bytes": nbytes, "comm_s": comm, "compute_s": comp, "both_s": together, "efficiency": eff.item()}


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from common import environment, make_batches, run_phase, synchronize, time_compute_and_optimizer
    from distributed_training import init_distributed
    from distributed_training.models import GPT_PRESETS

    ctx = init_distributed(device="cpu" if args.smoke else None)
    device = ctx.device
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    rounds = args.rounds or 2
    steps = args.steps or (3 if args.smoke else 10)
    warmup = 1 if args.smoke else 3
    part = {"world": ctx.world_size, **environment(), "collectives": [], "training": {}}
    if ctx.world_size > 1:
        part["collectives"] = collectives(ctx, SMOKE_SIZES if args.smoke else GPU_SIZES, args.smoke)
        part["overlap"] = overlap_efficiency(ctx, SMOKE_SIZES[-1] if args.smoke else 256 * MB)
    impls = [i for i in args.impls.split(",") if i]
    if ctx.world_size == 1:  # the baseline, and each of our strategies' own overhead with nothing to send
        impls = ["plain"] + [i for i in impls if not i.startswith("torch")]
    for model, micro, seq in _models(args):
        cfg = GPT_PRESETS[model]
        batches = make_batches(cfg, micro, seq, device, ctx.rank)
        synchronize(device)
        base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        entry = {"micro_batch": micro, "seq": seq, "tokens_per_step_per_gpu": micro * seq, "phases": {}}
        if ctx.world_size == 1:
            entry["profile"] = time_compute_and_optimizer(cfg, batches, warmup, steps, device)
        measured: dict[str, list] = {}
        for rnd in range(rounds):
            for impl in (impls if rnd % 2 == 0 else impls[::-1]):
                measured.setdefault(impl, []).append(run_phase(impl, cfg, batches, warmup, steps, device, ctx, base))
        if "ours_ddp" in impls:
            measured["ours_ddp_nosync"] = [run_phase("ours_ddp", cfg, batches, warmup, steps, device, ctx, base,
                                                     no_sync=True)]
        for impl, runs in measured.items():
            t = torch.tensor([statistics.median(r["step_s"] for r in runs), float(max(r["peak_bytes"] for r in runs))],
                             device=device)
            if ctx.world_size > 1:
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
            ph = {"step_s": t[0].item(), "tokens_per_s_per_gpu": micro * seq / t[0].item(),
                  "peak_gib": t[1].item() / 2**30, "round_step_s": [r["step_s"] for r in runs]}
            if "bytes_sent_per_step" in runs[-1]:
                ph["bytes_sent_per_step"] = runs[-1]["bytes_sent_per_step"]
            entry["phases"][impl] = ph
            if ctx.is_main:
                print(f"[suite] world {ctx.world_size} {model} {impl:16s} {ph['step_s'] * 1e3:9.2f} ms "
                      f"{ph['tokens_per_s_per_gpu']:10.0f} tok/s/GPU  peak {ph['peak_gib']:.2f} GiB", flush=True)
        part["training"][model] = entry
    if ctx.is_main:
        Path(args.part).write_text(json.dumps(part, indent=1))
    ctx.shutdown()


# ------------------------------------------------------------------------------------ orchestrator
def _worlds(max_gpus: int) -> list[int]:
    worlds, w = [], 1
    while w < max_gpus:
        worlds.append(w)
        w *= 2
    return worlds + [max_gpus]


def run_all(args) -> Path:
    import torch

    from common import environment

    gpus = 0 if args.smoke else torch.cuda.device_count()
    if not args.smoke and gpus == 0:
        raise SystemExit("no GPU here: use --smoke for the CPU run")
    top = 2 if args.smoke else min(gpus, args.max_gpus or gpus)
    env = environment()
    card = "cpu" if args.smoke else env["card"].replace("NVIDIA ", "").replace(" ", "-").lower()
    out = Path(args.out) if args.out else HERE / "results" / f"{env['date']}-{card}"
    out.mkdir(parents=True, exist_ok=True)
    parts = []
    for w in _worlds(top):
        part = out / f"part_world{w}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={w}", __file__,
               "--worker", "--part", str(part), "--impls", args.impls]
        for flag, value in (("--smoke", args.smoke), ("--models", args.models), ("--rounds", args.rounds),
                            ("--steps", args.steps)):
            if value:
                cmd += [flag] if value is True else [flag, str(value)]
        env_vars = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if args.smoke:
            env_vars.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        print(f"[suite] world {w}: {' '.join(cmd[2:])}", flush=True)
        subprocess.run(cmd, env=env_vars, check=True, timeout=args.timeout or (600 if args.smoke else 3600))
        parts.append(json.loads(part.read_text()))
        part.unlink()
    results = {"created": time.strftime("%Y-%m-%dT%H:%M:%S"), "smoke": args.smoke, **env,
               "gpus": top, "parts": parts}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    report(out)
    return out


# ------------------------------------------------------------------------------------------ report
def calibrate(results: dict) -> dict:
    """Fit the model from what was not the point being predicted: the link from the largest world's
    NCCL all-reduce, the overlap from the all-reduce-beside-matmul test, compute and optimizer from the
    bare model on one GPU, each strategy's overhead from its own one-GPU run (nothing to send). Then
    predict every multi-GPU step that was measured."""
    from distributed_training.scaling import Cluster, StepProfile, calibrate_link, step_time

    parts = {p["world"]: p for p in results["parts"]}
    multi = [w for w in parts if w > 1]
    if not multi or 1 not in parts:
        return {"error": "needs a 1-rank and a multi-rank run"}
    top = max(multi)
    rows = [r for r in parts[top]["collectives"] if r["op"] == "nccl_all_reduce"]
    try:
        link = calibrate_link(top, [r["bytes"] for r in rows], [r["seconds"] for r in rows], "ring_all_reduce")
    except ValueError as err:
        return {"error": f"link calibration failed: {err}"}
    overlap = parts[top].get("overlap", {}).get("efficiency", 1.0)
    model = {"link": {"world": top, "alpha_s": link.alpha, "bandwidth_gbs": link.bandwidth / 1e9},
             "overlap": overlap, "models": {}, "checks": []}
    for name, one in parts[1]["training"].items():
        prof, phases1 = one["profile"], one["phases"]
        compute = prof["forward_s"] + prof["backward_s"]
        bare = phases1["plain"]["step_s"]
        overhead = {strategy: max(0.0, phases1[impl]["step_s"] - bare) for impl, strategy in _STRATEGY_OF.items()
                    if impl in phases1}
        profile = StepProfile(params=prof["params"], compute_s=compute, optimizer_s=max(0.0, bare - compute),
                              backward_fraction=prof["backward_s"] / compute, units=prof["units"],
                              overhead_s=overhead, overlap=overlap)
        model["models"][name] = {"params": profile.params, "compute_s": compute, "optimizer_s": profile.optimizer_s,
                                 "backward_fraction": profile.backward_fraction, "units": profile.units,
                                 "overhead_s": overhead, "overlap": overlap,
                                 "largest_unit_params": prof["largest_unit_params"]}
        for w in multi:
            phases = parts[w]["training"].get(name, {}).get("phases", {})
            for impl, strategy in _STRATEGY_OF.items():
                if impl not in phases:
                    continue
                p = StepProfile(**{**profile.__dict__})
                if impl == "ddp_powersgd" and "bytes_sent_per_step" in phases[impl]:
                    p.powersgd_bytes = phases[impl]["bytes_sent_per_step"]
                predicted = step_time(p, Cluster(w, w, link, link), strategy)
                model["checks"].append({"model": name, "world": w, "strategy": impl,
                                        "measured_s": phases[impl]["step_s"], "predicted_s": predicted["total"],
                                        "predicted_exposed_s": predicted["exposed"],
                                        "error": predicted["total"] / phases[impl]["step_s"] - 1})
    return model


_STRATEGY_OF = {"ours_ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "ddp_bf16": "ddp_bf16",
                "ddp_topk": "ddp_topk", "ddp_powersgd": "ddp_powersgd"}


# Stated clusters for projections: NVLink inside a node (the calibrated link), 400 Gb/s InfiniBand
# per GPU between nodes (50 GB/s, 8 NICs a node), 10 us per inter-node message.
INTER_NODE = {"name": "400 Gb/s InfiniBand per GPU", "alpha_s": 10e-6, "bandwidth_gbs": 50.0}


def projections(results: dict, model: dict) -> dict:
    from distributed_training.scaling import Link, StepProfile, project

    if "link" not in model:
        return {}
    intra = Link(model["link"]["alpha_s"], model["link"]["bandwidth_gbs"] * 1e9)
    inter = Link(INTER_NODE["alpha_s"], INTER_NODE["bandwidth_gbs"] * 1e9)
    # Memory per GPU for the strategy choice: 80 GB (H100, the smaller card we run on); unbounded in smoke runs.
    memory = None if results.get("smoke") else 80e9
    out = {"intra": {"source": f"calibrated from {model['link']['world']}-rank NCCL all-reduce",
                     **model["link"]}, "inter": INTER_NODE, "gpus_per_node": 8, "models": {}}
    for name, m in model["models"].items():
        profile = StepProfile(params=m["params"], compute_s=m["compute_s"], optimizer_s=m["optimizer_s"],
                              backward_fraction=m["backward_fraction"], units=m["units"], overhead_s=m["overhead_s"],
                              overlap=m["overlap"])
        out["models"][name] = project(profile, PROJECT_GPUS, 8, intra, inter, memory_bytes=memory,
                                      largest_unit_params=m["largest_unit_params"])
    return out


def report(folder: Path) -> None:
    results = json.loads((folder / "results.json").read_text())
    model = calibrate(results)
    proj = projections(results, model)
    results["model"], results["projections"] = model, proj
    (folder / "results.json").write_text(json.dumps(results, indent=1))
    md = render_markdown(results)
    (folder / "results.md").write_text(md)
    print(md)
    try:
        plots(results, folder)
    except ImportError:
        print("[suite] matplotlib is not installed: no plots (run --report on a machine that has it)")


def render_markdown(results: dict) -> str:
    card = results["card"]
    lines = [f"# Benchmark suite: {card}{' (CPU smoke run: not a performance figure)' if results.get('smoke') else ''}",
             "", f"torch {results['torch']}, CUDA {results.get('cuda')}, NCCL {results.get('nccl')}, driver "
             f"{results.get('driver')}, Python {results['python']}; {results['created']}. Each training figure is "
             "the median over interleaved rounds; every rank's value, the slowest taken.", ""]
    parts = {p["world"]: p for p in results["parts"]}
    for w, part in sorted(parts.items()):
        if not part["collectives"]:
            continue
        lines += [f"## Collectives, {w} ranks: bus bandwidth GB/s (ours / NCCL's all-reduce in the last column)", ""]
        sizes = sorted({r["bytes"] for r in part["collectives"]})
        ops = list(dict.fromkeys(r["op"] for r in part["collectives"]))
        lines += ["| op | " + " | ".join(_size(s) for s in sizes) + " | at largest vs NCCL |",
                  "|---" * (len(sizes) + 2) + "|"]
        table = {(r["op"], r["bytes"]): r for r in part["collectives"]}
        for op in ops:
            ratio = table[(op, sizes[-1])]["seconds"]
            ref = table[("nccl_all_reduce", sizes[-1])]["seconds"]
            vs = f"{ref / ratio:.2f}x" if op.endswith("all_reduce") or op.endswith("_reduce") else ""
            lines.append(f"| {op} | " + " | ".join(f"{table[(op, s)]['busbw_gbs']:.2f}" for s in sizes) + f" | {vs} |")
        lines.append("")
    lines += ["## Training", "", "| model | GPUs | impl | step ms | tokens/s/GPU | vs torch DDP | scaling vs 1 GPU | "
              "exposed comm | peak GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for w, part in sorted(parts.items()):
        for name, entry in part["training"].items():
            one = parts.get(1, {}).get("training", {}).get(name, {}).get("phases", {}).get("plain", {})
            torch_ddp = entry["phases"].get("torch_ddp", {}).get("tokens_per_s_per_gpu")
            nosync = entry["phases"].get("ours_ddp_nosync", {}).get("step_s")
            for impl, ph in entry["phases"].items():
                vs = f"{ph['tokens_per_s_per_gpu'] / torch_ddp:.3f}x" if torch_ddp and not impl.endswith("nosync") else ""
                scale = (f"{100 * ph['tokens_per_s_per_gpu'] / one['tokens_per_s_per_gpu']:.1f}%"
                         if one and w > 1 and not impl.endswith("nosync") else "")
                exposed = (f"{100 * (ph['step_s'] - nosync) / ph['step_s']:.1f}%"
                           if nosync and impl == "ours_ddp" else "")
                lines.append(f"| {name} | {w} | {impl} | {ph['step_s'] * 1e3:.2f} | {ph['tokens_per_s_per_gpu']:,.0f} | "
                             f"{vs} | {scale} | {exposed} | {ph['peak_gib']:.2f} |")
    model = results.get("model", {})
    if "link" in model:
        lk = model["link"]
        lines += ["", "## Scaling model: calibration and error on the measured points", "",
                  f"Link from the {lk['world']}-rank NCCL all-reduce: alpha {lk['alpha_s'] * 1e6:.1f} us, bandwidth "
                  f"{lk['bandwidth_gbs']:.1f} GB/s; overlap efficiency {model['overlap']:.2f} (all-reduce beside a matmul loop). "
                  "Compute, optimizer and each strategy's own overhead from the 1-GPU runs.", "",
                  "| model | GPUs | impl | measured ms | predicted ms | error |", "|---|---|---|---|---|---|"]
        for c in model["checks"]:
            lines.append(f"| {c['model']} | {c['world']} | {c['strategy']} | {c['measured_s'] * 1e3:.2f} | "
                         f"{c['predicted_s'] * 1e3:.2f} | {100 * c['error']:+.1f}% |")
        worst = max((abs(c["error"]) for c in model["checks"]), default=float("nan"))
        lines += ["", f"Largest error: {100 * worst:.1f}%."]
    if "error" in model:
        lines += ["", f"## Scaling model: not calibrated ({model['error']})"]
    proj = results.get("projections", {})
    if proj.get("models"):
        lines += ["", "## Projections (model output, not measurements)", "",
                  f"Inside a node: {proj['intra']['source']} ({proj['intra']['bandwidth_gbs']:.1f} GB/s); between "
                  f"nodes: {proj['inter']['name']} ({proj['inter']['bandwidth_gbs']:.0f} GB/s, "
                  f"{proj['inter']['alpha_s'] * 1e6:.0f} us); {proj['gpus_per_node']} GPUs a node.", "",
                  "| model | GPUs | choice | efficiency | why |", "|---|---|---|---|---|"]
        for name, rows in proj["models"].items():
            for r in rows:
                eff = f"{100 * r['efficiency']:.1f}%" if r["efficiency"] is not None else "-"
                lines.append(f"| {name} | {r['gpus']} | {r['choice']} | {eff} | {r['reason']} |")
    return "\n".join(lines) + "\n"


def _size(b: int) -> str:
    return f"{b // MB} MB" if b >= MB else f"{b // 1024} KB"


def plots(results: dict, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common import save_figure

    card = results["card"]
    for part in results["parts"]:
        if not part["collectives"]:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for op in dict.fromkeys(r["op"] for r in part["collectives"]):
            rows = [r for r in part["collectives"] if r["op"] == op]
            ax.plot([r["bytes"] for r in rows], [r["busbw_gbs"] for r in rows], marker="o", label=op)
        save_figure(fig, ax, folder / f"collectives_world{part['world']}.png", xlabel="message bytes",
                    ylabel="bus bandwidth (GB/s)", title=f"Collectives, {part['world']} ranks, {card}", log2x=True)
    proj = results.get("projections", {}).get("models", {})
    for name, rows in proj.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        base = rows[0]["step_s"]["ddp"]
        for strategy in rows[0]["step_s"]:
            ax.plot([r["gpus"] for r in rows], [100 * base / r["step_s"][strategy] for r in rows], marker=".",
                    label=strategy)
        save_figure(fig, ax, folder / f"projection_{name}.png", xlabel="GPUs", ylabel="projected scaling efficiency (%)",
                    title=f"{name}: projection, not measurement ({card} compute)", log2x=True)
    checks = results.get("model", {}).get("checks", [])
    if checks:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        labels = [f"{c['model']}\n{c['world']}x {c['strategy']}" for c in checks]
        xs = range(len(checks))
        ax.bar([x - 0.2 for x in xs], [c["measured_s"] * 1e3 for c in checks], width=0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], [c["predicted_s"] * 1e3 for c in checks], width=0.4, label="model")
        ax.set_xticks(list(xs), labels, rotation=60, fontsize=6)
        save_figure(fig, ax, folder / "model_vs_measured.png", xlabel="", ylabel="step ms",
                    title=f"Scaling model vs measurement, {card}")


if __name__ == "__main__":
    a = parse_args()
    if a.worker:
        worker(a)
    elif a.report:
        report(Path(a.report))
    else:
        run_all(a)
