"""Models built on the meta device: storage for the layers a rank runs, and their initial weights.

A model too large for one device is built with shapes only (``with torch.device("meta"): model =
GPT(cfg)``) and handed to the trainer. With ``pipeline_parallel_size > 1`` each rank gives storage to
its own stages' layers only, on its device, and initialises them there (`materialize` with `layers`);
the rest of the model object stays meta, so no rank ever holds the whole model, on the device or in
host memory. Without a pipeline the trainer materialises the whole model the same way (each rank then
holds all of it, as with a model built on a real device).

How the weights are drawn, so that they do not depend on the cut, the rank or the process count:

* our `GPT`: `GPTStages`' scheme (`init_gpt_layers`): each chain layer (``embed``, ``block.i``,
  ``head``) from a generator on the device seeded with ``layer_seed(seed, name)``, the tied token
  embedding from its own. The weights equal ``GPTStages(cfg, seed).model(device)``'s (the same device
  type: CPU and CUDA generators differ), whatever the pipeline; not those of ``torch.manual_seed(k);
  GPT(cfg)`` on a real device (one stream for everything).
* any other module: each submodule that has a ``reset_parameters()`` method (every torch layer with
  parameters: Linear, Conv, Embedding, LayerNorm, BatchNorm's statistics, ...; or
  ``_reset_parameters()``, as `nn.MultiheadAttention` names it) calls it, children
  before their parent (the order in which construction on a real device initialises them, so a
  parent's own rule wins, as in `nn.MultiheadAttention`), with the global RNG (the CPU's generator
  and the target GPU's) seeded with ``layer_seed(seed, its name in the model)`` and restored
  afterwards. The result is the
  module's own initialisation, drawn from a per-module stream: equal on every rank and for every cut,
  but not the values of constructing the model on a real device after ``torch.manual_seed``. A
  parameter shared by several modules takes the value of its first owner (in chain order, children
  first); a later owner's `reset_parameters` does not overwrite it (in the pipeline, the copies on
  later stages receive it from the first stage holding one: `PipelineStrategy` broadcasts it).
* a meta parameter or buffer whose module (or an enclosing module of its layer) has no
  ``reset_parameters``: an error naming it, on every rank alike, before anything is allocated.

`materialize(model, device, seed=...)` is also the single-process reference for a pipeline's meta
model: the same module built again on the meta device and materialised whole has the weights the
stages have.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch
from torch import nn

from ..models.gpt import GPT
from .gpt_stages import gpt_chain, init_gpt_layers, layer_seed
from .stages import Layers, allocate

__all__ = ["has_meta", "check_initialisable", "materialize"]


def has_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` is on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _tensor_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), name)
    return names


def check_initialisable(model: nn.Module, layers: Layers | None = None) -> None:
    """Raise if a meta parameter or buffer of `model` (or of the chain `layers`, whose layers hold
    the model's modules) would stay uninitialised after `materialize`: the message names the first
    few by their names in the model and says how to fix it. Cheap, allocates nothing; every rank holds
    the whole (meta) model, so every rank raises alike."""
    if isinstance(model, GPT):
        rules = (nn.Linear, nn.Embedding, nn.LayerNorm)
        bad = [name for mname, m in model.named_modules() for pname, t in
               (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False))
               if t.is_meta and not (isinstance(m, rules) and pname in ("weight", "bias") and
                                     isinstance(t, nn.Parameter))
               for name in [f"{mname}.{pname}" if mname else pname]]
        if bad:
            raise ValueError(f"GPT built on the meta device: {_listed(bad)} follow no rule of the GPT's initialisation "
                             "(Linear, Embedding and LayerNorm parameters); build the model on a real device instead")
        return
    names = _tensor_names(model)
    bad = []
    tops = [module for _, module in layers] if layers is not None else [model]
    for top in tops:
        for module, covered in _walk(top, False):
            for t in (*module._parameters.values(), *module._buffers.values()):
                if t is not None and t.is_meta and not covered:
                    bad.append((names.get(id(t), "?"), type(module).__name__))
    if bad:
        shown = ", ".join(f"'{n}' ({kind})" for n, kind in bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise ValueError(
            f"the model is on the meta device, and {shown} would stay uninitialised: its module has no "
            "reset_parameters() method (nor does an enclosing module of its layer). Give that module a "
            "reset_parameters() that fills its parameters and buffers, or build the model on a real device.")


def _listed(names: list[str]) -> str:
    return ", ".join(f"'{n}'" for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _walk(module: nn.Module, covered: bool, seen: set[int] | None = None) -> Iterator[tuple[nn.Module, bool]]:
    """Each submodule once (pre-order) with whether it or an enclosing module has reset_parameters."""
    seen = set() if seen is None else seen
    if id(module) in seen:
        return
    seen.add(id(module))
    covered = covered or _reset_method(module) is not None
    yield module, covered
    for child in module._modules.values():
        if child is not None:
            yield from _walk(child, covered, seen)


def _reset_method(module: nn.Module):
    """The module's ``reset_parameters``, or ``_reset_parameters`` (what `nn.MultiheadAttention` and
    `nn.Transformer` call theirs), or None."""
    for name in ("reset_parameters", "_reset_parameters"):
        method = getattr(module, name, None)
        if callable(method):
            return method
    return None


def _children_first(module: nn.Module, seen: set[int]) -> Iterator[nn.Module]:
    if id(module) in seen:
        return
    seen.add(id(module))
    for child in module._modules.values():
        if child is not None:
            yield from _children_first(child, seen)
    yield module


def materialize(model: nn.Module, device: torch.device | str, *, seed: int = 0,
                layers: Sequence[tuple[str, nn.Module]] | None = None) -> None:
    """Give the meta parameters and buffers of `model` storage on `device` and initialise them (see
    the module docstring for the rules), in place: the model object holds the new tensors.

    Args:
        model: the model, built (wholly or partly) on the meta device; real tensors are left as they
            are (not moved).
        device: where the storage goes.
        seed: the base seed of the per-layer (GPT) or per-module (others) streams.
        layers: only these layers of the model's chain (``(name, module)`` pairs, e.g. one rank's
            stages); their meta tensors get storage, the rest of the model stays meta. Default: the
            whole model (for a `GPT`, its chain).

    Raises:
        ValueError: a meta tensor would stay uninitialised (`check_initialisable`), before anything
            is allocated.
    """
    device = torch.device(device)
    gpt = isinstance(model, GPT)
    if layers is None:
        layers = gpt_chain(model) if gpt else [("", model)]
    layers = list(layers)
    check_initialisable(model, layers)
    allocate([module for _, module in layers], device)
    if gpt:
        init_gpt_layers(layers, model.cfg.n_layer, seed, model.cfg)  # cfg: a half block's draws
        return
    # The module's name in the model seeds its stream; a module the model does not register (one an
    # adapter made) goes by its path in the chain.
    names: dict[int, str] = {}
    for name, m in model.named_modules():
        names.setdefault(id(m), name)
    for lname, layer in layers:
        for path, m in layer.named_modules():
            names.setdefault(id(m), f"{lname}.{path}" if path and lname else path or lname)
    done: set[int] = set()  # tensors initialised already (a tied weight's first owner)
    seen: set[int] = set()
    cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
    with torch.no_grad():
        for _, layer in layers:
            for module in _children_first(layer, seen):
                own = [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
                reset = _reset_method(module)
                if reset is not None:
                    kept = [(t, t.detach().clone()) for t in own if id(t) in done]
                    # The CPU's generator and the device's, seeded and restored (not every GPU's:
                    # reading another GPU's state would create a context there).
                    with torch.random.fork_rng(devices=[index] if cuda else []):
                        module_seed = layer_seed(seed, names[id(module)])
                        torch.default_generator.manual_seed(module_seed)
                        if cuda:
                            torch.cuda.default_generators[index].manual_seed(module_seed)
                        reset()
                    for t, value in kept:
                        t.copy_(value)
                    done.update(id(t) for t in own)
