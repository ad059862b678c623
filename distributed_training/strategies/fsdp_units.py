"""FSDP's units: which parameters each unit owns (the innermost unit holding every use of one), and
the flat, padded, sharded vector each unit keeps them in (see `fsdp.py` for how units are used)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..comm.sharded import shard_size

__all__ = ["FROZEN_SUFFIX", "ParamInfo", "Unit", "UnitPlacement", "alloc_storage", "build_units", "free_storage",
           "unit_roots"]


#: Name of the part of a unit that holds its frozen parameters, when the unit also has trainable ones.
FROZEN_SUFFIX = "#frozen"


@dataclass
class ParamInfo:
    fqns: list[str]  # every state-dict key that names this parameter (tied weights have several)
    shape: torch.Size
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Unit:
    name: str
    module: nn.Module
    infos: list[ParamInfo]
    refs: list[tuple[nn.Module, str, int]]  # (module, attribute, index into infos)
    numel: int
    padded: int
    shard: nn.Parameter
    full_data: torch.Tensor  # the gathered flat parameters; storage freed while resharded
    full: torch.Tensor  # a leaf aliasing full_data's storage: autograd's handle on the whole unit
    is_root: bool
    gathered: bool = False
    gather_work: Any = None
    gather_src: torch.Tensor | None = None  # the all-gather's input (a cast copy of the shard), alive until waited for
    #: the shard's version counter when its gather started: an in-place change since (an optimizer step, a
    #: load) makes the gathered weights stale (`FSDP._drop_stale`)
    gathered_version: int = -1
    hooks: list = field(default_factory=list)
    #: under `no_sync` with gradients reduced in a wider dtype than the gathered parameters' (bf16 weights,
    #: fp32 reduction): the accumulated full gradient, kept in the reduce dtype (autograd's adds would round
    #: each micro-batch's sum to the narrow one)
    held_grad: torch.Tensor | None = None


def free_storage(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    if storage.size() > 0:
        storage.resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    nbytes = t.numel() * t.element_size()
    if storage.size() < nbytes:
        storage.resize_(nbytes)


def repeated_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The default policy's units: each element with parameters of an `nn.ModuleList` whose class
    repeats in that list (transformer blocks), and each child of an `nn.Sequential` whose class
    repeats there and that is made of modules itself (timm's ViT blocks and ResNet bottlenecks sit in
    Sequentials; a Sequential of bare layers, an MLP, stays whole)."""
    found = []
    for path, mod in module.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(mod.named_children())
        classes = [type(c) for _, c in children]
        for name, child in children:
            if classes.count(type(child)) < 2 or not any(True for _ in child.parameters()):
                continue
            if isinstance(mod, nn.Sequential) and not any(True for _ in child.children()):
                continue
            found.append((f"{path}.{name}" if path else name, child))
    return found


def unit_roots(module: nn.Module, policy: Any) -> list[str]:
    """Module paths that become units, parents before children; "" (the root) first."""
    named = list(module.named_modules())
    chosen: list[str] = []
    if policy is None:
        chosen = [path for path, _ in repeated_blocks(module)]
    elif isinstance(policy, int) and not isinstance(policy, bool):
        if policy < 1:
            raise ValueError(f"auto_wrap_policy as a parameter count must be >= 1, got {policy}")
        chosen = _size_based(module, policy)
    elif isinstance(policy, (set, frozenset, tuple, list)):
        classes = tuple(policy)
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError("auto_wrap_policy as a collection must hold nn.Module classes")
        chosen = [path for path, mod in named if path and isinstance(mod, classes)]
    elif callable(policy):
        chosen = [path for path, mod in named if path and policy(mod, path)]
    else:
        raise TypeError(f"auto_wrap_policy must be None, an int, module classes or a callable, got {type(policy).__name__}")
    order = {path: i for i, (path, _) in enumerate(named)}
    return [""] + sorted(set(chosen), key=order.__getitem__)


def _size_based(module: nn.Module, min_params: int) -> list[str]:
    chosen: list[str] = []

    def visit(mod: nn.Module, path: str) -> int:
        remaining = sum(p.numel() for p in mod.parameters(recurse=False))
        for name, child in mod.named_children():
            remaining += visit(child, f"{path}.{name}" if path else name)
        if path and remaining >= min_params:
            chosen.append(path)
            return 0
        return remaining

    visit(module, "")
    return chosen


@dataclass(frozen=True)
class UnitPlacement:
    """Where a unit's shard and gathered vector live: the shard group, this rank in it, the device,
    CPU offload of the shard, and the dtype parameters are gathered in (None: their own)."""

    shard_world: int
    shard_rank: int
    device: torch.device
    cpu_offload: bool
    param_dtype: torch.dtype | None


def build_units(root: nn.Module, roots: list[str], place: "UnitPlacement") -> list[Unit]:
    """The units of `root` (one per path in `roots`, the root "" last or first as given), each a
    sharded flat vector of the parameters it owns; the modules' attributes are emptied."""
    # Every place a parameter is referenced: (module path, module, attribute).
    refs: dict[int, list[tuple[str, nn.Module, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for path, mod in root.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            if (path, attr) not in [(q, a) for q, _, a in refs.get(id(p), [])]:
                refs.setdefault(id(p), []).append((path, mod, attr))
            params[id(p)] = p

    def inside(path: str, unit_path: str) -> bool:
        return unit_path == "" or path == unit_path or path.startswith(unit_path + ".")

    # The owner of a parameter is the deepest unit whose subtree holds every use of it.
    owned: dict[str, list[int]] = {r: [] for r in roots}
    for pid, uses in refs.items():
        candidates = [r for r in roots if all(inside(path, r) for path, _, _ in uses)]
        owned[max(candidates, key=lambda r: (r != "", r.count(".") + 1 if r else 0))].append(pid)

    modules = dict(root.named_modules(remove_duplicate=False))
    units = []
    for unit_path in roots:
        pids = owned[unit_path]
        if not pids and unit_path != "":
            continue
        dtypes = {params[pid].dtype for pid in pids}
        if len(dtypes) > 1:
            names = [f"{refs[pid][0][0]}.{refs[pid][0][2]}".lstrip(".") + f" ({params[pid].dtype})" for pid in pids]
            raise ValueError(
                f"FSDP unit '{unit_path or '<root>'}' mixes parameter dtypes: {', '.join(names)}; "
                "give those modules their own unit (auto_wrap_policy) or one dtype"
            )
        # Frozen parameters of a unit that also trains get a flat vector (and shard) of their own,
        # gathered beside the trainable one: they never receive a gradient, never enter a
        # reduce-scatter, and an optimizer never sees them move (no weight decay, no momentum).
        trainable = [pid for pid in pids if params[pid].requires_grad]
        frozen = [pid for pid in pids if not params[pid].requires_grad]
        if trainable and frozen:
            parts = [(unit_path, trainable), (unit_path + FROZEN_SUFFIX, frozen)]
        else:
            parts = [(unit_path, pids)]
        for name, part in parts:
            units.append(_build_unit(name, unit_path, modules[unit_path], part, params, refs, place))
    return units

def _build_unit(name: str, unit_path: str, module: nn.Module, pids: list[int], params: dict[int, nn.Parameter],
                refs: dict[int, list[tuple[str, nn.Module, str]]], place: "UnitPlacement") -> "Unit":
    """One flat vector over `pids` (all trainable or all frozen), sharded; the modules' attributes
    are emptied, to be filled with views of the gathered vector before each use."""
    infos, unit_refs, offset = [], [], 0
    flat_pieces = []
    for pid in pids:
        p = params[pid]
        fqns = [f"{path}.{attr}" if path else attr for path, _, attr in refs[pid]]
        infos.append(ParamInfo(fqns=fqns, shape=p.shape, offset=offset))
        for path, mod, attr in refs[pid]:
            unit_refs.append((mod, attr, len(infos) - 1))
        flat_pieces.append(p.detach().reshape(-1))
        offset += p.numel()
    numel = offset
    size = shard_size(numel, place.shard_world) if numel else 0
    padded = size * place.shard_world
    dtype = flat_pieces[0].dtype if flat_pieces else torch.float32
    flat = torch.zeros(padded, dtype=dtype, device=place.device)
    if flat_pieces:
        flat[:numel].copy_(torch.cat([t.to(place.device) for t in flat_pieces]))
    home = torch.device("cpu") if place.cpu_offload else place.device
    shard_data = flat[place.shard_rank * size : (place.shard_rank + 1) * size].clone().to(home)
    requires_grad = any(params[pid].requires_grad for pid in pids)
    shard = nn.Parameter(shard_data, requires_grad=requires_grad)
    compute_dtype = place.param_dtype or dtype
    full_data = torch.empty(padded, dtype=compute_dtype, device=place.device)
    full = full_data.data.requires_grad_(requires_grad)  # own version counter: gathers never trip autograd
    for mod, attr, _ in unit_refs:
        if attr in mod._parameters:
            del mod._parameters[attr]
        setattr(mod, attr, None)  # views of the gathered buffer are set before each use
    unit = Unit(name, module, infos, unit_refs, numel, padded, shard, full_data, full,
                 is_root=unit_path == "")
    free_storage(unit.full_data)
    return unit
