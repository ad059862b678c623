"""The scaling model against measurements, through the one calibration (`calibration.calibrate`).

* This run: the link from the largest world's NCCL all-reduce sweep (collectives phase), overlap from
  its all-reduce-beside-a-matmul test, compute and optimizer from the bare model on one GPU, each
  strategy's overhead from its own one-GPU run (training phase, world 1); then every multi-GPU training
  step measured is predicted, and 1-256 GPUs projected (nodes of 8, InfiniBand between them).
* DDP runs (this run's training phase at world 2, and the recorded ``--recorded`` files, by default
  ``benchmarks/results/ddp_2026-11-26_h200.json``, whose phases were ``solo``, ``ours``, ``ours_nosync``
  and ``ours_comm_only``): the link from the all-reduce of every bucket with nothing else running,
  compute from the 1-GPU step, DDP's overhead from its ``no_sync`` step; overlap was not measured with
  them, so the prediction is given at both bounds, 1 (all hidden) and 0 (serialised), with the overlap
  that would make it exact.
"""

from __future__ import annotations

import json
import math

from calibration import GPUS_PER_NODE, INTER_NODE, STRATEGY_OF, calibrate, inter_node_link

PROJECT_GPUS = [1, 2, 8, 16, 32, 64, 128, 256]
DDP_PROJECT_GPUS = [2, 8, 16, 32, 64, 128, 256]


def run(results: dict, opts) -> dict:
    out = {"status": "ok", "this_run": calibrate_this_run(results), "ddp_runs": {}}
    training = results["phases"].get("training", {})
    current = [r for w in training.get("worlds", {}).values() for r in _ddp_points_from_training(w, results)]
    sources = {"this run": current}
    for path in opts.recorded or []:
        sources[path] = [r for run in json.load(open(path))["runs"] for r in _ddp_points_from_recorded(run)]
    for name, points in sources.items():
        rows, projection = check_points(points)
        out["ddp_runs"][name] = {"rows": rows, "projection": projection}
    return out


# ----------------------------------------------------------------------------- this run's calibration
def calibrate_this_run(results: dict) -> dict:
    """Calibrate from this run's collectives and one-GPU training; predict every multi-GPU phase."""
    training = results["phases"].get("training", {}).get("worlds", {})
    collectives = results["phases"].get("collectives", {}).get("worlds", {})
    multi = sorted(int(w) for w, c in collectives.items() if c.get("status") == "ok")
    if "1" not in training or training["1"].get("status") != "ok" or not multi:
        return {"status": "skipped", "reason": "needs the training phase at world 1 and the collectives phase at a "
                                               "world >= 2"}
    top = collectives[str(max(multi))]
    rows = [r for r in top["rows"] if r["op"] == "nccl_all_reduce"]
    link = {"world": max(multi), "op": "ring_all_reduce", "bytes": [r["bytes"] for r in rows],
            "seconds": [r["seconds"] for r in rows]}
    overlap = top.get("overlap", {}).get("efficiency", 1.0)
    memory = None if results.get("smoke") else 80e9  # the smaller card we run on (H100); unbounded on CPU
    out = {"status": "ok", "overlap_source": "all-reduce beside a matmul loop", "models": {}, "checks": [],
           "projections": {"inter": INTER_NODE, "gpus_per_node": GPUS_PER_NODE, "memory_bytes": memory, "models": {}}}
    for name, one in training["1"]["models"].items():
        prof, phases1 = one["profile"], one["phases"]
        bare = phases1["plain"]["step_s"]
        overhead = {strategy: max(0.0, phases1[impl]["step_s"] - bare) for impl, strategy in STRATEGY_OF.items()
                    if impl in phases1}
        try:
            cal = calibrate({**prof, "step_s": bare}, link, overlap=overlap, overhead_s=overhead)
        except ValueError as err:
            return {"status": "error", "reason": f"link calibration failed: {err}"}
        out["models"][name] = cal.describe()
        out["link"] = out["models"][name]["link"]
        for w, part in sorted(training.items(), key=lambda kv: int(kv[0])):
            if int(w) < 2 or part.get("status") != "ok":
                continue
            phases = part["models"].get(name, {}).get("phases", {})
            for impl, strategy in STRATEGY_OF.items():
                if impl not in phases:
                    continue
                predicted = cal.predict(int(w), strategy, powersgd_bytes=phases[impl].get("bytes_sent_per_step")
                                        if impl == "ddp_powersgd" else None)
                out["checks"].append({"model": name, "world": int(w), "strategy": impl,
                                      "measured_s": phases[impl]["step_s"], "predicted_s": predicted["total"],
                                      "predicted_exposed_s": predicted["exposed"],
                                      "error": predicted["total"] / phases[impl]["step_s"] - 1})
        out["projections"]["models"][name] = cal.project(PROJECT_GPUS, memory)
        # Where compression pays: the link speed below which each compressed DDP beats dense, at each
        # multi-GPU world this run trained at, next to the measured link's speed.
        out.setdefault("break_even", [])
        for w in sorted(int(w) for w, part in training.items() if int(w) >= 2 and part.get("status") == "ok"):
            phases = training[str(w)]["models"].get(name, {}).get("phases", {})
            for impl in ("ddp_bf16", "ddp_topk", "ddp_powersgd"):
                if impl not in phases1:  # its own cost on one GPU is unknown: the model would call it free
                    continue
                strategy = STRATEGY_OF[impl]
                dense, packed = phases.get("ours_ddp"), phases.get(impl)
                out["break_even"].append({
                    "model": name, "world": w, "strategy": impl, "break_even_gbs": cal.break_even_gbs(w, strategy),
                    "link_gbs": cal.link.bandwidth / 1e9,
                    "measured_speedup": (dense["step_s"] / packed["step_s"]) if dense and packed else None})
    errors = [abs(c["error"]) for c in out["checks"] if math.isfinite(c["error"])]
    out["largest_error"] = max(errors) if errors else None
    return out


# ----------------------------------------------------------------------------------------- DDP runs
def _ddp_points_from_recorded(run: dict) -> list[dict]:
    """A run of the old ``ddp_gpu.py`` format (``benchmarks/results/ddp_*.json``), as check points."""
    ph = run["phases"]
    if run["world_size"] < 2 or not {"ours", "ours_nosync", "ours_comm_only", "solo"} <= set(ph):
        return []
    return [{"model": run["model"], "micro_batch": run["micro_batch"], "card": run["card"], "world": run["world_size"],
             "params": run["params"], "solo_s": ph["solo"]["median_step_s"], "ours_s": ph["ours"]["median_step_s"],
             "nosync_s": ph["ours_nosync"]["median_step_s"], "comm_only_s": ph["ours_comm_only"]["median_step_s"]}]


def _ddp_points_from_training(part: dict, results: dict) -> list[dict]:
    """This run's training phase at one world size, as check points."""
    if part.get("status") != "ok" or part.get("world_size", 1) < 2:
        return []
    points = []
    for name, entry in part["models"].items():
        ph = entry["phases"]
        if not {"solo", "ours_ddp", "ours_ddp_nosync"} <= set(ph) or "ours_comm_only" not in entry:
            continue
        points.append({"model": name, "micro_batch": entry["micro_batch"], "card": results.get("card"),
                       "world": part["world_size"], "params": entry["params"], "solo_s": ph["solo"]["step_s"],
                       "ours_s": ph["ours_ddp"]["step_s"], "nosync_s": ph["ours_ddp_nosync"]["step_s"],
                       "comm_only_s": entry["ours_comm_only"]["step_s"]})
    return points


def check(runs: list[dict]) -> list[dict]:
    """The model against recorded 2-GPU DDP runs (``ddp_gpu.py`` format): one row per run."""
    return check_points([p for run in runs for p in _ddp_points_from_recorded(run) if p["world"] == 2])[0]


def check_points(points: list[dict]) -> tuple[list[dict], list[dict]]:
    """(one row per point: measured against predicted at overlap 1 and 0; DDP's projected weak-scaling
    efficiency, the 1-GPU step over the N-GPU one, in nodes of 8 joined by `INTER_NODE`, both bounds)."""
    rows, projection = [], []
    for p in points:
        link = {"world": p["world"], "op": "ring_all_reduce", "bytes": [4 * p["params"]], "seconds": [p["comm_only_s"]]}
        measured = p["ours_s"]
        row = {"model": p["model"], "micro_batch": p["micro_batch"], "card": p["card"], "world": p["world"],
               "measured_s": measured, "solo_s": p["solo_s"], "overhead_s": p["nosync_s"] - p["solo_s"]}
        models = {overlap: calibrate({"params": p["params"], "step_s": p["solo_s"]}, link, overlap=overlap,
                                     overhead_s={"ddp": p["nosync_s"] - p["solo_s"]}) for overlap in (1.0, 0.0)}
        for overlap, cal in models.items():
            predicted = cal.predict(p["world"], "ddp")["total"]
            row[f"predicted_overlap{int(overlap)}_s"] = predicted
            row[f"error_overlap{int(overlap)}"] = predicted / measured - 1
        row["link_gbs"] = models[1.0].link.bandwidth / 1e9
        # The overlap that would make the model exact (the prediction is linear in it), for the record.
        lo, hi = row["predicted_overlap1_s"], row["predicted_overlap0_s"]
        # None where the two bounds are equal (no communication to hide): no overlap would explain it.
        row["implied_overlap"] = max(0.0, min(1.0, 1 - (measured - lo) / (hi - lo))) if hi > lo else None
        rows.append(row)
        for n in DDP_PROJECT_GPUS:
            entry = {"model": p["model"], "micro_batch": p["micro_batch"], "gpus": n, "nodes": -(-n // GPUS_PER_NODE)}
            for overlap, cal in models.items():
                t = cal.predict(n, "ddp", gpus_per_node=GPUS_PER_NODE, inter=inter_node_link())
                entry[f"efficiency_overlap{int(overlap)}"] = p["solo_s"] / t["total"]
            projection.append(entry)
    return rows, projection
