"""The cluster view of a log step: every rank's (or worker's) mean step time, gathered by the monitor,
summed up as ``cluster/*`` figures, and the straggler check on it."""

from __future__ import annotations

import math

__all__ = ["MEMBERS", "StragglerWarning", "cluster_view"]

MEMBERS = ("rank", "worker")  # what a Monitor calls the members of its group (`member`)


class StragglerWarning(UserWarning):
    """A rank's mean step time exceeded `straggler_threshold` times the median of all ranks'."""


def cluster_view(step: int, times: list[float], group_ranks: list[int], member: str,
                 threshold: float) -> tuple[dict[str, float], str | None]:
    """(the ``cluster/*`` figures, the straggler message or None) for the members' mean step `times`,
    in group order; `group_ranks` maps a member to its global rank (``cluster/slowest_rank``). A
    straggler is named by its member index when the members are workers, else by its global rank."""
    slowest = max(range(len(times)), key=times.__getitem__)
    t_max = times[slowest]
    median = sorted(times)[(len(times) - 1) // 2]
    ratio = t_max / median if median > 0 else (math.inf if t_max > 0 else 1.0)
    slowest_rank = group_ranks[slowest]
    view = {
        "cluster/step_time_min_s": min(times),
        "cluster/step_time_mean_s": sum(times) / len(times),
        "cluster/step_time_max_s": t_max,
        "cluster/slowest_rank": float(slowest_rank),
        "cluster/straggler_ratio": ratio,
        "cluster/straggler": 1.0 if ratio > threshold else 0.0,
    }
    if ratio <= threshold:
        return view, None
    who = slowest if member == "worker" else slowest_rank
    return view, (f"straggler at step {step}: {member} {who} averages {t_max:.4g} s per step, {ratio:.2f}x the "
                  f"median {member}'s {median:.4g} s (threshold {threshold:g}x)")
