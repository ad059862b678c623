"""ResNet-50 on ImageNet at 8-256 GPUs: a projection of the scaling model from the images phase.

Labelled a projection everywhere it is shown: nothing here ran on more GPUs than the images phase did.
Inputs, all from this run's images phase (`phases.images`) but two stated assumptions:

* compute: a GPU's step with nothing sent, measured two ways: ``ours`` at one GPU (one process on the
  machine) and ``ours_nosync`` at the largest world (every GPU of the job computing at once: the host's
  cores, memory bandwidth and the GPUs' power are shared, and a launch-bound model slows down). The
  projection uses the loaded figure, which is what a GPU of a full node gets.
* the link inside a node: NCCL's all-reduce sweep at the largest world (``link``), fitted to alpha and
  bus bandwidth (`scaling.calibrate_link`). Assumed: an 8-GPU node's link is what these GPUs measured.
* between nodes (assumption): `calibration.INTER_NODE`, 400 Gb/s InfiniBand per GPU, 10 us a message.

First the model is checked on the worlds measured: our DDP's step at each world >= 2 predicted from
each compute figure. Then the step at 8-256 GPUs (nodes of 8) under our DDP, twice: the model alone,
and *anchored* at the largest world measured (the model's step at N over its step there, times the
step measured there: what the model misses at that world carried to every N in proportion); the images/s and the
time of one ImageNet epoch (1,281,167 training images) at the phase's per-GPU batch, and the decode
rate the input pipeline would need per GPU next to what the reader measured (from JPEGs smaller than
ImageNet's, so ImageNet's own decode is slower than that figure).
"""

from __future__ import annotations

import math

from calibration import GPUS_PER_NODE, INTER_NODE, calibrate, inter_node_link

from distributed_training.scaling import Cluster, step_time

IMAGENET_TRAIN = 1_281_167
PROJECT_GPUS = [8, 16, 32, 64, 128, 256]
MODELS = ("resnet50", "resnet18")  # the phase's ResNet (resnet18: its CPU smoke run)


def run(results: dict, opts) -> dict:
    images = results["phases"].get("images", {}).get("worlds", {})
    ok = {int(w): part for w, part in images.items() if part.get("status") == "ok"}
    multi = sorted(w for w, part in ok.items() if w >= 2 and part.get("link"))
    name = next((m for m in MODELS if 1 in ok and m in ok[1].get("models", {})), None)
    if name is None or not multi:
        return {"status": "skipped", "reason": "needs the images phase's ResNet at world 1 and at a world >= 2 "
                                               "(with its all-reduce sweep)"}
    top = max(multi)
    one = ok[1]["models"][name]
    loaded = ok[top]["models"].get(name, {})
    if "ours_nosync" not in loaded.get("step_ms_median", {}):
        return {"status": "skipped", "reason": f"the images phase at world {top} has no ours_nosync step"}
    batch, params = one["batch_per_gpu"], one["params"]
    link = ok[top]["link"]
    computes = {"one GPU alone": one["step_ms_median"]["ours"] / 1e3,
                f"{top} GPUs computing at once (no_sync)": loaded["step_ms_median"]["ours_nosync"] / 1e3}
    link_fit = "alpha and bandwidth fitted to the sweep"
    try:
        cals = {label: calibrate({"params": params, "step_s": s}, link) for label, s in computes.items()}
    except ValueError:  # times that do not grow with size (tiny tensors, a loaded machine): the largest alone
        largest = max(range(len(link["bytes"])), key=lambda i: link["bytes"][i])
        link = {**link, "bytes": [link["bytes"][largest]], "seconds": [link["seconds"][largest]]}
        link_fit = "bandwidth from the largest size alone (the sweep's times did not grow with size)"
        cals = {label: calibrate({"params": params, "step_s": s}, link) for label, s in computes.items()}
    checks = []
    for w in multi:
        measured = ok[w]["models"].get(name, {}).get("step_ms_median", {}).get("ours")
        if measured is None:
            continue
        for label, cal in cals.items():
            predicted = cal.predict(w, "ddp")["total"]
            checks.append({"world": w, "compute": label, "measured_s": measured / 1e3, "predicted_s": predicted,
                           "error": predicted / (measured / 1e3) - 1})
    cal = cals[f"{top} GPUs computing at once (no_sync)"]
    per_gpu_node = batch / computes[f"{top} GPUs computing at once (no_sync)"]
    decode = (loaded.get("input") or one.get("input") or {}).get("decoded_images_per_s_per_process")
    # Anchored: the model's step at N over its step at the largest world measured, times the step
    # measured there (what the model misses at that world, e.g. compute slowed by the all-reduce running
    # beside it, carried to every N in proportion).
    measured_top = ok[top]["models"][name]["step_ms_median"].get("ours")
    model_top = cal.predict(top, "ddp")["total"]
    rows = []
    for n in PROJECT_GPUS:
        t = step_time(cal.profile, Cluster(n, GPUS_PER_NODE, cal.link, inter_node_link()), "ddp")
        rate = n * batch / t["total"]
        row = {"gpus": n, "nodes": math.ceil(n / GPUS_PER_NODE), "step_s": t["total"], "exposed_s": t["exposed"],
               "images_per_s": rate, "epoch_s": IMAGENET_TRAIN / rate,
               "efficiency_vs_loaded_gpu": rate / (n * per_gpu_node),
               "decode_processes_per_gpu": (rate / n) / decode if decode else None}
        if measured_top is not None:
            anchored = measured_top / 1e3 * t["total"] / model_top
            row.update(anchored_step_s=anchored, anchored_epoch_s=IMAGENET_TRAIN / (n * batch / anchored),
                       anchored_efficiency_vs_one_gpu=computes["one GPU alone"] / anchored)
        rows.append(row)
    measured_epochs = {w: IMAGENET_TRAIN / (w * ok[w]["models"][name]["images_per_s_per_gpu"]["ours"])
                       for w in sorted(ok) if "ours" in ok[w]["models"].get(name, {}).get("images_per_s_per_gpu", {})}
    return {"status": "ok", "label": "projection", "model": name, "batch_per_gpu": batch, "params": params,
            "anchor_world": top,
            "image_size": one["image_size"], "precision": ok[1].get("precision"),
            "compute_s": computes, "link": cals[next(iter(cals))].describe()["link"], "inter": INTER_NODE,
            "link_backend": link.get("backend", "nccl"), "link_fit": link_fit,
            "gpus_per_node": GPUS_PER_NODE, "checks": checks, "rows": rows,
            "measured_epoch_s": measured_epochs, "decoded_images_per_s_per_process": decode,
            "largest_error": max((abs(c["error"]) for c in checks if c["compute"] != "one GPU alone"), default=None)}
