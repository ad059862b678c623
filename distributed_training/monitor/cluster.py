"""The cluster view of a log step: every rank's (or worker's) mean step time, gathered by the monitor,
summed up as ``cluster/*`` figures, and the straggler check on it."""

from __future__ import annotations

import math

__all__ = ["MEMBERS", "StragglerWarning", "cluster_view"]

MEMBERS = ("rank", "worker")  # what a Monitor calls the members of its group (`member`)
#: A straggler costs the others at least this much a step: below it, a ratio over the threshold is a
#: millisecond step's timing noise (1.5x between equal ranks at 3 ms steps on 2 CPU processes).
MIN_EXCESS_S = 0.005


class StragglerWarning(UserWarning):
    """A rank's own time per step (its step time less its wait for the others, where known) exceeded
    `straggler_threshold` times the median rank's, and by at least `MIN_EXCESS_S`."""


def cluster_view(step: int, times: list[float], group_ranks: list[int], member: str, threshold: float,
                 own_times: list[float] | None = None) -> tuple[dict[str, float], str | None]:
    """(the ``cluster/*`` figures, the straggler message or None) for the members' mean step `times`
    and, where measured, their `own_times` (a step's time less what the member waited for the others:
    `Monitor.record_step`), in group order; `group_ranks` maps a member to its global rank
    (``cluster/slowest_rank``). Synchronous training makes every member's step as long as the slowest
    one's, so the slowest member and the straggler check go by own times (by step times without them).
    A straggler is named by its member index when the members are workers, else by its global rank."""
    own = own_times if own_times is not None else times
    slowest = max(range(len(own)), key=own.__getitem__)
    t_max = own[slowest]
    median = sorted(own)[(len(own) - 1) // 2]
    ratio = t_max / median if median > 0 else (math.inf if t_max > 0 else 1.0)
    slowest_rank = group_ranks[slowest]
    view = {
        "cluster/step_time_min_s": min(times),
        "cluster/step_time_mean_s": sum(times) / len(times),
        "cluster/step_time_max_s": max(times),
        "cluster/own_time_max_s": t_max,
        "cluster/own_time_median_s": median,
        "cluster/slowest_rank": float(slowest_rank),
        "cluster/straggler_ratio": ratio,
        "cluster/straggler": 1.0 if ratio > threshold and t_max - median >= MIN_EXCESS_S else 0.0,
    }
    if not view["cluster/straggler"]:
        return view, None
    who = slowest if member == "worker" else slowest_rank
    what = "works" if own_times is not None else "averages"
    return view, (f"straggler at step {step}: {member} {who} {what} {t_max:.4g} s per step, {ratio:.2f}x the "
                  f"median {member}'s {median:.4g} s (threshold {threshold:g}x)"
                  + ("; the others wait for it" if own_times is not None else ""))
