"""Fully sharded data parallelism (ZeRO-3, and ZeRO-2 with `reshard_after_forward=False`).

The model is cut into *units* (by default: the repeated blocks of every `nn.ModuleList`, plus the root
for whatever is left). A unit's parameters are flattened, in registration order, into one flat vector
padded to a multiple of the shard-group size W; rank r keeps only slice r of it, as an
`nn.Parameter` of ceil(numel / W) elements (the *shard*, fp32 master weights). `FSDP.parameters()`
yields these shards only, so an optimizer built afterwards holds 1/W of the state.

One step, for one unit:

* **forward**: just before the unit runs, `all_gather_into_tensor` of the shards (cast to
  `param_dtype`) fills the unit's full flat buffer; the unit's modules get views of it as their
  weights. While the unit computes, the next unit's gather is already in flight (prefetch: on CUDA,
  NCCL's own stream runs it beside the compute stream). After the unit's forward the buffer's storage
  is freed (`reshard_after_forward=True`), or kept until backward (`False`).
* **backward**: a hook on the unit's outputs fires before the unit's backward: the buffer is gathered
  again (into the same storage, so the tensors autograd saved see the weights again) and the previous
  unit's gather is prefetched. Autograd accumulates the whole unit's gradient into one flat tensor
  (one `SplitBackward` node, no per-parameter copies); a post-accumulate hook then starts a
  `reduce_scatter_tensor` (in `reduce_dtype`) into the local shard and frees the full gradient and the
  full parameters.
* **end of backward**: one callback waits for the reductions, all-reduces the shards across replicas
  (hybrid sharding), and writes each shard's `.grad` (on the CPU with `cpu_offload`).

`no_sync()` keeps each unit's full gradient and skips the reduce-scatter; the next synchronised
backward accumulates into it and reduces once. That trades memory (one full gradient per unit, as in
DDP) for communication (none per accumulation step). Parameters are still gathered for every micro-batch.

Frozen parameters (`requires_grad=False`) in a unit that also trains get a flat vector and shard of
their own (the unit's name + "#frozen"): they are gathered like the rest but never reduced, and an
optimizer never gives them a state. Parameters shared between modules are owned by the innermost unit
that contains every use, so tied embeddings work wherever the two uses sit. Every unit must receive gradients on all ranks or on none
(as DDP without `find_unused_parameters`).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten  # noqa: F401

from ..comm.collectives import broadcast_coalesced, check_same_across_ranks, describe_module
from ..comm.sharded import all_gather_flat, reduce_scatter_flat, reshard_flat, shard_size

__all__ = ["FSDP", "MixedPrecision", "make_hybrid_groups"]

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_FORMAT = "distributed_training.fsdp/1"
#: Name of the part of a unit that holds its frozen parameters, when the unit also has trainable ones.
FROZEN_SUFFIX = "#frozen"


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for communication and compute; the shards (master weights) keep their own dtype.

    Attributes:
        param_dtype: dtype parameters are gathered and computed in (bf16 halves the gather bytes).
        reduce_dtype: dtype gradients are reduce-scattered in (default: `param_dtype`).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


@dataclass
class _ParamInfo:
    fqns: list[str]  # every state-dict key that names this parameter (tied weights have several)
    shape: torch.Size
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class _Unit:
    name: str
    module: nn.Module
    infos: list[_ParamInfo]
    refs: list[tuple[nn.Module, str, int]]  # (module, attribute, index into infos)
    numel: int
    padded: int
    shard: nn.Parameter
    full_data: torch.Tensor  # the gathered flat parameters; storage freed while resharded
    full: torch.Tensor  # a leaf aliasing full_data's storage: autograd's handle on the whole unit
    is_root: bool
    gathered: bool = False
    gather_work: Any = None
    gather_src: torch.Tensor | None = None
    grad_reduced: bool = False
    hooks: list = field(default_factory=list)


def make_hybrid_groups(ranks_per_node: int, group: dist.ProcessGroup | None = None):
    """(shard group, replicate group) for this rank: shard inside a node, replicate across nodes.

    Every rank must call this (group creation is collective). Nodes are consecutive blocks of
    `ranks_per_node` ranks, as torchrun numbers them.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if ranks_per_node < 1 or world % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must divide the world size {world}")
    ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(world)]
    nodes = world // ranks_per_node
    shard_group = replicate_group = None
    for n in range(nodes):
        g = dist.new_group(ranks[n * ranks_per_node : (n + 1) * ranks_per_node])
        if rank // ranks_per_node == n:
            shard_group = g
    for local in range(ranks_per_node):
        g = dist.new_group(ranks[local::ranks_per_node])
        if rank % ranks_per_node == local:
            replicate_group = g
    return shard_group, replicate_group


class FSDP(nn.Module):
    """Shard `module`'s parameters, gradients and optimizer state across ranks.

    Args:
        module: the model, on this rank's device (or on the CPU with `cpu_offload` on a GPU job).
        process_group: the ranks to shard over (default: all).
        auto_wrap_policy: how units are chosen. ``None``: each element of every `nn.ModuleList` whose
            class repeats (transformer blocks); a set/tuple of module classes; an int: bottom-up, any
            module holding at least that many not-yet-wrapped parameters; or ``fn(module, name) ->
            bool``. The root is always a unit for what is left.
        reshard_after_forward: free gathered parameters after each unit's forward (ZeRO-3) or keep
            them until its backward (ZeRO-2).
        mixed_precision: a `MixedPrecision` (gather in `param_dtype`, reduce in `reduce_dtype`).
        cpu_offload: keep shards, gradients and optimizer state on the CPU; move per unit.
        sharding_strategy: ``"full"`` (shard over the whole group) or ``"hybrid"`` (shard within a
            node, replicate across nodes).
        ranks_per_node: node size for hybrid sharding (default: LOCAL_WORLD_SIZE).
        device: compute device (default: the module's device).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        auto_wrap_policy: Any = None,
        reshard_after_forward: bool = True,
        mixed_precision: MixedPrecision | None = None,
        cpu_offload: bool = False,
        sharding_strategy: str = "full",
        ranks_per_node: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FSDP wraps an nn.Module, got {type(module).__name__}")
        if isinstance(module, FSDP):
            raise TypeError("module is already wrapped in FSDP")
        if not dist.is_initialized():
            raise RuntimeError("FSDP needs an initialised process group: call distributed_training.init_distributed()")
        if sharding_strategy not in ("full", "hybrid"):
            raise ValueError(f"sharding_strategy must be 'full' or 'hybrid', got {sharding_strategy!r}")
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError(f"mixed_precision must be a MixedPrecision, got {type(mixed_precision).__name__}")

        self.module = module
        self.process_group = process_group
        self.reshard_after_forward = bool(reshard_after_forward)
        self.cpu_offload = bool(cpu_offload)
        first = next(module.parameters(), None)
        self.device = torch.device(device) if device is not None else (first.device if first is not None else torch.device("cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        mp = mixed_precision or MixedPrecision()
        self._param_dtype = mp.param_dtype
        self._reduce_dtype = mp.reduce_dtype or mp.param_dtype

        if sharding_strategy == "hybrid":
            if ranks_per_node is None:
                import os

                ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size(process_group)))
            self.shard_group, self.replicate_group = make_hybrid_groups(ranks_per_node, process_group)
        else:
            self.shard_group, self.replicate_group = process_group, None
        self.shard_world = dist.get_world_size(self.shard_group)
        self.shard_rank = dist.get_rank(self.shard_group)

        check_same_across_ranks(describe_module(module), "model", process_group)
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        with torch.no_grad():
            broadcast_coalesced([p.data for p in module.parameters()] + list(module.buffers()), src, process_group)

        self._state_keys = list(module.state_dict(keep_vars=True).keys())
        self._buffer_keys = {n for n, _ in module.named_buffers(remove_duplicate=False)}
        self._units: list[_Unit] = self._build_units(module, _unit_roots(module, auto_wrap_policy))
        self.shards = nn.ParameterList([u.shard for u in self._units if u.padded])
        self._forward_order: list[_Unit] = []
        self._recording_order = True
        self._sync_enabled = True
        # What the hooks change during backward, in a plain object: assigning an nn.Module attribute on
        # autograd's device thread measured ~3 ms per assignment (see docs/ddp.md).
        self._backward_state = _BackwardState()
        self._join_state = None  # the `join()` context while one is open
        for unit in self._units:
            self._register_hooks(unit)

    # ------------------------------------------------------------ construction
    def _build_units(self, root: nn.Module, roots: list[str]) -> list[_Unit]:
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
                units.append(self._build_unit(name, unit_path, modules[unit_path], part, params, refs))
        return units

    def _build_unit(self, name: str, unit_path: str, module: nn.Module, pids: list[int],
                    params: dict[int, nn.Parameter], refs: dict[int, list[tuple[str, nn.Module, str]]]) -> "_Unit":
        """One flat vector over `pids` (all trainable or all frozen), sharded; the modules' attributes
        are emptied, to be filled with views of the gathered vector before each use."""
        infos, unit_refs, offset = [], [], 0
        flat_pieces = []
        for pid in pids:
            p = params[pid]
            fqns = [f"{path}.{attr}" if path else attr for path, _, attr in refs[pid]]
            infos.append(_ParamInfo(fqns=fqns, shape=p.shape, offset=offset))
            for path, mod, attr in refs[pid]:
                unit_refs.append((mod, attr, len(infos) - 1))
            flat_pieces.append(p.detach().reshape(-1))
            offset += p.numel()
        numel = offset
        size = shard_size(numel, self.shard_world) if numel else 0
        padded = size * self.shard_world
        dtype = flat_pieces[0].dtype if flat_pieces else torch.float32
        flat = torch.zeros(padded, dtype=dtype, device=self.device)
        if flat_pieces:
            flat[:numel].copy_(torch.cat([t.to(self.device) for t in flat_pieces]))
        home = torch.device("cpu") if self.cpu_offload else self.device
        shard_data = flat[self.shard_rank * size : (self.shard_rank + 1) * size].clone().to(home)
        requires_grad = any(params[pid].requires_grad for pid in pids)
        shard = nn.Parameter(shard_data, requires_grad=requires_grad)
        compute_dtype = self._param_dtype or dtype
        full_data = torch.empty(padded, dtype=compute_dtype, device=self.device)
        full = full_data.data.requires_grad_(requires_grad)  # own version counter: gathers never trip autograd
        for mod, attr, _ in unit_refs:
            if attr in mod._parameters:
                del mod._parameters[attr]
            setattr(mod, attr, None)  # views of the gathered buffer are set before each use
        unit = _Unit(name, module, infos, unit_refs, numel, padded, shard, full_data, full,
                     is_root=unit_path == "")
        _free(unit.full_data)
        return unit

    def _register_hooks(self, unit: _Unit) -> None:
        # Hooks hold FSDP and the unit weakly: autograd's C++ nodes keep `unit.full` (and so its hooks)
        # alive, out of the garbage collector's sight, and a strong reference would leak the model.
        me, index = weakref.ref(self), self._units.index(unit) if unit in self._units else len(self._units)

        def call(method: str, *args):
            fsdp = me()
            if fsdp is not None:
                return getattr(fsdp, method)(fsdp._units[index], *args)
            return args[-1] if args else None

        if not unit.is_root:
            unit.hooks.append(unit.module.register_forward_pre_hook(lambda m, a: call("_pre_forward")))
            unit.hooks.append(unit.module.register_forward_hook(lambda m, a, out: call("_post_forward", out)))
        if unit.full.requires_grad:
            unit.hooks.append(unit.full.register_post_accumulate_grad_hook(lambda t: call("_on_unit_grad")))

    # ------------------------------------------------------------ gather / free
    def _set_views(self, unit: _Unit) -> None:
        sizes = [info.numel for info in unit.infos]
        if unit.padded > unit.numel:
            sizes.append(unit.padded - unit.numel)
        pieces = torch.split(unit.full, sizes) if sizes else []
        for mod, attr, i in unit.refs:
            setattr(mod, attr, pieces[i].view(unit.infos[i].shape))

    def _start_gather(self, unit: _Unit) -> None:
        if unit.gathered or unit.gather_work is not None or unit.padded == 0:
            return
        _alloc(unit.full_data)
        src = unit.shard.detach()
        if src.device != self.device or src.dtype != unit.full_data.dtype:
            src = src.to(self.device, unit.full_data.dtype, non_blocking=True)
        unit.gather_src = src
        unit.gather_work = all_gather_flat(unit.full_data, src, self.shard_group, async_op=True) or _DONE

    def _unshard(self, unit: _Unit) -> None:
        if unit.gathered:
            return
        self._start_gather(unit)
        if unit.gather_work is not None:
            try:
                unit.gather_work.wait()
            except RuntimeError as err:
                raise RuntimeError(f"FSDP all-gather of unit '{unit.name or '<root>'}' failed: {err}") from err
        unit.gather_work = unit.gather_src = None
        unit.gathered = True

    def _reshard(self, unit: _Unit) -> None:
        if unit.gather_work is not None:
            self._unshard(unit)  # never free storage a collective is still writing
        if unit.gathered:
            _free(unit.full_data)
            unit.gathered = False

    def _prefetch_after(self, unit: _Unit, backward: bool) -> None:
        order = self._forward_order[::-1] if backward else self._forward_order
        if unit in order:
            k = order.index(unit)
            if k + 1 < len(order):
                self._start_gather(order[k + 1])

    # ------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        if self._backward_state.pending:  # a backward left reductions behind (e.g. it raised): settle them first
            self._finish_backward()
        if self._recording_order:
            self._forward_order = []
        for root in self._units:  # the root unit, and its frozen part if it has one
            if root.is_root:
                self._unshard(root)
                self._set_views(root)
        if self._param_dtype is not None:
            # Like the weights, floating-point inputs run in the compute dtype.
            args, kwargs = _cast_floats((args, kwargs), self._param_dtype)
        if self._forward_order and not self._recording_order:
            self._start_gather(self._forward_order[0])
        try:
            out = self.module(*args, **kwargs)
        finally:
            self._recording_order = False
        if not torch.is_grad_enabled():
            for unit in self._units:
                self._reshard(unit)
        return out

    def _pre_forward(self, unit: _Unit) -> None:
        if self._recording_order and unit not in self._forward_order:
            self._forward_order.append(unit)
        self._unshard(unit)
        self._prefetch_after(unit, backward=False)
        self._set_views(unit)

    def _post_forward(self, unit: _Unit, output):
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self._reshard(unit)
        if not torch.is_grad_enabled():
            return output
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            # Fires when the first gradient w.r.t. the unit's outputs is computed: before its backward.
            me = weakref.ref(self)
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads, u=unit: me() is not None and me()._pre_backward(u), mode="any"
            )
        return output

    # ------------------------------------------------------------ backward
    def _queue_finish(self) -> None:
        if not self._backward_state.callback_queued:
            self._backward_state.callback_queued = True
            _queue_callback(self._finish_backward)

    def _pre_backward(self, unit: _Unit) -> None:
        self._queue_finish()
        self._unshard(unit)
        self._prefetch_after(unit, backward=True)

    def _on_unit_grad(self, unit: _Unit) -> None:
        self._queue_finish()
        if not self._sync_enabled:
            # no_sync: keep the full gradient; autograd accumulates into it next time.
            if not unit.is_root:
                self._reshard(unit)
            return
        grad = unit.full.grad
        if self._reduce_dtype is not None and grad.dtype != self._reduce_dtype:
            grad = grad.to(self._reduce_dtype)
        out = torch.empty(unit.padded // self.shard_world, dtype=grad.dtype, device=grad.device)
        work = reduce_scatter_flat(out, grad, self.shard_group, async_op=True)
        # The collective keeps its input alive until it completes (NCCL stashes it, gloo's work owns
        # it): dropping our reference here frees each unit's full gradient as soon as it is reduced.
        self._backward_state.pending.append((unit, out, work))
        unit.full.grad = None
        del grad
        if not unit.is_root:
            self._reshard(unit)

    def _finish_backward(self) -> None:
        try:
            for unit, out, work in self._backward_state.pending:
                if work is not None:
                    try:
                        work.wait()
                    except RuntimeError as err:
                        raise RuntimeError(
                            f"FSDP reduce-scatter of unit '{unit.name or '<root>'}' failed: {err}"
                        ) from err
            if self.replicate_group is not None and dist.get_world_size(self.replicate_group) > 1:
                works = []
                for _, out, _ in self._backward_state.pending:
                    if dist.get_backend(self.replicate_group) == "nccl":
                        works.append(dist.all_reduce(out, op=dist.ReduceOp.AVG, group=self.replicate_group, async_op=True))
                    else:
                        out.div_(dist.get_world_size(self.replicate_group))
                        works.append(dist.all_reduce(out, group=self.replicate_group, async_op=True))
                for w in works:
                    w.wait()
            for unit, out, _ in self._backward_state.pending:
                grad = out.to(unit.shard.device, unit.shard.dtype, non_blocking=True)
                if unit.shard.grad is None:
                    unit.shard.grad = grad
                else:
                    unit.shard.grad += grad
        finally:
            self._backward_state.pending = []
            self._backward_state.callback_queued = False
            for unit in self._units:
                self._reshard(unit)

    # ------------------------------------------------------------ public helpers
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate full (unsharded) gradients locally; the next backward outside reduces once."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def join(self, optimizer: torch.optim.Optimizer | None = None, *, lr_scheduler=None):
        """A context in which ranks that run out of data keep answering the others' collectives (and
        keep stepping `optimizer`, which owns their shards): ``with model.join(optimizer=opt): ...``.
        See `distributed_training.join`."""
        from .join import Join

        return Join(self, optimizer, lr_scheduler=lr_scheduler)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the shards' gradients by the global 2-norm over all shards; return the norm."""
        if norm_type != 2.0:
            raise ValueError("FSDP.clip_grad_norm_ supports the 2-norm only")
        if self._join_state is not None:
            self._join_state.announce_clip(max_norm)  # ranks out of data join this all-reduce
        grads = [u.shard.grad for u in self._units if u.shard.grad is not None]
        comm_device = self.device if dist.get_backend(self.shard_group) == "nccl" else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float32, device=comm_device)
        for g in grads:
            total += g.detach().float().pow(2).sum().to(comm_device)
        if self.shard_world > 1:
            dist.all_reduce(total, group=self.shard_group)
        norm = total.sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.device, g.dtype))
        return norm

    @contextlib.contextmanager
    def summon_full_params(self) -> Iterator[None]:
        """Gather every unit so the module's weights can be read (collective: call on every rank)."""
        for unit in self._units:
            self._unshard(unit)
            with torch.no_grad():
                self._set_views(unit)
        try:
            yield
        finally:
            for unit in self._units:
                self._reshard(unit)

    def unit_names(self) -> list[str]:
        return [u.name for u in self._units]

    # ------------------------------------------------------------ state dicts
    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The unsharded state on rank 0 (on the CPU; other ranks get `{}` unless `rank0_only=False`),
        with the same keys as the plain module's `state_dict()`. Units are gathered one at a time, so
        peak memory grows by one unit, not by the model. Collective: call on every rank."""
        is_main = dist.get_rank(self.process_group) == 0 or not rank0_only
        values: dict[str, torch.Tensor] = {}
        for unit in self._units:
            if unit.padded == 0:
                continue
            full = torch.empty(unit.padded, dtype=unit.shard.dtype, device=self.device)
            work = all_gather_flat(full, unit.shard.detach().to(self.device), self.shard_group, async_op=False)
            if work is not None:
                work.wait()
            if is_main:
                cpu = full.cpu()
                for info in unit.infos:
                    t = cpu[info.offset : info.offset + info.numel].view(info.shape).clone()
                    for fqn in info.fqns:
                        values[fqn] = t
            del full
        if not is_main:
            return {}
        buffers = dict(self.module.named_buffers(remove_duplicate=False))
        out = {}
        for key in self._state_keys:
            if key in values:
                out[key] = values[key]
            elif key in buffers:
                out[key] = buffers[key].detach().cpu().clone()
        return out

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load an unsharded state dict (the plain module's keys); every rank passes the same dict."""
        _check_keys(set(state), set(self._state_keys), "state dict")
        with torch.no_grad():
            for unit in self._units:
                if unit.padded == 0:
                    continue
                flat = torch.zeros(unit.padded, dtype=unit.shard.dtype)
                for info in unit.infos:
                    value = state[info.fqns[0]]
                    if tuple(value.shape) != tuple(info.shape):
                        raise ValueError(f"'{info.fqns[0]}': expected shape {list(info.shape)}, got {list(value.shape)}")
                    flat[info.offset : info.offset + info.numel] = value.reshape(-1).to(flat.dtype)
                size = unit.padded // self.shard_world
                unit.shard.copy_(flat[self.shard_rank * size : (self.shard_rank + 1) * size])
            buffers = dict(self.module.named_buffers(remove_duplicate=False))
            for key, buf in buffers.items():
                buf.copy_(state[key])

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shards plus the metadata to re-shard them for another world size."""
        return {
            "format": _FORMAT,
            "world_size": self.shard_world,
            "rank": self.shard_rank,
            "units": {
                u.name: {
                    "numel": u.numel,
                    "shard": u.shard.detach().cpu().clone(),
                    "params": [(info.fqns, tuple(info.shape), info.offset) for info in u.infos],
                }
                for u in self._units
            },
            "buffers": {k: b.detach().cpu().clone() for k, b in self.module.named_buffers()},
        }

    def load_sharded_state_dict(self, states: dict | Sequence[dict] | Callable[[int], dict], *,
                                buffers: dict[str, torch.Tensor] | None = None) -> None:
        """Load shards saved by `sharded_state_dict`, at this world size or any other.

        `states` is this rank's saved dict (same world size), or every saved rank's dict in rank
        order (a list, or a function rank -> dict that is called only for the ranks needed).

        Buffers (BatchNorm's running statistics) are broadcast once at wrapping and then updated by
        each rank from its own data, so they are per-rank state: each rank loads the buffers saved by
        the rank of its own number, or rank 0's when the saved job had no such rank (it grew). Pass
        `buffers` to choose them yourself (hybrid sharding, where shard ranks repeat across nodes).
        """
        read = _reader(states)
        first = read(0)
        if first.get("format") != _FORMAT:
            raise ValueError("not an FSDP sharded state dict (missing or unknown 'format')")
        old_world = first["world_size"]
        if isinstance(states, dict) and old_world != self.shard_world:
            raise ValueError(
                f"the state was saved with {old_world} shards and this job has {self.shard_world}: pass every "
                "rank's saved state (a list or a function rank -> state) to re-shard it"
            )
        _check_keys(set(first["units"]), {u.name for u in self._units}, "FSDP units")
        with torch.no_grad():
            for unit in self._units:
                saved = first["units"][unit.name]
                mine = [(i.fqns, tuple(i.shape), i.offset) for i in unit.infos]
                for (fqns, shape, _), (_, my_shape, _) in zip(saved["params"], mine):
                    if tuple(shape) != my_shape:
                        raise ValueError(f"'{fqns[0]}': the checkpoint has shape {list(shape)}, this model "
                                         f"{list(my_shape)}")
                if saved["numel"] != unit.numel or [tuple(p[1]) for p in saved["params"]] != [p[1] for p in mine]:
                    raise ValueError(
                        f"FSDP unit '{unit.name or '<root>'}' does not match the checkpoint: saved parameters "
                        f"{[p[0][0] for p in saved['params']]} with {saved['numel']} elements, this model has "
                        f"{[p[0][0] for p in mine]} with {unit.numel}"
                    )
                if unit.padded == 0:
                    continue
                if isinstance(states, dict):
                    shard = saved["shard"]
                else:
                    shard = reshard_flat(unit.numel, old_world, lambda k, n=unit.name: read(k)["units"][n]["shard"],
                                         self.shard_world, self.shard_rank)
                unit.shard.copy_(shard)
            if buffers is None:
                buffers = read(self.shard_rank if self.shard_rank < old_world else 0)["buffers"]
            mine = dict(self.module.named_buffers())
            _check_keys(set(buffers), set(mine), "buffers")
            for key, buf in mine.items():
                buf.copy_(buffers[key])


# ------------------------------------------------------------------ helpers
class _BackwardState:
    """Per-backward bookkeeping: the queued finishing callback and the reductions in flight."""

    __slots__ = ("callback_queued", "pending")

    def __init__(self) -> None:
        self.callback_queued = False
        self.pending: list[tuple[_Unit, torch.Tensor, Any]] = []


class _Done:
    def wait(self) -> bool:
        return True


_DONE = _Done()


def _free(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    if storage.size() > 0:
        storage.resize_(0)


def _alloc(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    nbytes = t.numel() * t.element_size()
    if storage.size() < nbytes:
        storage.resize_(nbytes)


def _cast_floats(tree, dtype: torch.dtype):
    flat, spec = tree_flatten(tree)
    flat = [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in flat]
    return tree_unflatten(flat, spec)


def _reader(states) -> Callable[[int], dict]:
    if isinstance(states, dict):
        return lambda k: states
    if callable(states):
        cache: dict[int, dict] = {}

        def read(k: int) -> dict:
            if k not in cache:
                cache[k] = states(k)
            return cache[k]

        return read
    seq = list(states)
    return lambda k: seq[k]


def _check_keys(got: set, expected: set, what: str) -> None:
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    if missing or unexpected:
        raise ValueError(
            f"{what} does not match this model: missing {missing[:10]}{' ...' if len(missing) > 10 else ''}, "
            f"unexpected {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}"
        )


def _unit_roots(module: nn.Module, policy: Any) -> list[str]:
    """Module paths that become units, parents before children; "" (the root) first."""
    named = list(module.named_modules())
    chosen: list[str] = []
    if policy is None:
        for path, mod in named:
            if isinstance(mod, nn.ModuleList):
                classes = [type(c) for c in mod]
                for i, child in enumerate(mod):
                    if classes.count(type(child)) > 1 and any(True for _ in child.parameters()):
                        chosen.append(f"{path}.{i}" if path else str(i))
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
