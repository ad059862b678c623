"""Draw a run's per-rank curves from the monitor's JSONL files into one PNG.

    python -m distributed_training.monitor.plot runs/exp1 -o run.png

reads every ``runs/exp1/rank_*/metrics.jsonl`` and draws, one line per rank: the training loss, the
throughput (samples/s), the exposed communication time (% of the step) and the step time. A panel
whose metric no rank logged is left out. Needs matplotlib (the ``plot`` extra:
``pip install "distributed_training[plot]"``); no display is used.

A log directory used by several runs holds them all, appended: a run resumed from a checkpoint
logs again the steps after that checkpoint, a new run starts again from its first step. Each
rank's series is the latest run's: a record whose step does not follow the one before starts a
new run, which replaces the records of earlier runs from its first step on.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from typing import Sequence

__all__ = ["load_run", "plot_run", "main"]

MISSING_MATPLOTLIB = ("plotting needs matplotlib, which is not installed: pip install "
                      "\"distributed_training[plot]\" (in a checkout: pip install -e \".[plot]\")")

# (JSONL key, panel title, y label)
PANELS = [
    ("train/loss", "Training loss", "loss"),
    ("perf/samples_per_s", "Throughput per rank", "samples / s"),
    ("perf/exposed_comm_pct", "Exposed communication", "% of step time"),
    ("perf/step_time_s", "Step time per rank", "s"),
]


#: Seconds by which another rank may log a step before rank 0 and still be in the same run (ranks meet
#: every step; a new run starts seconds after the one before it at the least).
SAME_RUN_S = 5.0


def load_run(log_dir: str | os.PathLike) -> dict[int, list[dict]]:
    """rank -> its JSONL records, steps increasing: where a later run (a resumed or a new one) logged a
    step again, its records replace the earlier run's from there on. Lines that do not parse (one
    being written) are skipped. Where rank 0's run restarted at a step, another rank's records from that
    step on count only if written by the same run (not before rank 0's restart, within `SAME_RUN_S`):
    a rank that an earlier, larger run had and the later one has not is left with what came before."""
    runs: dict[int, list[dict]] = {}
    restart = None  # (step, time) of the record rank 0's file last went back to
    for path in glob.glob(os.path.join(os.fspath(log_dir), "rank_*", "metrics.jsonl")):
        match = re.fullmatch(r"rank_(\d+)", os.path.basename(os.path.dirname(path)))
        if match is None:
            continue
        rank, records = int(match.group(1)), []
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict) and isinstance(record.get("step"), (int, float)):
                    if rank == 0 and records and records[-1]["step"] >= record["step"]:
                        restart = (record["step"], record.get("time"))
                    while records and records[-1]["step"] >= record["step"]:
                        records.pop()  # a run restarted at this step: what came after it is superseded
                    records.append(record)
        if records:  # (a rank whose run logged no step: an empty file, not a series)
            runs[rank] = records
    if restart is not None and isinstance(restart[1], (int, float)):
        step, started = restart
        for rank in [r for r in runs if r != 0]:
            runs[rank] = [r for r in runs[rank] if r["step"] < step
                          or not isinstance(r.get("time"), (int, float)) or r["time"] >= started - SAME_RUN_S]
            if not runs[rank]:
                del runs[rank]
    return dict(sorted(runs.items()))


def member_of(runs: dict[int, list[dict]]) -> str:
    """What the run's series are: ``"worker"`` when its records say so (a parameter server's workers,
    `Monitor`'s ``member``), else ``"rank"``."""
    for records in runs.values():
        for record in records:
            if record.get("member") == "worker":
                return "worker"
    return "rank"


def plot_run(runs: dict[int, list[dict]], output: str | os.PathLike, *, title: str | None = None) -> list[str]:
    """Write the figure to `output`; return the metric keys that got a panel (raises if none did)."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(MISSING_MATPLOTLIB) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [p for p in PANELS if any(p[0] in r for records in runs.values() for r in records)]
    if not present:
        raise ValueError(f"none of {', '.join(p[0] for p in PANELS)} was logged")
    member = member_of(runs)
    fig, axes = plt.subplots(len(present), 1, figsize=(9, 2.8 * len(present)), sharex=True, squeeze=False)
    for ax, (key, panel_title, ylabel) in zip(axes[:, 0], present):
        for rank, records in runs.items():
            points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="." if len(points) < 50 else None, label=f"{member} {rank}")
        ax.set_title(panel_title.replace("per rank", f"per {member}"))
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if len(runs) <= 16:
            ax.legend(loc="best", fontsize="small")
    axes[-1, 0].set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    suffix = os.path.splitext(os.fspath(output))[1].lower().lstrip(".")
    # The file's suffix says its format (run.pdf, run.svg); PNG for a name without a suffix.
    formats = fig.canvas.get_supported_filetypes()
    if suffix and suffix not in formats:
        plt.close(fig)
        raise ValueError(f"-o {os.fspath(output)!r}: matplotlib writes no .{suffix} files; name the file with one of "
                         f"{', '.join('.' + f for f in sorted(formats))} (or no suffix: PNG)")
    fig.savefig(os.fspath(output), format=suffix or "png", dpi=100)
    plt.close(fig)
    return [p[0] for p in present]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distributed_training.monitor.plot",
        description="Plot loss, throughput and communication overhead per rank from a monitor log directory.",
    )
    parser.add_argument("log_dir", help="the Monitor's log_dir (holding rank_*/metrics.jsonl)")
    parser.add_argument("-o", "--output", default="run.png", help="PNG file to write (default: run.png)")
    parser.add_argument("--title", default=None, help="figure title (default: the log directory)")
    args = parser.parse_args(argv)

    runs = load_run(args.log_dir)
    if not runs:
        print(f"error: no rank_*/metrics.jsonl under {args.log_dir!r}", file=sys.stderr)
        return 2
    try:
        drawn = plot_run(runs, args.output, title=args.title or os.path.basename(os.path.normpath(args.log_dir)))
    except ImportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        print(f"error: nothing to plot in {args.log_dir!r}: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # -o in a folder that does not exist, or one not writable
        print(f"error: cannot write {args.output!r}: {err.strerror or err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} ({len(runs)} {member_of(runs)}(s); panels: {', '.join(drawn)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
