"""FSDP's watch over what a pass used: trainable parameters that get no gradient on any rank, and
units that not every rank ran.

* A parameter no rank used (a head used only in some steps, a pooler never used): sharded in a unit's
  flat vector, it gets a zero gradient instead of none, so an optimizer with momentum or weight decay
  still moves it. The watch names it once, in a warning.
* A unit some ranks ran and others did not (a mixture of experts routed by the data, each expert a
  unit): its all-gather on one rank met another unit's on the others, and where the two have the same
  size nothing fails: each rank computed with pieces of two different units' weights, and the
  reduce-scatters mixed their gradients. The watch compares the units each rank's forward gathered
  (the collectives themselves: a unit ZeRO-2 keeps gathered and calls again issues none) and raises on
  every rank, naming the first that differs, before the optimizer steps.

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

#: Gathers whose unit names a watch keeps for its message (the comparison covers all of them).
NAMES_KEPT = 64

#: Synchronised backward passes over which FSDP watches for parameters that get no gradient.
UNUSED_WATCH_STEPS = 2
#: After them, one pass in this many is watched again, until a warning was given.
UNUSED_RECHECK_EVERY = 1000


class UnusedWatch:
    """Which (unit, parameter) views got a gradient since the last watched synchronised backward."""

    __slots__ = ("steps_left", "used", "reported", "passes", "gathered", "signature", "count")

    def __init__(self, steps: int | None = None) -> None:
        self.steps_left = UNUSED_WATCH_STEPS if steps is None else steps
        self.used, self.reported, self.passes = set(), False, 0
        # The units this rank's forwards gathered since the last report: a running CRC of their names in
        # order and their count (constant memory however long nobody reports: a frozen wrapper never
        # reduces), and the first `NAMES_KEPT` names for the message.
        self.gathered: list[str] = []
        self.signature = self.count = 0

    def unit_gathered(self, name: str) -> None:
        """A unit's all-gather is issued (in a forward with grad on: a training pass)."""
        if self.steps_left > 0 and torch.is_grad_enabled():
            self.signature = zlib.crc32(name.encode() + b"\n", self.signature)
            self.count += 1
            if len(self.gathered) < NAMES_KEPT:
                self.gathered.append(name)

    @property
    def watching_parameters(self) -> bool:
        """Whether the coming forward hooks the parameter views (a watched pass, no warning given yet)."""
        return self.steps_left > 0 and not self.reported

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
        trainable = ([(u, i) for u in units if u.full.requires_grad for i in range(len(u.infos))]
                     if not self.reported else [])  # (after a warning only the units are compared)
        got = [1 if (id(u), i) in self.used else 0 for u, i in trainable]
        gathered, signature = (self.gathered, self.count), self.signature
        self.gathered, self.signature, self.count, self.used = [], 0, 0, set()
        if dist.get_world_size(group) > 1:
            on = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
            signature = (signature << 20) ^ gathered[1]  # the gathers in order, and how many: max and -min
            flags = torch.tensor(got + [signature, -signature], dtype=torch.int64, device=on)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            *got, highest, lowest = flags.tolist()
            if highest != -lowest:
                _refuse_different_units(*gathered, group)
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
                "(requires_grad=False) if they never train, or use DDP for exact skipping.", stacklevel=3)


def _refuse_different_units(gathered: list[str], count: int, group) -> None:
    """Every rank of `group` found that they gathered different units: raise there, naming them."""
    runs: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(runs, (gathered, count), group=group)
    names = [r[0] for r in runs]
    first = next((k for k in range(NAMES_KEPT) if any(n[k:k + 1] != names[0][k:k + 1] for n in names)), None)

    def named(r: list[str]) -> str:
        return repr(r[first] or "<root>") if first < len(r) else "no further unit"

    if first is None:  # the first NAMES_KEPT gathers agree: a later one or their number differs
        said = (f"the first {NAMES_KEPT} agree; then " +
                "; ".join(f"rank {global_rank(group, k)} gathered {r[1]} in all" for k, r in enumerate(runs)))
    else:
        said = f"gather {first + 1} since the last check: " + "; ".join(
            f"rank {global_rank(group, k)} gathered {named(n)}" for k, n in enumerate(names))
    raise RuntimeError(
        f"FSDP: the ranks ran different units in this step's forward passes ({said}). Each unit's all-gather "
        "must meet the same unit's on every rank: these met another unit's, so the weights computed with and "
        "the gradients reduced were mixtures of two units' (nothing was stepped). A module that runs on some "
        "ranks only, such as an expert of a mixture of experts routed by the data, must sit inside one unit "
        "with what chooses it: pass FSDP / FSDPStrategy an auto_wrap_policy holding the class of the layer "
        "that holds the router and all its experts, beside your block class (e.g. {Block, MoELayer}); or use "
        "DDP with find_unused_parameters=True")
