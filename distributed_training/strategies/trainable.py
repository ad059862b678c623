"""Which parameters train is fixed when a wrapper is built; a change afterwards is an error (but for every
parameter of a `DDP` frozen for a pass, and `FSDP`'s shards, which a frozen flag leaves without a gradient:
a GAN's discriminator frozen during the generator's step).

`DDP` buckets, and `FSDP` shards, the parameters that require gradients at construction: a parameter
unfrozen later (``requires_grad_(True)`` between epochs, a common fine-tuning step) would train on
each rank without being averaged, and so leave the replicas apart, or, under sharding, not train at all;
one frozen later would look unused. torch's DDP lets both pass silently. The wrappers check the flags
before each forward (a loop over the parameters, microseconds) and name the first that changed.

The parameters are held by weak reference: `FSDP` replaces a module's parameters with views of its flat
units, and a strong reference here kept every original alive (a whole fp32 copy of the model per rank,
4.9 GiB at 1.3B). An original that nothing else holds can no longer be flipped, so it drops out of the check.
So under `FSDP` (ZeRO-2/3) the check covers what the user still holds. ``model.encoder.requires_grad_(True)``
on the wrapped module would reach no parameter at all (the module holds views, not parameters) and change
nothing, silently: `lock_requires_grad` records the flags such calls ask for, and the next training forward
raises while one differs (a call on a module holding parameters again is torch's), as it does for a flag
set on a parameter inside ``summon_full_params`` (the module holds parameters there, and the flag went
away with them at the block's end), and for ``requires_grad_`` on a view read off the module after a pass
(``model.fc.weight``: torch's raised on one built with gradients on, and flipped a throwaway otherwise). The
model's ``parameters()`` are empty outside that block, so a loop over them freezes nothing, and cannot be
seen, nor can ``view.requires_grad = False`` (an attribute, not a call). Set the flags before wrapping.
"""

from __future__ import annotations

import types
import weakref
from typing import Iterable

import torch
from torch import nn

__all__ = ["TrainableSet", "lock_requires_grad"]


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
        """At a training forward (gradients on), raise RuntimeError naming the first parameter whose
        `requires_grad` changed since construction, or (at the first checks and every `NEW_EVERY`-th) one
        registered on the module since. A forward that trains nothing (``torch.no_grad()``: a reference
        pass with adapters switched off, inference) may run with flags flipped."""
        if not torch.is_grad_enabled():
            return
        self._checks += 1  # (training forwards only: every rank runs as many, not a rank's own sampling)
        if self._module is not None and (self._checks <= 2 or self._checks % self.NEW_EVERY == 0):
            self._check_new()
        for name, ref, flag in self._named:
            p = ref()
            if p is not None and p.requires_grad != flag:
                change = "made trainable (requires_grad=True)" if p.requires_grad else "frozen (requires_grad=False)"
                raise RuntimeError(
                    f"parameter {name!r} was {change} after {self._wrapper} wrapped the model: {self._wrapper} "
                    "decides when it is built which parameters it averages across ranks (and shards), so the change "
                    f"would leave the ranks or the optimizer out of step. {_rebuild_advice(self._wrapper)}")

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


def requires_grad_(self: nn.Module, requires_grad: bool = True) -> nn.Module:
    """A wrapped module's ``requires_grad_`` (bound to it by `lock_requires_grad`; named as the method it
    stands for, so that a pickled or copied module gets torch's back). Where the module holds parameters of
    its own (inside ``summon_full_params``, a copy made there) it is torch's; where its parameters are views
    of a wrapper's shards, the flags asked for are recorded (`RequiresGradLock`): a training forward with
    one that differs from the wrapped flags raises, since the call itself would reach nothing."""
    if next(self.parameters(), None) is not None:
        return nn.Module.requires_grad_(self, requires_grad)
    lock, name, names = self.__dict__["_requires_grad_lock"]
    lock.request(name, names, bool(requires_grad))
    return self


class _ViewRequiresGrad:
    """A parameter view's ``requires_grad_`` (`RequiresGradLock.watch_view`). Holds the view weakly: the view's
    own ``__dict__`` holds this, and a cycle would keep every forward's views for the garbage collector."""

    __slots__ = ("lock", "names", "view")

    def __init__(self, lock: "RequiresGradLock", names: list[str], view: weakref.ref) -> None:
        self.lock, self.names, self.view = lock, names, view

    def __call__(self, requires_grad: bool = True) -> torch.Tensor | None:
        self.lock.request(self.names[0], self.names, bool(requires_grad))
        return self.view()

    def forget(self) -> None:
        """The view without this recorder (before torch pickles or copies it: the view has torch's
        ``requires_grad_`` from then on, as a copy does), then torch's own clearing."""
        view = self.view()
        if view is not None:
            view.__dict__.pop("requires_grad_", None)
            view.__dict__.pop("_clear_non_serializable_cached_data", None)
            torch.Tensor._clear_non_serializable_cached_data(view)


def _rebuild_advice(wrapper: str) -> str:
    if wrapper == "FSDP":  # (a sharded optimizer state cannot follow a change of which parameters train)
        return ("Set requires_grad before wrapping. To change it mid-training, build the model again with the new "
                "flags, load trainer.full_state_dict() into it, and build the DistributedTrainer and a fresh "
                "optimizer. For a pass that trains nothing (a reference or inference pass), run it under "
                "torch.no_grad(); after training, trainer.close() gives the module its own parameters back")
    return (f"Set requires_grad before wrapping: to change it mid-training, save a checkpoint, build the model, "
            f"{wrapper} (or the DistributedTrainer) and the optimizer again with the new flags, and load the "
            "model's weights")


class RequiresGradLock:
    """The flags asked for by ``requires_grad_`` on the modules of a model whose parameters a wrapper
    replaced by views of its shards (`lock_requires_grad`). The calls themselves pass, and reach nothing:
    a pass that trains nothing may flip flags and back (PEFT's ``disable_adapter()`` around a reference
    forward under ``torch.no_grad()``). `check`, at each training forward, raises while a flag asked for
    differs from the one the wrapper was built with: the parameter would go on training, or stay frozen."""

    def __init__(self, module: nn.Module, wrapper: str) -> None:
        self.wrapper = wrapper
        self.flags = {name: p.requires_grad for name, p in module.named_parameters()}
        self.asked: dict[str, tuple[str, bool]] = {}  # parameter -> (the module called, the flag), where they differ
        fqn = {id(p): name for name, p in module.named_parameters()}
        self.locked = []
        for name, m in module.named_modules():
            names = list(dict.fromkeys(fqn[id(p)] for p in m.parameters()))
            if names:
                m.__dict__["_requires_grad_lock"] = (self, name, names)
                m.__dict__["requires_grad_"] = types.MethodType(requires_grad_, m)
                self.locked.append(m)

    def __getstate__(self) -> dict:
        # (A module pickled or copied inside ``summon_full_params`` holds this lock: not its modules, which a
        # pickle would reach half-built.)
        return {**self.__dict__, "locked": []}

    def request(self, module: str, names: list[str], flag: bool) -> None:
        for name in names:
            if self.flags[name] == flag:
                self.asked.pop(name, None)
            else:
                self.asked[name] = (module, flag)

    def watch_view(self, view: torch.Tensor, names: list[str]) -> None:
        """Make ``view.requires_grad_`` (a parameter's view, left on its module as the attribute the user
        reads: ``model.fc.weight``) record its flag as asked for, as the module's does: torch's would raise
        on a view built with gradients on, and set a flag nothing reads on one built under ``no_grad``."""
        names = [n for n in names if n in self.flags]  # (a tie's other names are not the model's parameters)
        if names:
            recorder = _ViewRequiresGrad(self, names, weakref.ref(view))
            view.requires_grad_ = recorder
            # torch calls this before pickling or deep-copying a tensor: the copy is a tensor of its own, with
            # torch's requires_grad_ (a weak reference cannot be pickled; a copied recorder reached the original)
            view._clear_non_serializable_cached_data = recorder.forget

    def note_summoned(self, named: Iterable[tuple[str, nn.Parameter]]) -> None:
        """At the end of ``summon_full_params``: the flags of the parameters the module held there, where
        they differ from the wrapped ones, as if asked for (the flags go with those parameters)."""
        for name, p in named:
            if name not in self.flags:
                continue
            if p.requires_grad != self.flags[name]:
                self.asked[name] = (None, p.requires_grad)
            elif name in self.asked and self.asked[name][0] is None:  # set in an earlier block, restored in this
                del self.asked[name]

    def check(self) -> None:
        if not self.asked:
            return
        name, (module, flag) = next(iter(self.asked.items()))
        more = f" (and {len(self.asked) - 1} more)" if len(self.asked) > 1 else ""
        if module is None:  # (set inside summon_full_params)
            raise RuntimeError(
                f"parameter {name!r}{more} was set to requires_grad={flag} inside summon_full_params() after "
                f"{self.wrapper} wrapped the model, and a training forward (gradients on) followed: the flag went "
                f"away with the gathered parameters at the block's end, so the parameter would go on training (or "
                f"stay frozen). {_rebuild_advice(self.wrapper)}")
        raise RuntimeError(
            f"{module or 'model'}.requires_grad_({flag}) was called after {self.wrapper} wrapped the model, and "
            f"a training forward (gradients on) followed: parameter {name!r}{more} is now "
            f"a view of {self.wrapper}'s flat shards, which the call cannot reach, so it would go on training (or stay "
            f"frozen). {_rebuild_advice(self.wrapper)}")

    def undo(self) -> None:
        """Give the modules torch's ``requires_grad_`` back (they hold parameters of their own again)."""
        for m in self.locked:
            m.__dict__.pop("requires_grad_", None)
            m.__dict__.pop("_requires_grad_lock", None)
        self.locked, self.asked = [], {}


def lock_requires_grad(module: nn.Module, wrapper: str) -> RequiresGradLock:
    """Record instead of apply ``requires_grad_`` on every submodule of `module` that holds parameters,
    for a wrapper about to replace them by views (`RequiresGradLock`: its `check` raises at a training
    forward while a flag asked for differs; `undo` once the module holds parameters again)."""
    return RequiresGradLock(module, wrapper)
