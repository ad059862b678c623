"""FSDP's watch over what a pass used: trainable parameters that get no gradient on any rank, and
units that not every rank ran.

* A parameter no rank used (a head used only in some steps, a pooler never used): sharded in a unit's
  flat vector, it gets a zero gradient instead of none, so an optimizer with momentum or weight decay
  still moves it. The watch names it once, in a warning.
* A unit some ranks ran and others did not (a mixture of experts routed by the data, each expert a
  unit): its all-gather on one rank met another unit's on the others, and where the two have the same
  size nothing fails: each rank computed with pieces of two different units' weights, and the
  reduce-scatters mixed their gradients. The watch compares the units each rank's forward ran and
  raises on every rank, naming them, before the optimizer steps.

The first `UNUSED_WATCH_STEPS` synchronised backward passes are watched (a hook per parameter view,
set by the forward, the units' names as they run, and one small all-reduce at the end), then one
pass in every `UNUSED_RECHECK_EVERY` (the parameters only until a warning was given).
"""

from __future__ import annotations

import warnings
import zlib

import torch
import torch.distributed as dist

from ..mesh import global_rank

__all__ = ["UNUSED_RECHECK_EVERY", "UNUSED_WATCH_STEPS", "UnusedWatch"]

#: Synchronised backward passes over which FSDP watches for parameters that get no gradient.
UNUSED_WATCH_STEPS = 2
#: After them, one pass in this many is watched again, until a warning was given.
UNUSED_RECHECK_EVERY = 1000


class UnusedWatch:
    """Which (unit, parameter) views got a gradient since the last watched synchronised backward."""

    __slots__ = ("steps_left", "used", "reported", "passes", "ran")

    def __init__(self, steps: int = UNUSED_WATCH_STEPS) -> None:
        self.steps_left, self.used, self.reported, self.passes = steps, set(), False, 0
        self.ran: list[str] = []  # the units this rank's forwards ran since the last report, in order

    def unit_ran(self, name: str) -> None:
        if self.steps_left > 0 and torch.is_grad_enabled():
            self.ran.append(name)

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
        else:
            self.passes += 1
            if self.passes % UNUSED_RECHECK_EVERY == 0:
                self.steps_left = 1  # the next pass is watched (its forward sets the hooks)

    def _report(self, units, group, device: torch.device) -> None:
        """The parameters that got no gradient on any rank of the data group (one flag each,
        all-reduced), named once in a warning."""
        self.steps_left -= 1
        trainable = [(u, i) for u in units if u.full.requires_grad for i in range(len(u.infos))]
        got = [1 if (id(u), i) in self.used else 0 for u, i in trainable]
        ran, self.ran, self.used = self.ran, [], set()
        if dist.get_world_size(group) > 1:
            on = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
            signature = zlib.crc32("\n".join(ran).encode())  # the units run, in order: max and -min over ranks
            flags = torch.tensor(got + [signature, -signature], dtype=torch.int64, device=on)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            *got, highest, lowest = flags.tolist()
            if highest != -lowest:
                _refuse_different_units(ran, group)
        if self.reported:
            return
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


def _refuse_different_units(ran: list[str], group) -> None:
    """Every rank of `group` found that they ran different units: raise there, naming them."""
    runs: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(runs, ran, group=group)
    first = next(k for k in range(len(runs[0]) + 1) if any(r[k:k + 1] != runs[0][k:k + 1] for r in runs))

    def named(r: list[str]) -> str:
        return repr(r[first] or "<root>") if first < len(r) else "no further unit"

    said = "; ".join(f"rank {global_rank(group, k)} ran {named(r)}" for k, r in enumerate(runs))
    raise RuntimeError(
        f"FSDP: the ranks ran different units in this step's forward (unit {first + 1} in order: {said}). Each "
        "unit's all-gather must meet the same unit's on every rank: these met another unit's, so the weights "
        "computed with and the gradients reduced were mixtures of two units' (nothing was stepped). A module "
        "that runs on some ranks only, such as a mixture of experts routed by the data, must sit inside one "
        "unit with what chooses it: pass FSDP / FSDPStrategy auto_wrap_policy a set holding the expert layer's "
        "class, or use DDP with find_unused_parameters=True")
