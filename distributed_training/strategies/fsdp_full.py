"""FSDP's module with its full weights outside a step: the guard on calling it directly, a block with the
weights gathered (`summon_full_params`), the weights given back for good after training (`release`), and
the warning for a state dict taken while they live in the shards. A mixin of `FSDP`, which owns the
units, the groups and the ``_summoned`` / ``_released`` flags."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..comm.sharded import all_gather_flat
from .fsdp_units import Unit

if TYPE_CHECKING:
    from .fsdp import FSDP

__all__ = ["FullWeights"]


class FullWeights:
    """`FSDP`'s methods over the module's full weights outside a step."""

    def _check_called(self) -> None:
        """The module itself was called (not through this wrapper, which gathers its root first):
        outside a step and outside `summon_full_params` its weights are freed views of their shards."""
        if (torch.compiler.is_compiling() or self._summoned
                or all(u.gathered for u in self._roots)):
            return
        raise RuntimeError(
            f"{type(self.module).__name__} was called directly, but FSDP / ZeRO-2/3 keeps only this rank's "
            "shard of its weights outside a step. Call the wrapper instead (`trainer.model(...)`, on every "
            "rank), or run the module inside `with trainer.summon_full_params():` (FSDP's "
            "`summon_full_params()`; every rank enters it), e.g. for HF's generate() or save_pretrained()")

    @contextlib.contextmanager
    def summon_full_params(self, writeback: bool = True) -> Iterator[None]:
        """The module itself holds its full weights inside this block, as parameters again (so that
        `module.parameters()`, HF's `device` / `dtype`, `generate()` and `save_pretrained()` work): the
        shards' own values (fp32 masters under mixed precision), gathered into buffers of their own,
        the whole model at once (on the CPU with ``cpu_offload``, one unit on the device at a time).
        Collective: every rank enters it. With `writeback` (the default, as torch's FSDP), what is
        written into the weights here is copied into this rank's shards when the block ends (each rank
        from its own copy: make the same change on every rank); without it, it is lost. Not the optimizer's
        state. The wrapper cannot run inside it; the module can. After `release` the module holds its
        weights itself: nothing to do."""
        if self._released:
            yield
            return
        if self._summoned:
            raise RuntimeError("summon_full_params() is already open")
        if self._backward_state.pending:
            self._finish_backward()
        self._summoned, restore, flats = True, [], []
        try:
            with torch.no_grad():
                for unit in self._units:
                    restore.extend(self._register_full(unit, flats=flats))
            yield
            if writeback:  # (not after an error in the block: the shards stay as they were)
                with torch.no_grad():
                    for unit, flat in flats:
                        size = unit.shard.numel()
                        unit.shard.copy_(flat[self.shard_rank * size:(self.shard_rank + 1) * size])
        finally:
            # A flag changed here goes with the gathered parameters: the next training forward says so
            # (a loop over `named_parameters()` in this block froze nothing, silently; a trial).
            self._requires_grad_lock.note_summoned(self.module.named_parameters())
            for mod, attr, old in restore:
                del mod._parameters[attr]
                setattr(mod, attr, old)
            self._summoned = False

    def release(self) -> bool:
        """After training (the trainer's clean `close`): the module holds its full weights again, as
        parameters of its own (the shards' values), and FSDP's hooks are removed, so that
        ``model.state_dict()``, ``save_pretrained()`` or a plain forward work on the model object the user
        built (without this, its parameters stay freed views of shards that go away with the trainer).
        Collective: every rank calls it, and holds the whole model after it. The wrapper cannot run after
        it. Not done (False, every rank alike) with ``cpu_offload`` or where the whole model does not fit
        in the free memory of some rank's GPU beside what the trainer still holds: a model sharded
        because it is too large for one GPU must not fail its job at the end."""
        if self._released:
            return True
        if self._summoned:
            raise RuntimeError("release() inside summon_full_params()")
        fits = not self.cpu_offload
        if fits and self.device.type == "cuda":
            need = sum(u.numel * u.shard.element_size() for u in self._units)
            free = torch.cuda.mem_get_info(self.device)[0] + (torch.cuda.memory_reserved(self.device)
                                                               - torch.cuda.memory_allocated(self.device))
            fits = need < 0.8 * free
        if dist.get_world_size(self.process_group) > 1:  # every rank alike
            device = self.device if dist.get_backend(self.process_group) == "nccl" else torch.device("cpu")
            flag = torch.tensor([int(fits)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.process_group)
            fits = bool(flag.item())
        if not fits:
            return False
        if self._backward_state.pending:
            self._finish_backward()
        with torch.no_grad():
            for unit in self._units:
                self._register_full(unit, own_storage=True)
        self._outside_hook.remove()
        self._state_hook.remove()
        self._requires_grad_lock.undo()
        for unit in self._units:
            for hook in unit.hooks:
                hook.remove()
            unit.hooks.clear()
        self._released = True
        return True

    def _register_full(self, unit: Unit, own_storage: bool = False,
                       flats: list | None = None) -> list[tuple[nn.Module, str, Any]]:
        """Gather the unit's shards into a new flat buffer and register its pieces as the modules'
        parameters (one per parameter, shared where the model ties it; each with a storage of its own if
        `own_storage`: what a saved bias or safetensors expects). Returns what they replaced."""
        shard = unit.shard.detach().to(self.device)
        flat = torch.empty(unit.padded, dtype=shard.dtype, device=self.device)
        if unit.padded:
            all_gather_flat(flat, shard, self.shard_group, async_op=False).wait()
        if self.cpu_offload:  # a model offloaded for want of device memory: one unit on the device at a time
            flat = flat.cpu()
        if flats is not None and unit.padded:
            flats.append((unit, flat))
        pieces = torch.split(flat[:unit.numel], [info.numel for info in unit.infos]) if unit.infos else []
        made: dict[int, nn.Parameter] = {}
        replaced, seen = [], set()
        for mod, attr, i in unit.refs:
            if (id(mod), attr) in seen:  # one module reached by two paths
                continue
            seen.add((id(mod), attr))
            if i not in made:
                piece = pieces[i].view(unit.infos[i].shape)
                made[i] = nn.Parameter(piece.clone() if own_storage else piece, requires_grad=unit.shard.requires_grad)
            replaced.append((mod, attr, mod.__dict__.pop(attr, None)))
            mod.register_parameter(attr, made[i])
        return replaced


class _RootGuard:
    """The root module's forward pre-hook: `FSDP._check_called` for that module only (a copy made in
    `summon_full_params` shares the hook and holds real parameters), and never replacing the inputs."""

    def __init__(self, fsdp: "FSDP") -> None:
        self._fsdp = weakref.ref(fsdp)

    def __call__(self, module: nn.Module, args) -> None:
        fsdp = self._fsdp()
        if fsdp is not None and module is fsdp.module:
            fsdp._check_called()

    # A copy or a pickle of the module (`copy.deepcopy`, `torch.save` inside `summon_full_params`) holds
    # its weights itself: its guard guards nothing.
    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._fsdp = lambda: None


class _EmptyStateWarning:
    """The root module's state-dict hook: ``model.state_dict()`` between steps holds none of the
    parameters (they live in the shards), which the user is told once rather than saving an empty
    model without a word."""

    def __init__(self, fsdp: "FSDP") -> None:
        self._fsdp, self._said = weakref.ref(fsdp), False

    def __call__(self, module: nn.Module, state: dict, prefix: str, local_metadata) -> None:
        fsdp = self._fsdp()
        if fsdp is None or module is not fsdp.module or fsdp._summoned or fsdp._released or self._said:
            return
        if any(info.fqns[0] in state for unit in fsdp._units for info in unit.infos[:1]):
            return
        self._said = True
        warnings.warn(f"{type(module).__name__}.state_dict() under FSDP / ZeRO-2/3 holds none of the model's "
                      "parameters between steps: they live in each rank's shards. Take full_state_dict() (the "
                      "trainer's, or in a loop of your own the FSDP wrapper's; rank 0: the whole model; every "
                      "rank calls it), save_checkpoint(), or the state inside summon_full_params(); a clean "
                      "close() gives the model its weights back", stacklevel=3)

    def __getstate__(self) -> dict:  # (a copy of the module holds its weights itself)
        return {}

    def __setstate__(self, state: dict) -> None:
        self._fsdp, self._said = (lambda: None), True
