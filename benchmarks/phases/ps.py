"""The parameter server (issue 19, `distributed_training.ps`) against our DDP, at every world >= 2.

Two parts, each in the same processes (servers and workers are ranks of this job; the messages travel
on gloo, CPU-side, also on GPUs, where the models run on the GPU and parameters cross through the host):

recommender   a click-through model: a few large embedding tables (rows of a power-law, Zipf alpha 1.1,
              item distribution; the hot items are the low ids) + an MLP over the concatenated rows, a
              logit; synthetic clicks, labels drawn from a fixed random "true" model (a bias per item of
              every table and an interaction of the first two), so the loss can fall towards the Bayes
              loss (reported). Same batches and initial weights for every variant, the same global batch
              split over the workers, Adam (plain SGD barely moves the tables here):
                ddp        our DDP over every rank, the tables replicated: the dense gradient of every
                           table is all-reduced each step (``gradient_bytes``: what one rank contributes;
                           ``ring_bytes``: what a ring all-reduce sends plus receives per rank); dense Adam
                ps_s{S}    the parameter server, sync, the tables sparse (``nn.Embedding(sparse=True)``):
                           S = 1 .. min(4, W - 1) servers, W - S workers; a step pulls and pushes only the
                           rows its batch touches, plus the MLP whole; lazy Adam on the tables (torch's
                           SparseAdam: only touched rows move), so its curve differs a little from DDP's,
                           and every ps_s{S} makes the same updates (``max_loss_diff_vs_ps_s1``)
              Per variant: payload bytes per step per worker, the median step time (the slowest worker's,
              after the warm-up steps), each server's bytes per step (in + out) and max / mean, the plan's
              bytes per server, and time-to-loss: wall seconds from the end of the first step until the
              EMA (0.9) of the mean training loss first falls to the target, within the step budget, and
              the steps it took. The target is the same for all: the highest of the variants' EMAs at
              70% of the budget (``--variants ps_target=X`` sets it), so that every variant reaches it.
consistency   sync vs ssp (s = 2) vs async on the digits classifier (an MLP, plain SGD), one
              server, W - 1 workers (world >= 3): time-to-accuracy (validation accuracy >= 0.9, evaluated
              by worker 0 every few steps) and the staleness the server measured (max, mean; ssp's never
              exceeds 2), under two straggler patterns:
                modes      the last worker slow: it sleeps in every step (the issue's case). ssp and
                           async apply each gradient as it comes; ssp's fast workers run up to 2 steps
                           ahead of the slow one and then wait for it, async's never wait
                rotating   a transient straggler: step k's sleeper is worker k mod (W - 1), so sync pays the
                           sleep every step while ssp lets each worker absorb its own within the bound
                           (the case SSP exists for)

``--steps N`` sets the recommender's step budget; ``--variants ps_target=X`` its target loss;
``--variants ps_sizes=gpu`` the GPU run's sizes in a --smoke (CPU) run (``smoke`` the reverse): the
large tables on CPU processes, where DDP's all-reduce of them travels on gloo too, e.g.
``suite.py --smoke --phases ps --worlds 3 --variants ps_sizes=gpu --steps 20`` (about a minute on 2 cores).
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common import skipped

ZIPF_ALPHA = 1.1
EMA = 0.9
TARGET_AT = 0.7  # the default target: the highest of the variants' loss EMAs at this fraction of the budget
ACCURACY_TARGET = 0.9
SSP_STALENESS = 2
DIGITS_LR = 0.5  # plain SGD: async's 1 / W scaling of each gradient is then like for like

SIZES = {
    # rows x dim of each table, MLP widths, global batch, step budget, warm-up steps (not in the step time),
    # SGD learning rate; digits: steps per worker at most, the slow worker's sleep, evaluation period
    "smoke": {"tables": [(4000, 16), (2000, 16), (1000, 16)], "hidden": (64, 32), "batch": 240, "steps": 60,
              "warmup": 3, "lr": 0.01, "digits_steps": 150, "delay_s": 0.002, "eval_every": 5},
    "gpu": {"tables": [(1_000_000, 32), (500_000, 32), (100_000, 32)], "hidden": (256, 128), "batch": 4096,
            "steps": 200, "warmup": 5, "lr": 0.01, "digits_steps": 200, "delay_s": 0.01, "eval_every": 5},
}


class Recommender(nn.Module):
    """Embedding tables (one id per table per example) -> concatenated rows -> MLP -> one logit."""

    def __init__(self, tables: list[tuple[int, int]], hidden: tuple[int, ...], sparse: bool) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(rows, dim, sparse=sparse) for rows, dim in tables)
        for table in self.tables:
            nn.init.normal_(table.weight, std=0.1)
        layers, width = [], sum(dim for _, dim in tables)
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.mlp = nn.Sequential(*layers, nn.Linear(width, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([t(ids[:, i]) for i, t in enumerate(self.tables)], 1)).squeeze(1)


def click_data(tables: list[tuple[int, int]], batch: int, steps: int, seed: int = 0):
    """(ids (steps, batch, tables) int64, labels (steps, batch) float, Bayes loss): the same on every rank.

    Ids are Zipf(alpha) over each table's rows (inverse CDF); a label is Bernoulli(sigmoid(logit)) of a
    fixed random model: a bias per row of every table, plus a rank-4 interaction of tables 0 and 1."""
    g = torch.Generator().manual_seed(seed)
    n = steps * batch
    ids = []
    for rows, _ in tables:
        weights = torch.arange(1, rows + 1, dtype=torch.float64).pow_(-ZIPF_ALPHA)
        cdf = weights.cumsum_(0)
        cdf /= cdf[-1].clone()
        ids.append(torch.searchsorted(cdf, torch.rand(n, generator=g, dtype=torch.float64)).clamp_(max=rows - 1))
    ids = torch.stack(ids, 1)
    logit = torch.zeros(n)
    for t, (rows, _) in enumerate(tables):
        logit += torch.randn(rows, generator=g)[ids[:, t]]
    if len(tables) > 1:
        a = torch.randn(tables[0][0], 4, generator=g)
        b = torch.randn(tables[1][0], 4, generator=g)
        logit += (a[ids[:, 0]] * b[ids[:, 1]]).sum(1)
    p = torch.sigmoid(logit)
    labels = torch.bernoulli(p, generator=g)
    q = p.clamp(1e-7, 1 - 1e-7)
    bayes = float(-(q * q.log() + (1 - q) * (1 - q).log()).mean())
    return ids.view(steps, batch, len(tables)), labels.view(steps, batch), bayes


def _options(opts) -> dict:
    sizes, target = "smoke" if opts.smoke else "gpu", None
    for token in (opts.variants or "").split(","):
        key, eq, value = token.partition("=")
        if eq and key == "ps_target":
            target = float(value)
        elif eq and key == "ps_sizes":
            if value not in SIZES:
                raise ValueError(f"ps: --variants ps_sizes={value!r} is not one of {', '.join(SIZES)}")
            sizes = value
    o = {**SIZES[sizes], "sizes": sizes, "target": target}
    if opts.steps:
        o["steps"] = int(opts.steps)
    if o["steps"] < o["warmup"] + 2:
        raise ValueError(f"ps: --steps must be at least {o['warmup'] + 2} (the warm-up and two timed steps), "
                         f"got {o['steps']}")
    return o


def _gather(obj, group) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def _lcm(values) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


# ------------------------------------------------------------------------------------- recommender
def _train(kind: str, num_servers: int, ctx, o: dict, data, group) -> dict:
    """One variant on this rank: a server's stats, or a worker's per-step losses and clock stamps."""
    from distributed_training import DDP
    from distributed_training.ps import ParameterServer

    ids, labels = data
    device = ctx.device
    torch.manual_seed(0)  # the same initial weights for every variant (the sparse flag draws nothing)
    model = Recommender(o["tables"], o["hidden"], sparse=kind == "ps").to(device)
    ctx.barrier()
    ps = wrapped = opt = None
    if kind == "ddp":
        wrapped, workers, w = DDP(model), ctx.world_size, ctx.rank
        opt = torch.optim.Adam(model.parameters(), lr=o["lr"])
    else:
        ps = ParameterServer(model, "adam", lr=o["lr"], num_servers=num_servers, consistency="sync", group=group)
        if ps.role == "server":
            stats = ps.serve()
            return {"role": "server", "bytes_in": stats.bytes_in, "bytes_out": stats.bytes_out,
                    "updates": stats.updates, "max_staleness": stats.max_staleness,
                    "plan_bytes": list(ps.plan.bytes_per_server), "plan_max_over_mean": ps.plan.max_over_mean}
        workers, w = ps.num_workers, ps.worker_index
    per = ids.shape[1] // workers
    xs = ids[:, w * per : (w + 1) * per].to(device)
    ys = labels[:, w * per : (w + 1) * per].to(device)
    names = [f"tables.{t}.weight" for t in range(len(o["tables"]))]
    losses, stamps = [], []
    for step in range(o["steps"]):
        x, y = xs[step], ys[step]
        if ps is not None:
            ps.pull(rows={name: x[:, t] for t, name in enumerate(names)})
            loss = F.binary_cross_entropy_with_logits(model(x), y)
            loss.backward()
            ps.step()
            model.zero_grad(set_to_none=True)
        else:
            loss = F.binary_cross_entropy_with_logits(wrapped(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # waits for the device: the stamp is the step's end
        stamps.append(time.perf_counter())
    out = {"role": "worker", "worker": w, "losses": losses, "stamps": stamps, "per_worker_batch": per}
    if ps is not None:
        out.update(traffic=ps.traffic, wait_s=ps.wait_seconds)
        ps.close()
    else:
        wrapped.remove_hooks()
        out["params"] = sum(p.numel() for p in model.parameters())
    return out


def _summarise(kind: str, num_servers: int, ranks: list[dict], o: dict) -> dict:
    """One variant's figures from every rank's part (every rank computes the same)."""
    workers = sorted((r for r in ranks if r["role"] == "worker"), key=lambda r: r["worker"])
    steps = o["steps"]
    mean_loss = [sum(r["losses"][k] for r in workers) / len(workers) for k in range(steps)]
    ema, curve = mean_loss[0], []
    for loss in mean_loss:
        ema = EMA * ema + (1 - EMA) * loss
        curve.append(ema)
    elapsed = [max(r["stamps"][k] - r["stamps"][0] for r in workers) for k in range(steps)]
    step_s = [max(r["stamps"][k] - r["stamps"][k - 1] for r in workers) for k in range(o["warmup"], steps)]
    out = {"kind": kind, "servers": num_servers, "workers": len(workers),
           "per_worker_batch": workers[0]["per_worker_batch"], "step_ms_median": 1e3 * statistics.median(step_s),
           "elapsed_s": elapsed[-1], "loss_mean": mean_loss, "loss_ema": curve, "elapsed": elapsed,
           "final_loss_ema": curve[-1], "finite": all(math.isfinite(x) for x in mean_loss)}
    if kind == "ddp":
        grad = 4 * workers[0]["params"]
        world = len(workers)
        out.update(params=workers[0]["params"], gradient_bytes_per_step=grad,
                   ring_bytes_per_step=int(2 * 2 * (world - 1) / world * grad),
                   bytes_per_step_per_worker=grad)
        return out
    servers = [r for r in ranks if r["role"] == "server"]  # in rank order: server 0 first
    per_worker = [sum(r["traffic"].values()) / steps for r in workers]
    push = [(r["traffic"]["push_values"] + r["traffic"]["push_indices"]) / steps for r in workers]
    pull = [(r["traffic"]["pull_values"] + r["traffic"]["pull_indices"]) / steps for r in workers]
    load = [(s["bytes_in"] + s["bytes_out"]) / steps for s in servers]
    out.update(bytes_per_step_per_worker=statistics.mean(per_worker), bytes_per_step_max_worker=max(per_worker),
               push_bytes_per_step=statistics.mean(push), pull_bytes_per_step=statistics.mean(pull),
               index_bytes_per_step=statistics.mean(
                   (r["traffic"]["push_indices"] + r["traffic"]["pull_indices"]) / steps for r in workers),
               server_bytes_per_step=load, server_max_over_mean=max(load) / statistics.mean(load) if any(load) else 1.0,
               plan_bytes_per_server=servers[0]["plan_bytes"], plan_max_over_mean=servers[0]["plan_max_over_mean"],
               updates=[s["updates"] for s in servers], max_staleness=max(s["max_staleness"] for s in servers),
               pull_wait_s_mean=statistics.mean(r["wait_s"] for r in workers))
    return out


def recommender(ctx, o: dict, group) -> dict:
    world = ctx.world_size
    server_counts = list(range(1, min(4, world - 1) + 1))
    worker_counts = [world] + [world - s for s in server_counts]
    unit = _lcm(worker_counts)  # a global batch every variant splits evenly: the same updates everywhere
    batch = max(unit, o["batch"] // unit * unit)
    t0 = time.perf_counter()
    ids, labels, bayes = click_data(o["tables"], batch, o["steps"])
    data_s = time.perf_counter() - t0
    variants = {}
    for kind, s in [("ddp", 0)] + [("ps", s) for s in server_counts]:
        name = "ddp" if kind == "ddp" else f"ps_s{s}"
        mine = _train(kind, s, ctx, o, (ids, labels), group)
        variants[name] = _summarise(kind, s, _gather(mine, group), o)
        if ctx.is_main:
            v = variants[name]
            print(f"== ps: {name} at world {world}: {v['step_ms_median']:.2f} ms/step, "
                  f"{v['bytes_per_step_per_worker'] / 2**20:.3f} MiB/step/worker, final loss EMA "
                  f"{v['final_loss_ema']:.4f}", flush=True)
    ddp, ps1 = variants["ddp"], variants["ps_s1"]
    at = min(o["steps"] - 1, int(TARGET_AT * o["steps"]))
    target = o["target"] if o["target"] is not None else max(v["loss_ema"][at] for v in variants.values())
    for name, v in variants.items():
        hit = next((k for k, e in enumerate(v["loss_ema"]) if e <= target), None)
        v.update(reached=hit is not None, steps_to_loss=None if hit is None else hit + 1,
                 time_to_loss_s=None if hit is None else v["elapsed"][hit],
                 bytes_vs_ddp=v["bytes_per_step_per_worker"] / ddp["gradient_bytes_per_step"],
                 max_loss_diff_vs_ddp=max(abs(a - b) for a, b in zip(v["loss_mean"], ddp["loss_mean"])),
                 max_loss_diff_vs_ps_s1=max(abs(a - b) for a, b in zip(v["loss_mean"], ps1["loss_mean"])))
    return {"sizes": o["sizes"], "tables": [list(t) for t in o["tables"]], "hidden": list(o["hidden"]),
            "zipf_alpha": ZIPF_ALPHA,
            "global_batch": batch, "steps": o["steps"], "warmup": o["warmup"], "lr": o["lr"], "data_s": data_s,
            "bayes_loss": bayes, "initial_loss": ddp["loss_mean"][0], "target_loss": target,
            "target_from": "given" if o["target"] is not None else f"the highest loss EMA at step {at + 1}",
            "optimizer": f"adam lr {o['lr']} (ddp dense, ps lazy on the tables)",
            "ema": EMA, "variants": variants}


# ------------------------------------------------------------------------------------- consistency
PATTERNS = {
    # which worker sleeps in a step: the case (the last worker always), and a transient straggler
    # (step k's is worker k mod W: each worker is slow one step in W, someone every step)
    "one_slow": lambda w, step, workers: w == workers - 1,
    "rotating": lambda w, step, workers: step % workers == w,
}


def _digits_run(ctx, o: dict, group, data, mode: str, staleness: int, pattern: str) -> dict:
    """One training of the digits MLP through the parameter server; every rank returns the same figures."""
    from distributed_training.ps import ParameterServer

    train_x, train_y, val_x, val_y = data
    batch, slow = 32, PATTERNS[pattern]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(ctx.device)
    ctx.barrier()
    ps = ParameterServer(model, "sgd", lr=DIGITS_LR, num_servers=1, consistency=mode, staleness=staleness,
                         group=group)
    if ps.role == "server":
        stats = ps.serve()
        stale = [s for _, _, s in stats.staleness]
        mine = {"role": "server", "updates": stats.updates, "max_staleness": stats.max_staleness,
                "mean_staleness": statistics.mean(stale) if stale else 0.0, "pulls_delayed": stats.pulls_delayed}
    else:
        w, workers = ps.worker_index, ps.num_workers
        shard = torch.arange(w, len(train_y), workers, device=ctx.device)
        g = torch.Generator().manual_seed(100 + w)
        evals, t0 = [], time.perf_counter()
        for step in range(o["digits_steps"]):
            idx = shard[torch.randint(0, len(shard), (batch,), generator=g).to(ctx.device)]
            ps.pull()
            F.cross_entropy(model(train_x[idx]), train_y[idx]).backward()
            if slow(w, step, workers):
                time.sleep(o["delay_s"])
            ps.step()
            model.zero_grad(set_to_none=True)
            if w == 0 and (step + 1) % o["eval_every"] == 0:
                with torch.no_grad():
                    acc = (model(val_x).argmax(1) == val_y).float().mean().item()
                evals.append((step + 1, time.perf_counter() - t0, acc))
        mine = {"role": "worker", "worker": w, "wall_s": time.perf_counter() - t0, "evals": evals,
                "wait_s": ps.wait_seconds}
        ps.close()
    ranks = _gather(mine, group)
    server = ranks[0]
    workers_ = sorted((r for r in ranks if r["role"] == "worker"), key=lambda r: r["worker"])
    evals = workers_[0]["evals"]
    hit = next((e for e in evals if e[2] >= ACCURACY_TARGET), None)
    out = {"staleness_bound": staleness if mode == "ssp" else None, "reached": hit is not None,
           "steps_to_accuracy": None if hit is None else hit[0],
           "time_to_accuracy_s": None if hit is None else hit[1],
           "final_accuracy": evals[-1][2] if evals else None, "evals": evals,
           "wall_s_per_worker": [r["wall_s"] for r in workers_],
           "pull_wait_s_per_worker": [r["wait_s"] for r in workers_],
           **{k: server[k] for k in ("updates", "max_staleness", "mean_staleness", "pulls_delayed")}}
    if ctx.is_main:
        print(f"== ps: digits {pattern} {mode} at world {ctx.world_size}: "
              + (f"accuracy {ACCURACY_TARGET} after {out['time_to_accuracy_s']:.2f} s (step {out['steps_to_accuracy']})"
                 if out["reached"] else f"accuracy {ACCURACY_TARGET} not reached (final {out['final_accuracy']})")
              + f"; max staleness {out['max_staleness']}; workers' wall s "
              + ", ".join(f"{x:.2f}" for x in out["wall_s_per_worker"]), flush=True)
    return out


def consistency(ctx, o: dict, group) -> dict:
    """sync / ssp / async on the digits, one server, W - 1 workers, under each straggler pattern."""
    if ctx.world_size < 3:
        return skipped("needs world >= 3: one server and at least two workers (one of them slow)")
    from distributed_training.datasets import digits

    x, y = digits().tensors
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm].to(ctx.device), y[perm].to(ctx.device)
    data = (x[:1200], y[:1200], x[1200:], y[1200:])
    patterns = {}
    for pattern in PATTERNS:
        patterns[pattern] = {mode: _digits_run(ctx, o, group, data, mode, staleness, pattern)
                             for mode, staleness in (("sync", 0), ("ssp", SSP_STALENESS), ("async", 0))}
    return {"status": "ok", "servers": 1, "workers": ctx.world_size - 1, "slow_worker": ctx.world_size - 2,
            "delay_s": o["delay_s"], "steps_per_worker": o["digits_steps"], "batch_per_worker": 32,
            "target_accuracy": ACCURACY_TARGET, "eval_every": o["eval_every"], "optimizer": f"sgd lr {DIGITS_LR}",
            "modes": patterns["one_slow"], "rotating": patterns["rotating"]}


def run(ctx, opts) -> dict:
    if ctx.world_size < 2:
        return skipped("a parameter server needs a server and a worker: world >= 2")
    o = _options(opts)
    group = dist.new_group(backend="gloo") if ctx.backend != "gloo" else None  # the PS's transport, on GPUs too
    return {"status": "ok", "transport": "gloo", "device": str(ctx.device), "recommender": recommender(ctx, o, group),
            "consistency": consistency(ctx, o, group)}
