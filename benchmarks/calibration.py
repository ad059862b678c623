"""The one calibration of the scaling model (`distributed_training.scaling`) from measurements.

Every phase that compares the model with what it measured goes through `calibrate`: the suite's own run
(link from the collectives phase's NCCL all-reduce sweep, compute and optimizer timed apart on one GPU,
overlap from the all-reduce-beside-a-matmul test, each strategy's overhead from its one-GPU run) and the
model check on recorded runs (link from one all-reduce of every gradient bucket with nothing else
running, the 1-GPU step as compute, DDP's overhead from its ``no_sync`` step). Nothing is taken from the
multi-GPU points being predicted.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from distributed_training.scaling import (  # noqa: E402
    Cluster, Link, StepProfile, break_even_bandwidth, calibrate_link, project, step_time,
)

# A stated assumption for projections across nodes: 400 Gb/s InfiniBand per GPU (50 GB/s), 10 us a message.
INTER_NODE = {"name": "400 Gb/s InfiniBand per GPU", "alpha_s": 10e-6, "bandwidth_gbs": 50.0}
GPUS_PER_NODE = 8

# The model's strategy for each implementation the training phase measures.
STRATEGY_OF = {"ours_ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "ddp_bf16": "ddp_bf16",
               "ddp_topk": "ddp_topk", "ddp_powersgd": "ddp_powersgd"}

_VOLUME = {  # (messages, bytes per rank as a fraction of the tensor) of each op, as in `calibrate_link`
    "ring_all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}


@dataclass
class Calibration:
    """The model's inputs as measured: one GPU's `profile`, the `link` inside a node (measured over
    `link_world` ranks) and the largest ZeRO-3 unit (for the memory check of projections)."""

    profile: StepProfile
    link: Link
    link_world: int
    largest_unit_params: int | None = None

    def predict(self, world: int, strategy: str, *, overlap: float | None = None, gpus_per_node: int | None = None,
                inter: Link | None = None, powersgd_bytes: float | None = None) -> dict:
        """`step_time` at `world` GPUs: one node of them by default, else nodes of `gpus_per_node`
        joined by `inter`. `overlap` and `powersgd_bytes` override the calibrated profile's."""
        changes = {}
        if overlap is not None:
            changes["overlap"] = overlap
        if powersgd_bytes is not None:
            changes["powersgd_bytes"] = powersgd_bytes
        cluster = Cluster(world, gpus_per_node or world, self.link, inter or self.link)
        return step_time(replace(self.profile, **changes), cluster, strategy)

    def break_even_gbs(self, world: int, strategy: str) -> float | None:
        """GB/s of link (per rank, `world` GPUs in one node, this link's latency) below which compressed
        `strategy` beats dense DDP in the model; inf: at any speed, None: never."""
        bandwidth = break_even_bandwidth(self.profile, world, strategy, self.link.alpha)
        return bandwidth if bandwidth in (None, float("inf")) else bandwidth / 1e9

    def project(self, gpus: list[int], memory_bytes: float | None) -> list[dict]:
        """Every strategy at every size in `gpus`, nodes of 8 joined by `INTER_NODE`; the choice and why."""
        return project(self.profile, gpus, GPUS_PER_NODE, self.link, inter_node_link(), memory_bytes=memory_bytes,
                       largest_unit_params=self.largest_unit_params)

    def describe(self) -> dict:
        p = self.profile
        return {"link": {"world": self.link_world, "alpha_s": self.link.alpha, "bandwidth_gbs": self.link.bandwidth / 1e9},
                "params": p.params, "compute_s": p.compute_s, "optimizer_s": p.optimizer_s,
                "backward_fraction": p.backward_fraction, "units": p.units, "overhead_s": dict(p.overhead_s),
                "overlap": p.overlap, "largest_unit_params": self.largest_unit_params}


def inter_node_link() -> Link:
    return Link(INTER_NODE["alpha_s"], INTER_NODE["bandwidth_gbs"] * 1e9)


def calibrate(one_gpu: dict, link: dict, *, overlap: float = 1.0, overhead_s: dict | None = None) -> Calibration:
    """The model calibrated from measurements.

    one_gpu: the bare model on one GPU: ``params``, ``step_s`` (a whole step); where they were timed
        apart, ``forward_s`` and ``backward_s`` (the rest of the step is the optimizer; otherwise the
        whole step counts as compute, which changes nothing for DDP, whose optimizer step is not
        divided); optionally ``units`` and ``largest_unit_params`` (ZeRO-3 units).
    link: an all-reduce (``op``, default ``ring_all_reduce``) over ``world`` ranks, at ``bytes`` with
        ``seconds``: a sweep of sizes fits alpha and bandwidth (`scaling.calibrate_link`); one size
        gives the bandwidth alone (alpha 0).
    overlap: the fraction of scheduled-under-compute communication that is really hidden.
    overhead_s: seconds each strategy adds to a step with nothing to send (its 1-GPU or ``no_sync``
        step less the bare one), by the model's strategy names.
    """
    world, op = link["world"], link.get("op", "ring_all_reduce")
    sizes, seconds = list(link["bytes"]), list(link["seconds"])
    if len(set(sizes)) >= 2:
        fitted = calibrate_link(world, sizes, seconds, op)
    elif len(sizes) == 1 and world >= 2:
        fitted = Link(0.0, _VOLUME[op](world) * sizes[0] / seconds[0])
    else:
        raise ValueError(f"a link needs at least one all-reduce over 2 or more ranks, got world {world}, "
                         f"{len(sizes)} sizes")
    step = one_gpu["step_s"]
    if "forward_s" in one_gpu and "backward_s" in one_gpu:
        compute = one_gpu["forward_s"] + one_gpu["backward_s"]
        optimizer, backward_fraction = max(0.0, step - compute), one_gpu["backward_s"] / compute
    else:
        compute, optimizer, backward_fraction = step, 0.0, 2 / 3
    profile = StepProfile(params=one_gpu["params"], compute_s=compute, optimizer_s=optimizer,
                          backward_fraction=backward_fraction, units=one_gpu.get("units", 12),
                          overhead_s=dict(overhead_s or {}), overlap=overlap)
    return Calibration(profile, fitted, world, one_gpu.get("largest_unit_params"))
