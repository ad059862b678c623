"""Which parameters train is fixed when a wrapper is built; a change afterwards is an error.

`DDP` buckets, and `FSDP` shards, the parameters that require gradients at construction: a parameter
unfrozen later (``requires_grad_(True)`` between epochs, a common fine-tuning step) would train on
each rank without being averaged, and so leave the replicas apart, or, under sharding, not train at all;
one frozen later would look unused. torch's DDP lets both pass silently. The wrappers check the flags
before each forward (a loop over the parameters, microseconds) and name the first that changed.

The parameters are held by weak reference: `FSDP` replaces a module's parameters with views of its flat
units, and a strong reference here kept every original alive (a whole fp32 copy of the model per rank,
4.9 GiB at 1.3B). An original that nothing else holds can no longer be flipped, so it drops out of the check.
So under `FSDP` (ZeRO-2/3) the check covers what the user still holds: ``model.encoder.requires_grad_(True)``
on the wrapped module reaches no parameter at all (the module holds views, not parameters) and changes
nothing, which no check can see. Set the flags before wrapping.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch import nn

__all__ = ["TrainableSet"]


class TrainableSet:
    """The `requires_grad` flags of `named` parameters when `wrapper` (its name, for messages) was built."""

    def __init__(self, named: Iterable[tuple[str, nn.Parameter]], wrapper: str, module: nn.Module | None = None) -> None:
        named = list(named)
        self._named = [(name, weakref.ref(p), p.requires_grad) for name, p in named]
        self._wrapper = wrapper
        # A parameter registered on `module` after wrapping (a head swapped for fine-tuning) is one the
        # wrapper never averages, shards or hands to the optimizer: looked for at the first checks, then
        # every `NEW_EVERY`-th (a walk over the modules, too slow for every forward of a large model).
        self._module = weakref.ref(module) if module is not None else None
        # id -> weak reference: an id alone is no proof (FSDP frees the originals, and ids get reused)
        self._known = {id(p): weakref.ref(p) for _, p in named}
        self._checks = 0

    NEW_EVERY = 100

    def check(self) -> None:
        """Raise RuntimeError naming the first parameter whose `requires_grad` changed since construction,
        or (at the first checks and every `NEW_EVERY`-th) one registered on the module since."""
        if torch.is_grad_enabled():  # training forwards only: every rank runs as many (not a rank's own sampling)
            self._checks += 1
            if self._module is not None and (self._checks <= 2 or self._checks % self.NEW_EVERY == 0):
                self._check_new()
        for name, ref, flag in self._named:
            p = ref()
            if p is not None and p.requires_grad != flag:
                change = "made trainable (requires_grad=True)" if p.requires_grad else "frozen (requires_grad=False)"
                raise RuntimeError(
                    f"parameter {name!r} was {change} after {self._wrapper} wrapped the model: {self._wrapper} "
                    "decides when it is built which parameters it averages across ranks (and shards), so the change "
                    "would leave the ranks or the optimizer out of step. Set requires_grad before wrapping: to "
                    f"change it mid-training, save a checkpoint, build the model, {self._wrapper} (or the "
                    "DistributedTrainer) and the optimizer again with the new flags, and load the model's weights")

    def _check_new(self) -> None:
        module = self._module()
        if module is None:
            return
        for name, p in module.named_parameters():
            known = self._known.get(id(p))
            if known is None or known() is not p:
                raise RuntimeError(
                    f"parameter {name!r} was registered on the model after {self._wrapper} wrapped it: "
                    f"{self._wrapper} never averages (or shards) it across ranks, and an optimizer built before "
                    "never updates it. Add every parameter (a new head, an adapter) before wrapping the model, "
                    "or build the DistributedTrainer (and the optimizer) again after the change")
