"""The scaling model against the 2-GPU DDP runs already on file (`ddp_gpu.py` results), before the suite's
own GPU run exists. It checks the model's structure on real GPU data, with what those runs measured:

* compute + optimizer: the bare model on one GPU, timed in the same job (``solo``);
* our DDP's own cost with nothing sent: its ``no_sync`` phase less ``solo``;
* the link: ``ours_comm_only`` (every bucket of the gradient all-reduced with no compute beside it),
  which for 2 ranks moves the gradient's bytes once: bandwidth = bytes / seconds;
* overlap: not measured by those runs, so the prediction is given for both bounds, 1 (everything
  the schedule hides is free) and 0 (communication and compute serialise).

    python benchmarks/model_check.py benchmarks/results/ddp_2026-11-26_h200.json --out benchmarks/results/model_check_2026-11-26_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from distributed_training.scaling import Cluster, Link, StepProfile, step_time  # noqa: E402


def check(runs: list[dict]) -> list[dict]:
    rows = []
    for r in runs:
        ph = r["phases"]
        if r["world_size"] != 2 or not {"ours", "ours_nosync", "ours_comm_only", "solo"} <= set(ph):
            continue
        grad_bytes = 4 * r["params"]
        solo, nosync = ph["solo"]["median_step_s"], ph["ours_nosync"]["median_step_s"]
        link = Link(0.0, grad_bytes / ph["ours_comm_only"]["median_step_s"])
        measured = ph["ours"]["median_step_s"]
        row = {"model": r["model"], "micro_batch": r["micro_batch"], "card": r["card"], "measured_s": measured,
               "solo_s": solo, "overhead_s": nosync - solo, "link_gbs": link.bandwidth / 1e9}
        for overlap in (1.0, 0.0):
            prof = StepProfile(params=r["params"], compute_s=solo, optimizer_s=0.0, overhead_s={"ddp": nosync - solo},
                               overlap=overlap)
            predicted = step_time(prof, Cluster(2, 2, link, link), "ddp")["total"]
            row[f"predicted_overlap{int(overlap)}_s"] = predicted
            row[f"error_overlap{int(overlap)}"] = predicted / measured - 1
        # The overlap that would make the model exact (the prediction is linear in it), for the record.
        lo, hi = row["predicted_overlap1_s"], row["predicted_overlap0_s"]
        row["implied_overlap"] = max(0.0, min(1.0, 1 - (measured - lo) / (hi - lo))) if hi > lo else 1.0
        rows.append(row)
    return rows


PROJECT_GPUS = [2, 8, 16, 32, 64, 128, 256]
INTER_NODE = Link(10e-6, 50e9)  # 400 Gb/s InfiniBand per GPU, 10 us a message: a stated assumption


def project_ddp(runs: list[dict], rows: list[dict]) -> list[dict]:
    """DDP's projected weak-scaling efficiency (the 1-GPU step over the N-GPU one), 8 GPUs a node:
    NVLink at the bandwidth measured inside the node, InfiniBand between nodes, both overlap bounds."""
    out = []
    for row in rows:
        intra = Link(0.0, row["link_gbs"] * 1e9)
        params = next(r["params"] for r in runs if r["model"] == row["model"])
        for n in PROJECT_GPUS:
            entry = {"model": row["model"], "micro_batch": row["micro_batch"], "gpus": n, "nodes": -(-n // 8)}
            for overlap in (1.0, 0.0):
                prof = StepProfile(params=params, compute_s=row["solo_s"], optimizer_s=0.0,
                                   overhead_s={"ddp": row["overhead_s"]}, overlap=overlap)
                t = step_time(prof, Cluster(n, 8, intra, INTER_NODE), "ddp")
                entry[f"efficiency_overlap{int(overlap)}"] = row["solo_s"] / t["total"]
            out.append(entry)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="ddp_gpu.py --summarize results files")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plots", default=None, help="write <prefix>_check.png and <prefix>_projection.png")
    args = ap.parse_args()
    runs = [run for path in args.results for run in json.load(open(path))["runs"]]
    rows = check(runs)
    lines = ["| model | micro-batch | measured ms | model, overlap 1 | model, overlap 0 | implied overlap |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['micro_batch']} | {r['measured_s'] * 1e3:.1f} | "
                     f"{r['predicted_overlap1_s'] * 1e3:.1f} ({100 * r['error_overlap1']:+.1f}%) | "
                     f"{r['predicted_overlap0_s'] * 1e3:.1f} ({100 * r['error_overlap0']:+.1f}%) | "
                     f"{r['implied_overlap']:.2f} |")
    table = "\n".join(lines)
    print(f"Card: {rows[0]['card'] if rows else '?'}; 2 GPUs, our DDP\n{table}")
    projection = project_ddp(runs, rows)
    plines = ["| model | micro-batch | GPUs (nodes of 8) | DDP efficiency, overlap 1 | overlap 0 |", "|---|---|---|---|---|"]
    for e in projection:
        plines.append(f"| {e['model']} | {e['micro_batch']} | {e['gpus']} ({e['nodes']}) | "
                      f"{100 * e['efficiency_overlap1']:.1f}% | {100 * e['efficiency_overlap0']:.1f}% |")
    ptable = "\n".join(plines)
    print("Projection (model output, not measurement): 400 Gb/s InfiniBand per GPU between nodes\n" + ptable)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"sources": args.results, "rows": rows, "table_markdown": table,
                       "projection": {"inter_node": {"alpha_s": INTER_NODE.alpha, "bandwidth_gbs": INTER_NODE.bandwidth / 1e9},
                                      "rows": projection, "table_markdown": ptable}}, f, indent=1)
    if args.plots:
        plot(rows, projection, args.plots)


def plot(rows: list[dict], projection: list[dict], prefix: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common import save_figure

    card = rows[0]["card"] if rows else "?"
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['model']}\nmicro-batch {r['micro_batch']}" for r in rows]
    xs = list(range(len(rows)))
    ax.bar([x - 0.27 for x in xs], [r["measured_s"] * 1e3 for r in rows], width=0.27, label="measured, 2 GPUs")
    ax.bar(xs, [r["predicted_overlap1_s"] * 1e3 for r in rows], width=0.27, label="model, overlap 1")
    ax.bar([x + 0.27 for x in xs], [r["predicted_overlap0_s"] * 1e3 for r in rows], width=0.27, label="model, overlap 0")
    ax.set_xticks(xs, labels, fontsize=8)
    save_figure(fig, ax, f"{prefix}_check.png", xlabel="", ylabel="step time (ms)",
                title=f"Scaling model vs measured DDP steps, 2x {card}")
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in dict.fromkeys((e["model"], e["micro_batch"]) for e in projection):
        pts = [e for e in projection if (e["model"], e["micro_batch"]) == key]
        line, = ax.plot([e["gpus"] for e in pts], [100 * e["efficiency_overlap1"] for e in pts], marker="o",
                        label=f"{key[0]} mb {key[1]}, overlap 1")
        ax.plot([e["gpus"] for e in pts], [100 * e["efficiency_overlap0"] for e in pts], marker="x", linestyle="--",
                color=line.get_color(), label=f"{key[0]} mb {key[1]}, overlap 0")
    save_figure(fig, ax, f"{prefix}_projection.png", xlabel="GPUs (8 a node, 400 Gb/s InfiniBand between nodes)",
                ylabel="DDP weak-scaling efficiency (%)", title=f"PROJECTION (model output), calibrated on 2x {card}",
                log2x=True)


if __name__ == "__main__":
    main()
