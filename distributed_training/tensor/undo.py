"""Taking a tensor-parallel plan back off a model: its own modules, whole, at the trainer's clean close.

`apply_plan` replaces the modules it splits by parallel layers holding this rank's parts, and hooks the
sequence-parallel regions. Given a `PlanUndo`, it records what it replaced (the model's own module objects,
whose parameters then stay on the meta device, so that no rank keeps the whole weights meanwhile) and the
hooks it added. `PlanUndo.restore` puts the modules back and gives them the full tensors (gathered over
the tensor group by the caller), a tied parameter as one parameter again: the model the user passed is
then the plain model it was, trained, as after plain data-parallel training.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .spec import _SEQUENCE

__all__ = ["PlanUndo"]


class PlanUndo:
    def __init__(self) -> None:
        self.replaced: list[tuple[str, nn.Module]] = []  # (a place in the model, the module that was there)
        self.hooks: list[Any] = []  # handles of the hooks apply_plan registered
        self._meta: dict[int, nn.Parameter] = {}  # id(original parameter) -> its meta stand-in (ties kept)

    def replace(self, model: nn.Module, place: str, original: nn.Module, new: nn.Module) -> None:
        """Put `new` at `place` of `model` instead of `original`, recorded."""
        parent, _, child = place.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        self.replaced.append((place, original))

    def free_originals(self) -> None:
        """The replaced modules' parameters to the meta device (their shapes, dtypes and flags kept; a
        parameter two of them held, one stand-in): the parallel layers hold their own parts."""
        for _, module in self.replaced:
            for name, p in list(module._parameters.items()):
                if p is not None and not p.is_meta:
                    stand_in = self._meta.get(id(p))
                    if stand_in is None:
                        stand_in = self._meta[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"),
                                                                    requires_grad=p.requires_grad)
                    module._parameters[name] = stand_in

    def restore(self, model: nn.Module, full: dict[str, torch.Tensor], device: torch.device) -> None:
        """Put the replaced modules back at their places, each parameter made from `full` (the plain model's
        state-dict keys -> full tensors; its entries are taken, not copied, and the dict emptied, so that
        the whole model is held once) on `device`; then remove the hooks. A parameter held at several
        places (a tied embedding and head) is one parameter again. Every parameter is made before the
        model changes: a missing key leaves it as it was."""
        made: dict[int, nn.Parameter] = {}
        slots = []
        for place, original in self.replaced:
            for name, stand_in in original._parameters.items():
                if stand_in is None or not stand_in.is_meta:
                    continue
                if id(stand_in) not in made:
                    key = f"{place}.{name}"
                    if key not in full:
                        raise KeyError(f"the full state has no {key!r} to give back to the model")
                    value = full[key].detach().to(device)
                    made[id(stand_in)] = nn.Parameter(value, requires_grad=stand_in.requires_grad)
                slots.append((original, name, made[id(stand_in)]))
        full.clear()
        for original, name, param in slots:
            original._parameters[name] = param
        for place, original in self.replaced:
            parent, _, child = place.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, original)
        for handle in self.hooks:
            handle.remove()
        for p in model.parameters():
            p.__dict__.pop(_SEQUENCE, None)
        self.replaced, self.hooks, self._meta = [], [], {}
