"""An alpha-beta model of our collectives and of a training step: calibrated from measurements, it
projects step time and scaling efficiency to clusters we have not run on.

Collectives (n ranks, M bytes; alpha = latency of one message, B = bytes/s one rank sends on a link):

    ring all-reduce        2(n-1) alpha + 2(n-1)/n * M / B
    tree all-reduce        2 ceil(log2 n) alpha + 2 M / B          (pipelined up and down a tree)
    all-gather, reduce-scatter (ring)   (n-1) alpha + (n-1)/n * M / B   (M = the whole gathered tensor)
    hierarchical all-reduce   reduce-scatter in the node (g ranks), ring all-reduce of M/g across the
                              k nodes, all-gather in the node

A ring that spans nodes runs at the slower link's speed. `all_reduce(..., "auto")` takes the cheapest
algorithm, as NCCL's tuner does.

A step (`step_time`) is forward, backward, the communication the strategy needs, and the optimizer
step. Communication runs on its own stream: gradient buckets become ready evenly through backward and
are sent one after another; ZeRO-2/3's gathers are prefetched one unit ahead of the compute that needs
them. What does not fit under the compute is *exposed* and adds to the step. The simulation is a few
lines (`_pipeline`) rather than a closed form, so that the last bucket (which can never overlap) and a
link too slow to keep up are both handled.

`calibrate_link` fits alpha and B from micro-benchmark times; `StepProfile` holds what one GPU
measures (forward+backward and optimizer seconds, parameter count); `project` tries every strategy at
every cluster size and says which it would choose and why.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

__all__ = ["Link", "Cluster", "StepProfile", "ring_all_reduce", "tree_all_reduce", "ring_all_gather",
           "ring_reduce_scatter", "hierarchical_all_reduce", "all_reduce", "calibrate_link", "step_time",
           "break_even_bandwidth", "project", "STRATEGIES"]


@dataclass(frozen=True)
class Link:
    """One class of link: `alpha` seconds per message, `bandwidth` bytes/s per rank (bus bandwidth)."""

    alpha: float
    bandwidth: float

    def __post_init__(self) -> None:
        if not _number(self.alpha) or not 0 <= self.alpha < math.inf or not _number(self.bandwidth) \
                or not 0 < self.bandwidth < math.inf:
            raise ValueError(f"a link needs a finite alpha >= 0 and a finite bandwidth > 0, got {self}")


@dataclass(frozen=True)
class Cluster:
    """`gpus` ranks, `gpus_per_node` to a node; `intra` links inside a node, `inter` between nodes."""

    gpus: int
    gpus_per_node: int
    intra: Link
    inter: Link

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Cluster.{name} must be an integer >= 1, got {value!r}")
        for name in ("intra", "inter"):
            if not isinstance(getattr(self, name), Link):
                raise TypeError(f"Cluster.{name} must be a Link, got {getattr(self, name)!r}")

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def flat(self) -> Link:
        """The link a ring over all ranks runs at: the inter-node one as soon as it spans nodes."""
        if self.nodes == 1:
            return self.intra
        return Link(max(self.intra.alpha, self.inter.alpha), min(self.intra.bandwidth, self.inter.bandwidth))


def _number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


# ------------------------------------------------------------------------------------- collectives
def _check_collective(op: str, n: int, nbytes: float) -> None:
    """`n` ranks (an integer >= 1) and `nbytes` (>= 0, finite), or a ValueError naming `op`'s argument
    (a negative world returned 0 s, a fractional one a time, negative bytes a negative time)."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:  # (numpy's integers too)
        raise ValueError(f"{op}: n is the number of ranks, an integer >= 1, got {n!r}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Real) or not 0 <= nbytes < math.inf:
        raise ValueError(f"{op}: nbytes must be a finite number of bytes >= 0, got {nbytes!r}")


def ring_all_reduce(n: int, nbytes: float, link: Link) -> float:
    _check_collective("ring_all_reduce", n, nbytes)
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.alpha + 2 * (n - 1) / n * nbytes / link.bandwidth


def tree_all_reduce(n: int, nbytes: float, link: Link) -> float:
    _check_collective("tree_all_reduce", n, nbytes)
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * link.alpha + 2 * nbytes / link.bandwidth


def ring_all_gather(n: int, nbytes: float, link: Link) -> float:
    """`nbytes` is the gathered (whole) tensor."""
    _check_collective("ring_all_gather", n, nbytes)
    if n <= 1:
        return 0.0
    return (n - 1) * link.alpha + (n - 1) / n * nbytes / link.bandwidth


def ring_reduce_scatter(n: int, nbytes: float, link: Link) -> float:
    """The same traffic as `ring_all_gather`, reversed (`nbytes`: the whole tensor reduced)."""
    _check_collective("ring_reduce_scatter", n, nbytes)
    return ring_all_gather(n, nbytes, link)


def hierarchical_all_reduce(cluster: Cluster, nbytes: float) -> float:
    g, k = min(cluster.gpus, cluster.gpus_per_node), cluster.nodes
    inside = ring_reduce_scatter(g, nbytes, cluster.intra) + ring_all_gather(g, nbytes, cluster.intra)
    return inside + ring_all_reduce(k, nbytes / g, cluster.inter)


def all_reduce(cluster: Cluster, nbytes: float, algorithm: str = "auto") -> float:
    """Seconds for one all-reduce of `nbytes` over the whole cluster."""
    options = {
        "ring": lambda: ring_all_reduce(cluster.gpus, nbytes, cluster.flat),
        "tree": lambda: tree_all_reduce(cluster.gpus, nbytes, cluster.flat),
        "hierarchical": lambda: hierarchical_all_reduce(cluster, nbytes),
    }
    if algorithm == "auto":
        return min(f() for f in options.values())
    if algorithm not in options:
        raise ValueError(f"algorithm must be one of {sorted(options) + ['auto']}, got {algorithm!r}")
    return options[algorithm]()


def all_gather(cluster: Cluster, nbytes: float) -> float:
    """Ring all-gather over the cluster; across nodes, gathered in the node first when that is cheaper."""
    flat = ring_all_gather(cluster.gpus, nbytes, cluster.flat)
    if cluster.nodes == 1:
        return flat
    g = min(cluster.gpus, cluster.gpus_per_node)
    two_level = ring_all_gather(cluster.nodes, nbytes / g, cluster.inter) + ring_all_gather(g, nbytes, cluster.intra)
    return min(flat, two_level)


def calibrate_link(n: int, sizes: list[float], seconds: list[float], op: str = "ring_all_reduce") -> Link:
    """Fit ``t = a + b * size`` to measured times of `op` over `n` ranks (least squares on relative
    error), turned into the link's alpha and bandwidth through that op's formula."""
    formulas = {  # (messages on the critical path, bytes sent per byte of the op's buffer)
        "ring_all_reduce": (2 * (n - 1), 2 * (n - 1) / n),
        "tree_all_reduce": (2 * math.ceil(math.log2(max(n, 1))), 2.0),
        "all_gather": (n - 1, (n - 1) / n),
        "reduce_scatter": (n - 1, (n - 1) / n),
    }
    if op not in formulas:
        raise ValueError(f"op must be one of {list(formulas)}, got {op!r}")
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 2:
        raise ValueError(f"a link is calibrated from a collective over at least 2 ranks: n must be an integer >= 2, "
                         f"got {n!r}")
    if any(not _number(x) or not 0 < x < math.inf for x in sizes):
        raise ValueError(f"calibrate_link needs message sizes > 0 bytes, got {list(sizes)!r}")
    if any(not _number(t) or not 0 < t < math.inf for t in seconds):
        raise ValueError(f"calibrate_link needs measured times > 0 seconds, got {list(seconds)!r}")
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError("calibrate_link needs at least two (size, seconds) points of equal count")
    # Weighted by 1/t^2, i.e. least squares on relative errors: otherwise the largest messages' noise
    # decides the intercept and alpha comes out meaningless.
    w = [1.0 / max(t, 1e-12) ** 2 for t in seconds]
    sw = sum(w)
    mean_x = sum(wi * x for wi, x in zip(w, sizes)) / sw
    mean_y = sum(wi * y for wi, y in zip(w, seconds)) / sw
    var = sum(wi * (x - mean_x) ** 2 for wi, x in zip(w, sizes))
    if var == 0:
        raise ValueError("calibrate_link needs at least two different sizes")
    b = sum(wi * (x - mean_x) * (y - mean_y) for wi, x, y in zip(w, sizes, seconds)) / var
    a = max(0.0, mean_y - b * mean_x)
    if not b > 0:
        raise ValueError(f"the measured times do not grow with size (slope {b:.3g} s/byte): cannot calibrate")
    hops, volume = formulas[op]
    return Link(alpha=a / hops, bandwidth=volume / b)


# -------------------------------------------------------------------------------------- step model
STRATEGIES = ("ddp", "ddp_bf16", "ddp_topk", "ddp_powersgd", "zero1", "zero2", "zero3")
_LOSSLESS = ("ddp", "zero1", "zero2", "zero3")


@dataclass
class StepProfile:
    """What one GPU measures for a model at a given micro-batch, plus the knobs of the strategies.

    compute_s: forward + backward seconds; optimizer_s: optimizer step seconds over all parameters;
    backward_fraction: share of `compute_s` spent in backward (2/3 for transformers: two matmuls per
    forward one). grad_bytes / gather_bytes: bytes per parameter of gradients (fp32) and of gathered
    ZeRO-2/3 weights (bf16 with mixed precision). units: ZeRO-3 units (transformer blocks).
    """

    params: int
    compute_s: float
    optimizer_s: float
    backward_fraction: float = 2 / 3
    bucket_bytes: float = 25 * 2**20
    grad_bytes: int = 4
    gather_bytes: int = 2
    units: int = 12
    topk_ratio: float = 0.01
    powersgd_bytes: float | None = None
    """Bytes PowerSGD all-reduces per step (P and Q of every matrix); default 1% of the fp32 gradient."""
    overhead_s: dict[str, float] = field(default_factory=dict)
    """Seconds a strategy adds to a step beyond compute, optimizer and communication (hooks, copies,
    compression kernels): its one-GPU step time less the bare model's, where nothing is sent."""
    overlap: float = 1.0
    """How much of the communication that the schedule puts under compute really is hidden (1: all;
    0: communication and compute share the hardware and serialise). Measured by running an all-reduce
    beside a matmul loop."""

    def __post_init__(self) -> None:
        # (overhead_s is measured as a difference of two step times: slightly negative is noise, kept)
        for name in ("params", "bucket_bytes", "grad_bytes", "gather_bytes", "units"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"StepProfile.{name} must be a positive finite number, got {value!r}")
        if not isinstance(self.units, int):  # (a count of ZeRO-3 units: 2.5 was taken)
            raise ValueError(f"StepProfile.units is a number of ZeRO-3 units, an integer >= 1, got {self.units!r}")
        if not isinstance(self.topk_ratio, bool) and _number(self.topk_ratio) and self.topk_ratio == 0:
            raise ValueError("StepProfile.topk_ratio is the share of gradient elements Top-K sends, in (0, 1], "
                             "got 0 (CommunicationOptimizer refuses it too)")
        for name in ("compute_s", "optimizer_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"StepProfile.{name} must be a number of seconds >= 0, got {value!r}")
        for name in ("backward_fraction", "overlap", "topk_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"StepProfile.{name} is a fraction in [0, 1], got {value!r}")
        if self.powersgd_bytes is not None and not 0 <= self.powersgd_bytes < math.inf:
            raise ValueError(f"StepProfile.powersgd_bytes must be >= 0 or None, got {self.powersgd_bytes!r}")
        for name, value in self.overhead_s.items():
            if name not in STRATEGIES:
                raise ValueError(f"StepProfile.overhead_s: {name!r} is not a strategy (one of {list(STRATEGIES)})")
            if not _number(value) or not math.isfinite(value) or value < -self.compute_s:
                raise ValueError(f"StepProfile.overhead_s[{name!r}] must be a finite number of seconds, no more "
                                 f"negative than -compute_s (noise of a measured difference), got {value!r}")


def _pipeline(ready: list[float], cost: list[float]) -> float:
    """Messages sent one after another on one stream, message i not before ready[i]: when the last ends."""
    end = 0.0
    for r, c in zip(ready, cost):
        end = max(end, r) + c
    return end


def step_time(profile: StepProfile, cluster: Cluster, strategy: str = "ddp", algorithm: str = "auto") -> dict:
    """Predicted seconds of one step: ``{"total", "compute", "optimizer", "comm", "exposed"}``."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {list(STRATEGIES)}, got {strategy!r}")
    if algorithm not in ("auto", "ring", "tree", "hierarchical"):
        raise ValueError(f"algorithm must be one of ['auto', 'hierarchical', 'ring', 'tree'], got {algorithm!r}")
    n, p = cluster.gpus, profile.params
    fwd = profile.compute_s * (1 - profile.backward_fraction)
    bwd = profile.compute_s * profile.backward_fraction
    opt = profile.optimizer_s if strategy.startswith("ddp") else profile.optimizer_s / n
    out = {"compute": profile.compute_s, "optimizer": opt, "comm": 0.0, "exposed": 0.0,
           "overhead": profile.overhead_s.get(strategy, 0.0)}
    if n == 1:
        out["total"] = profile.compute_s + out["overhead"] + profile.optimizer_s
        return out
    grad = p * profile.grad_bytes
    if strategy in ("ddp", "zero1") or strategy.startswith("ddp_"):
        wire = {"ddp": grad, "zero1": grad, "ddp_bf16": grad / 2, "ddp_powersgd":
                profile.powersgd_bytes if profile.powersgd_bytes is not None else 0.01 * grad}.get(strategy)
        nb = max(1, math.ceil(grad / profile.bucket_bytes))
        if strategy == "ddp_topk":  # (int32 index, fp32 value) pairs all-gathered from every rank
            cost = [all_gather(cluster, n * 8 * profile.topk_ratio * p / nb)] * nb
        else:
            cost = [all_reduce(cluster, wire / nb, algorithm)] * nb
        ready = [fwd + bwd * (i + 1) / nb for i in range(nb)]
        end = _pipeline(ready, cost)
        out["comm"] = sum(cost)
        out["exposed"] = max(0.0, end - (fwd + bwd))
        if strategy == "zero1":  # updated shards are all-gathered after the (sharded) optimizer step
            gather = all_gather(cluster, p * 4)
            out["comm"] += gather
            out["exposed"] += gather
    else:
        u = max(1, profile.units)
        gather = all_gather(cluster, p * profile.gather_bytes / u)
        scatter = ring_reduce_scatter(n, grad / u, cluster.flat)
        # Forward: unit i's gather may start once unit i-1's has (one ahead); compute waits for it.
        t, comm_end, exposed = 0.0, 0.0, 0.0
        phases = [(fwd / u, True, False), (bwd / u, strategy == "zero3", True)]
        for per_unit, gathers, scatters in phases:
            for _ in range(u):
                if gathers:
                    comm_end = max(comm_end, t - per_unit) + gather  # prefetched one unit ahead
                    if comm_end > t:
                        exposed += comm_end - t
                        t = comm_end
                t += per_unit
                if scatters:
                    comm_end = max(comm_end, t) + scatter
        tail = max(0.0, comm_end - t)  # the last reduce-scatters finish after backward
        out["comm"] = u * (gather * (2 if strategy == "zero3" else 1) + scatter)
        out["exposed"] = exposed + tail
    # Of what the schedule hides, only `overlap` is really free.
    out["exposed"] += (1 - profile.overlap) * max(0.0, out["comm"] - out["exposed"])
    out["overhead"] = profile.overhead_s.get(strategy, 0.0)
    out["total"] = profile.compute_s + out["overhead"] + out["exposed"] + opt
    return out


def break_even_bandwidth(profile: StepProfile, gpus: int, strategy: str, alpha: float, *,
                         low: float = 1e6, high: float = 1e13) -> float | None:
    """The link bandwidth (bytes/s per rank, one node of `gpus` ranks joined by links of latency
    `alpha`) below which compressed `strategy` (``ddp_bf16``, ``ddp_topk``, ``ddp_powersgd``) gives a
    shorter step than dense DDP, as the model predicts it: its saved bytes pay for its overhead.

    Returns ``math.inf`` when it wins at every bandwidth in [low, high], ``None`` when it never does
    (its overhead is larger than any communication it saves). Dense minus compressed step time grows
    as the link slows, so a bisection on a log scale finds the crossing."""
    if strategy not in STRATEGIES or not strategy.startswith("ddp_"):
        raise ValueError(f"strategy must be a compressed DDP variant of {list(STRATEGIES)}, got {strategy!r}")
    if gpus < 2:
        raise ValueError(f"break-even needs at least 2 GPUs (nothing is sent on one), got {gpus}")
    if not 0 < low < high:
        raise ValueError(f"break-even searches bandwidths low < high, both > 0: got low={low!r}, high={high!r}")

    def gain(bandwidth: float) -> float:
        cluster = Cluster(gpus, gpus, Link(alpha, bandwidth), Link(alpha, bandwidth))
        return step_time(profile, cluster, "ddp")["total"] - step_time(profile, cluster, strategy)["total"]

    if gain(high) > 0:
        return math.inf
    if gain(low) <= 0:
        return None
    lo, hi = math.log(low), math.log(high)
    for _ in range(60):
        mid = (lo + hi) / 2
        if gain(math.exp(mid)) > 0:
            lo = mid
        else:
            hi = mid
    return math.exp(lo)


def project(profile: StepProfile, gpus: list[int], gpus_per_node: int, intra: Link, inter: Link, *,
            memory_bytes: float | None = None, activation_bytes: float = 0.0, largest_unit_params: int | None = None,
            compression_gain: float = 1.10) -> list[dict]:
    """Step time and scaling efficiency of every strategy at every size in `gpus`; the choice and why.

    Efficiency is weak scaling: the one-GPU step time over the N-GPU one at the same per-GPU batch.
    The choice is the fastest lossless strategy (DDP, ZeRO-1/2/3) whose per-rank memory fits
    `memory_bytes` (see `planner.state_bytes`); a compressed DDP variant is chosen instead only when it
    is at least `compression_gain` times faster, since compression changes the numerics of training.
    """
    from .planner import state_bytes

    for name, value, low in (("memory_bytes", memory_bytes, 0.0), ("activation_bytes", activation_bytes, 0.0),
                             ("compression_gain", compression_gain, 1.0)):
        if value is not None and (not _number(value) or not low <= value < math.inf or (name == "memory_bytes" and not value > 0)):
            raise ValueError(f"project: {name} must be a finite number {'> 0' if name == 'memory_bytes' else f'>= {low:g}'}"
                             f", got {value!r}")
    base = profile.compute_s + profile.optimizer_s  # the bare model on one GPU
    rows = []
    for n in gpus:
        cluster = Cluster(n, gpus_per_node, intra, inter)
        times = {s: step_time(profile, cluster, s) for s in STRATEGIES}
        fits = {}
        for s in STRATEGIES:
            kind = "ddp" if s.startswith("ddp") else s
            need = state_bytes(kind, profile.params, n, largest_unit_params=largest_unit_params) + activation_bytes
            fits[s] = memory_bytes is None or need <= memory_bytes
        lossless = [s for s in _LOSSLESS if fits[s]]
        if not lossless:
            rows.append({"gpus": n, "nodes": cluster.nodes, "choice": None, "reason": "nothing fits in memory",
                         "step_s": {s: t["total"] for s, t in times.items()}, "efficiency": None})
            continue
        best = min(lossless, key=lambda s: times[s]["total"])
        reason = (f"{best} is the fastest lossless strategy that fits: {times[best]['total'] * 1e3:.1f} ms/step, "
                  f"{times[best]['exposed'] * 1e3:.1f} ms of it exposed communication")
        compressed = [s for s in STRATEGIES if s.startswith("ddp_") and fits[s]]
        if compressed:
            fastest = min(compressed, key=lambda s: times[s]["total"])
            gain = times[best]["total"] / times[fastest]["total"]
            if gain >= compression_gain:
                reason = (f"{fastest} is {gain:.2f}x faster than {best} (the best lossless option, exposed "
                          f"communication {times[best]['exposed'] * 1e3:.1f} ms): worth its approximation")
                best = fastest
            else:
                reason += f"; compression would gain only {gain:.2f}x (< {compression_gain:.2f}x), not worth it"
        rows.append({"gpus": n, "nodes": cluster.nodes, "choice": best, "reason": reason,
                     "step_s": {s: t["total"] for s, t in times.items()},
                     "exposed_s": {s: t["exposed"] for s, t in times.items()},
                     "efficiency": base / times[best]["total"]})
    return rows

