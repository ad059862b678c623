"""FSDP's watch for trainable parameters that get no gradient on any rank (a head used only in some
steps, a pooler never used). Sharded in a unit's flat vector, such a parameter gets a zero gradient
instead of none, so an optimizer with momentum or weight decay still moves it: the watch names it once.

The first `UNUSED_WATCH_STEPS` synchronised backward passes are watched (a hook per parameter view,
set by the forward, and one small all-reduce of flags at the end), then one pass in every
`UNUSED_RECHECK_EVERY`, until a warning was given.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

__all__ = ["UNUSED_RECHECK_EVERY", "UNUSED_WATCH_STEPS", "UnusedWatch"]

#: Synchronised backward passes over which FSDP watches for parameters that get no gradient.
UNUSED_WATCH_STEPS = 2
#: After them, one pass in this many is watched again, until a warning was given.
UNUSED_RECHECK_EVERY = 1000


class UnusedWatch:
    """Which (unit, parameter) views got a gradient since the last watched synchronised backward."""

    __slots__ = ("steps_left", "used", "reported", "passes")

    def __init__(self, steps: int = UNUSED_WATCH_STEPS) -> None:
        self.steps_left, self.used, self.reported, self.passes = steps, set(), False, 0

    def marker(self, unit, index: int):
        key = (id(unit), index)

        def mark(grad):
            self.used.add(key)  # `self.used` is replaced after each report: looked up, not closed over
        return mark

    def after_backward(self, units, group, device: torch.device) -> None:
        """The end of a synchronised backward (every rank of `group` alike): report if it was watched,
        else count it towards the next watched one."""
        if self.steps_left > 0:
            self._report(units, group, device)
        elif not self.reported:
            self.passes += 1
            if self.passes % UNUSED_RECHECK_EVERY == 0:
                self.steps_left = 1  # the next pass is watched (its forward sets the hooks)

    def _report(self, units, group, device: torch.device) -> None:
        """The parameters that got no gradient on any rank of the data group (one flag each,
        all-reduced), named once in a warning."""
        self.steps_left -= 1
        trainable = [(u, i) for u in units if u.full.requires_grad for i in range(len(u.infos))]
        got = [1 if (id(u), i) in self.used else 0 for u, i in trainable]
        self.used = set()
        if dist.get_world_size(group) > 1:
            on = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
            flags = torch.tensor(got, dtype=torch.int32, device=on)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            got = flags.tolist()
        unused = [u.infos[i].fqns[0] for (u, i), g in zip(trainable, got) if not g]
        said, self.reported = self.reported, self.reported or bool(unused)  # (every rank alike: no more watching)
        if unused and not said and dist.get_rank(group) == 0:
            shown = ", ".join(repr(n) for n in unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
            warnings.warn(
                f"FSDP: {len(unused)} trainable parameter(s) got no gradient on any rank in this backward pass: "
                f"{shown}. Sharded in a unit's flat vector, they get a zero gradient instead of none (as in "
                "DeepSpeed's ZeRO and torch's flat-parameter FSDP), so an optimizer with momentum or weight decay "
                "still moves them, where one process or DDP would leave them alone. Freeze them "
                "(requires_grad=False) if they never train, or use DDP for exact skipping.", stacklevel=2)
