"""Fully sharded data parallelism (ZeRO-3, and ZeRO-2 with `reshard_after_forward=False`).

The model is cut into *units* (by default: the repeated blocks of every `nn.ModuleList` or
`nn.Sequential`, plus the root for whatever is left). A unit's parameters are flattened, in registration order, into one flat vector
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
backward accumulates into it and reduces once, or `sync_gradients()` reduces it after the fact (what a
pipeline stage does after its schedule's backward passes). That trades memory (one full gradient per
unit, as in DDP) for communication (none per accumulation step). Parameters are still gathered for
every micro-batch (under a pipeline, ZeRO-2 keeps them gathered until `sync_gradients`).

Frozen parameters (`requires_grad=False`) in a unit that also trains get a flat vector and shard of
their own (the unit's name + "#frozen"): they are gathered like the rest but never reduced, and an
optimizer never gives them a state. Parameters shared between modules are owned by the innermost unit
that contains every use, so tied embeddings work wherever the two uses sit. Every unit must receive gradients on all ranks or on none
(as DDP without `find_unused_parameters`). A parameter of a unit that trains but that gets no gradient
on any rank (a head used only in some steps, a pooler never used) still gets zeros in the unit's flat
gradient, as in every flat-shard ZeRO: an optimizer with momentum or weight decay moves it, where one
process would leave it alone. The first `UNUSED_WATCH_STEPS` synchronised backward passes watch for
such parameters (a hook per parameter view, one small all-reduce) and warn once, naming them; so does
one pass in every `UNUSED_RECHECK_EVERY` after them, until a warning was given (a parameter that stops
being used later in training): `fsdp_unused.py`.

`torch.compile` works in either order (``torch.compile(FSDP(model))``, ``FSDP(torch.compile(model))``)
and per block: the methods that communicate or swap the units' views are never traced (dynamo breaks
the graph at each and runs it eagerly), so compiled graphs hold the units' computation, one piece per
unit at most.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm.collectives import broadcast_coalesced, check_same_across_ranks, describe_module
from ..comm.groups import make_hybrid_groups
from ..comm.sharded import all_gather_flat
from ..comm.wait_meter import WaitMeter
from ..mesh import Mesh, global_rank
from ..optim import ParamSegments
from ..runtime import collective_device, launcher_ranks_per_node
from .eager import eager_only
from .fsdp_full import FullWeights, _EmptyStateWarning, _RootGuard
from .fsdp_gradients import FSDPGradients, _BackwardState
from .fsdp_optimizers import watch_optimizers
from .fsdp_state import FSDPStateDict
from .fsdp_precision import MixedPrecision, cast_floats, refuse_low_precision_batchnorm
from .fsdp_units import Unit, UnitPlacement, alloc_storage, build_units, free_storage, unit_roots
from .fsdp_unused import UNUSED_RECHECK_EVERY, UNUSED_WATCH_STEPS, UnusedWatch  # noqa: F401 (their old home)
from .backward_start import inside_backward, on_backward_start, output_tensors
from .trainable import TrainableSet, lock_requires_grad

__all__ = ["FSDP", "MixedPrecision", "make_hybrid_groups"]


class FSDP(FSDPGradients, FSDPStateDict, FullWeights, nn.Module):
    """Shard `module`'s parameters, gradients and optimizer state across ranks.

    Args:
        module: the model, on this rank's device (or on the CPU with `cpu_offload` on a GPU job).
        process_group: the ranks to shard over (default: all).
        mesh: a `Mesh` instead of `process_group`: FSDP works over its data-parallel ranks
            (``mesh.group("data")``), sharding over ``"data_shard"`` and averaging the shards over
            ``"data_replicate"`` of the mesh re-split for `sharding_strategy` (`Mesh.with_data_shard`:
            all of them; `Mesh.hybrid`: a node's).
        auto_wrap_policy: how units are chosen. ``None``: each element of every `nn.ModuleList` whose
            class repeats (transformer blocks), and each child of an `nn.Sequential` whose class repeats
            and that has submodules (timm's blocks; `fsdp_units.repeated_blocks`); a set/tuple of
            module classes; an int: bottom-up, any module holding at least that many not-yet-wrapped
            parameters; or ``fn(module, name) -> bool``. The root is always a unit for what is left.
        reshard_after_forward: free gathered parameters after each unit's forward (ZeRO-3) or keep
            them until its backward (ZeRO-2).
        mixed_precision: a `MixedPrecision` (gather in `param_dtype`, reduce in `reduce_dtype`).
        cpu_offload: keep shards, gradients and optimizer state on the CPU; move per unit.
        sharding_strategy: ``"full"`` (shard over the whole group) or ``"hybrid"`` (shard within a
            node, replicate across nodes).
        ranks_per_node: node size for hybrid sharding (emulated nodes; default: the mesh's, or
            without a mesh the launcher's ``LOCAL_WORLD_SIZE``).
        device: compute device (default: the module's device).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        mesh: Mesh | None = None,
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
        if ranks_per_node is not None and sharding_strategy != "hybrid":
            raise ValueError(f"ranks_per_node={ranks_per_node!r} is the node size of hybrid sharding: pass "
                             "sharding_strategy='hybrid' with it, or leave it out")
        if not dist.is_initialized():
            raise RuntimeError("FSDP needs an initialised process group: call distributed_training.init_distributed()")
        if sharding_strategy not in ("full", "hybrid"):
            raise ValueError(f"sharding_strategy must be 'full' or 'hybrid', got {sharding_strategy!r}")
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError(f"mixed_precision must be a MixedPrecision, got {type(mixed_precision).__name__}")

        if mesh is not None and process_group is not None:
            raise ValueError("pass either mesh= or process_group=, not both (the mesh's data group is the one used)")
        if mesh is None:
            nodes = ranks_per_node or (launcher_ranks_per_node(process_group) if sharding_strategy == "hybrid" else None)
            mesh = Mesh(group=process_group, ranks_per_node=nodes)
        elif ranks_per_node is not None:
            mesh = mesh.with_ranks_per_node(ranks_per_node)
        mesh = mesh.hybrid() if sharding_strategy == "hybrid" else mesh.with_data_shard(mesh.dp_size)

        _refuse_parameter_hooks(module)
        self.module = module
        self._trainable = TrainableSet(module.named_parameters(), "FSDP", module)
        self.mesh = mesh
        process_group = self.process_group = mesh.group("data")
        self.reshard_after_forward = bool(reshard_after_forward)
        self.cpu_offload = bool(cpu_offload)
        first = next(module.parameters(), None)
        # (no parameter at all, e.g. an empty pipeline stage: where its collectives' tensors must live)
        self.device = (torch.device(device) if device is not None else
                       first.device if first is not None else collective_device(process_group))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        mp = mixed_precision or MixedPrecision()
        if mp.param_dtype is not None and mp.param_dtype != torch.float32:
            refuse_low_precision_batchnorm(module, mp.param_dtype)
        self._param_dtype = mp.param_dtype
        self._reduce_dtype = mp.reduce_dtype or mp.param_dtype

        self.shard_group = mesh.group("data_shard")
        # Hybrid sharding averages the shards over the replicas. Test the size, not the group: `None` is
        # the default group, as everywhere in torch.distributed (one rank per node: the whole job).
        self.replicate_world = mesh.size("data_replicate")
        self.replicate_group = mesh.group("data_replicate") if self.replicate_world > 1 else None
        self.shard_world = dist.get_world_size(self.shard_group)
        self.shard_rank = dist.get_rank(self.shard_group)

        check_same_across_ranks(describe_module(module), "model", process_group)
        src = global_rank(process_group, 0)
        with torch.no_grad():
            broadcast_coalesced([p.data for p in module.parameters()] + list(module.buffers()), src, process_group)

        self._state_keys = list(module.state_dict(keep_vars=True).keys())
        originals = dict(module.named_parameters())  # (an optimizer built over these before wrapping trains nothing)
        self._requires_grad_lock = lock_requires_grad(module, "FSDP")  # (its parameters become views)
        self._units: list[Unit] = build_units(module, unit_roots(module, auto_wrap_policy), UnitPlacement(
            self.shard_world, self.shard_rank, self.device, self.cpu_offload, self._param_dtype))
        self.shards = nn.ParameterList([u.shard for u in self._units if u.padded])
        self._roots = [u for u in self._units if u.is_root]  # the root unit, and its frozen part if it has one
        for u in self._units:  # which layer each element is, for layer-wise optimizers (LARS, LAMB)
            u.shard.segments = ParamSegments.for_shard(u.infos, self.shard_rank, u.shard.numel(), self.shard_group,
                                                       self.shard_world)
        self._forward_order: list[Unit] = []
        self._recording_order = True
        self._sync_enabled = True
        # ZeRO-2 under a pipeline (`FSDPStrategy.setup_stages`): backward passes under no_sync leave the
        # units gathered, so that the step's other microbatches need no gather; `sync_gradients` frees them.
        self._hold_until_sync = False
        # What the hooks change during backward, in a plain object: assigning an nn.Module attribute on
        # autograd's device thread measured ~3 ms per assignment (see docs/ddp.md).
        self._backward_state = _BackwardState()
        self._join_state = None  # the `join()` context while one is open
        # Which parameters get a gradient, watched over the first synchronised backward passes: one that
        # gets none on any rank still gets a zero gradient in its unit's flat vector (see the module
        # docstring), which the user is told once.
        self._unused_watch = UnusedWatch()
        self.waits = WaitMeter()  # the exposed communication, on the steps the trainer logs
        self._summoned = False  # inside `summon_full_params`
        self._released = False  # `release`: the module holds its weights again, the wrapper is done
        for unit in self._units:
            self._register_hooks(unit)
        self._outside_hook = module.register_forward_pre_hook(_RootGuard(self))
        _CopyGuard.install(self, module)
        self._state_hook = module._register_state_dict_hook(_EmptyStateWarning(self))
        watch_optimizers(self, originals)  # a loop's own optimizer over the shards, checked at its first step

    # ------------------------------------------------------------ construction


    def _register_hooks(self, unit: Unit) -> None:
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
    def _set_views(self, unit: Unit) -> None:
        sizes = [info.numel for info in unit.infos]
        if unit.padded > unit.numel:
            sizes.append(unit.padded - unit.numel)
        pieces = torch.split(unit.full, sizes) if sizes else []
        watch = self._unused_watch
        watched = watch.watching_parameters and unit.full.requires_grad and torch.is_grad_enabled()
        for mod, attr, i in unit.refs:
            view = pieces[i].view(unit.infos[i].shape)
            if watched:
                view.register_hook(watch.marker(unit, i))
            self._requires_grad_lock.watch_view(view, unit.infos[i].fqns)
            setattr(mod, attr, view)

    def _drop_stale(self, unit: Unit) -> None:
        """Free `unit`'s gathered weights where its shard changed in place since they were gathered. A unit
        stays gathered past a forward in grad mode until a backward frees it (the root unit; every unit
        under ZeRO-2): a forward whose backward never ran (a validation loss computed without no_grad),
        then the optimizer's step, left the next forward computing with the weights of before the step."""
        if unit.gathered and unit.gather_work is None and unit.shard._version != unit.gathered_version:
            self._reshard(unit)

    def _start_gather(self, unit: Unit) -> None:
        self._drop_stale(unit)
        if unit.gathered or unit.gather_work is not None or unit.padded == 0:
            return
        unit.gathered_version = unit.shard._version
        alloc_storage(unit.full_data)
        src = unit.shard.detach()
        if src.device != self.device or src.dtype != unit.full_data.dtype:
            src = src.to(self.device, unit.full_data.dtype, non_blocking=True)
        unit.gather_src = src
        if self._join_state is None:  # (watched passes: every rank must gather the same units, in order)
            self._unused_watch.unit_gathered(unit.name)
        unit.gather_work = all_gather_flat(unit.full_data, src, self.shard_group, async_op=True)

    def _unshard(self, unit: Unit) -> None:
        self._drop_stale(unit)
        if unit.gathered:
            return
        self._start_gather(unit)
        if unit.gather_work is not None:
            try:
                with self.waits.waiting(self.device):
                    unit.gather_work.wait()
            except RuntimeError as err:
                raise RuntimeError(f"FSDP all-gather of unit '{unit.name or '<root>'}' failed: {err}") from err
        unit.gather_work = unit.gather_src = None
        unit.gathered = True

    def _reshard(self, unit: Unit) -> None:
        if unit.gather_work is not None:
            self._unshard(unit)  # never free storage a collective is still writing
        if unit.gathered:
            free_storage(unit.full_data)
            unit.gathered = False

    def _prefetch_after(self, unit: Unit, backward: bool) -> None:
        order = self._forward_order[::-1] if backward else self._forward_order
        if unit in order:
            k = order.index(unit)
            if k + 1 < len(order):
                self._start_gather(order[k + 1])

    # ------------------------------------------------------------ forward
    # Under torch.compile (of this wrapper, of the module, or of its blocks) the methods that
    # communicate or change the wrapper's state are never traced: dynamo graph-breaks at each and runs
    # it eagerly, so every unit's all-gather, view swap and reshard happens between compiled graphs,
    # and what gets compiled is the modules' own computation, reading the unit's gathered views.
    def forward(self, *args, **kwargs):
        self._before_forward()
        if self._param_dtype is not None:
            # Like the weights, floating-point inputs run in the compute dtype.
            args, kwargs = cast_floats((args, kwargs), self._param_dtype)
        try:
            out = self.module(*args, **kwargs)
        except RuntimeError as err:
            if "out of bounds for storage of size 0" not in str(err):
                raise
            raise RuntimeError(
                "a parameter of an FSDP unit was used while its weights were freed: outside that unit's own "
                "forward (e.g. a block's weight used again by the model's head after the block ran). FSDP / "
                "ZeRO-3 gathers a unit's weights only around its own forward. Make the module that uses it "
                "part of the same unit (auto_wrap_policy), register the weight where it is used as the same "
                f"parameter (a tie), or use zero2 / zero1 / ddp. ({err})") from err
        self._after_forward()
        self._hook_outputs(out)
        return out

    def before_forward(self) -> None:
        """What the wrapper's forward does first, for callers that run the wrapped module's parts
        themselves (a pipeline stage, all of whose passes run under `no_sync`): the checks of which
        parameters train (flags changed or asked for by ``requires_grad_``), and what a failed step left
        dropped: its reductions, its queued end, the full gradients its passes accumulated."""
        self._trainable.check()
        if torch.is_grad_enabled():
            self._requires_grad_lock.check()
        state = self._backward_state
        if state.pending or state.callback_queued:
            self._drop_backward()
        self.drop_accumulated_gradients()

    @eager_only
    def _before_forward(self) -> None:
        if self._released:
            raise RuntimeError("this FSDP wrapper was released (the trainer was closed): its module holds its full "
                               "weights again and runs by itself; wrap it anew to train it sharded")
        if self._summoned:
            raise RuntimeError("the FSDP wrapper cannot run inside summon_full_params(), whose weights are not "
                               "the ones it trains: call the module itself there (`trainer.module`)")
        self._trainable.check()
        if torch.is_grad_enabled():
            self._requires_grad_lock.check()
        state = self._backward_state
        if (state.pending or state.callback_queued) and not inside_backward():
            self._drop_backward()  # a backward that raised left reductions (or its queued end) behind
        if self._recording_order:  # also after a first forward that raised: record again
            self._forward_order = []
        for root in self._roots:
            self._unshard(root)
            self._set_views(root)
        if self._forward_order and not self._recording_order:
            self._start_gather(self._forward_order[0])

    @eager_only
    def _after_forward(self) -> None:
        self._recording_order = False
        if not torch.is_grad_enabled():
            for unit in self._units:
                self._reshard(unit)

    @eager_only
    def _hook_outputs(self, out) -> None:
        """At the start of a backward through `out` (`backward_start`): queue its end on the outermost pass,
        and gather the root unit again for a second backward through the same forward
        (``retain_graph=True``), which the first one's end freed."""
        if torch.is_grad_enabled():
            me = weakref.ref(self)
            on_backward_start(out, lambda: me() is not None and me()._before_backward())

    def _before_backward(self) -> None:
        self._queue_finish()
        for root in self._roots:
            self._unshard(root)

    @eager_only
    def _pre_forward(self, unit: Unit) -> None:
        if self._summoned:  # the modules hold their full weights as parameters
            return
        if inside_backward():
            # A reentrant checkpoint's recomputation, on the outer backward's thread and pass, where the
            # outputs' hook did not run (outputs it cannot see, a loss from an inner tensor): the end of
            # the backward is queued here, on the outer pass, not in the nested pass about to start.
            self._queue_finish(recomputing=True)
        if self._recording_order and unit not in self._forward_order:
            self._forward_order.append(unit)
        self._unshard(unit)
        self._prefetch_after(unit, backward=False)
        self._set_views(unit)

    @eager_only
    def _post_forward(self, unit: Unit, output):
        if self._summoned:
            return output
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self._reshard(unit)
        if not torch.is_grad_enabled():
            return output
        tensors = [t for t in output_tensors(output) if t.requires_grad]  # (a dataclass's fields too)
        if tensors:
            # Fires when the first gradient w.r.t. the unit's outputs is computed: before its backward.
            me = weakref.ref(self)
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads, u=unit: me() is not None and me()._pre_backward(u), mode="any"
            )
        return output

    # ------------------------------------------------------------ backward
    def _pre_backward(self, unit: Unit) -> None:
        self._queue_finish()
        self._unshard(unit)
        self._prefetch_after(unit, backward=True)

    # ------------------------------------------------------------ public helpers
    def join(self, optimizer: torch.optim.Optimizer | None = None, *, lr_scheduler=None):
        """A context in which ranks that run out of data keep answering the others' collectives (and
        keep stepping `optimizer`, which owns their shards): ``with model.join(optimizer=opt): ...``.
        See `distributed_training.join`."""
        from .join import Join

        return Join(self, optimizer, lr_scheduler=lr_scheduler)


def _refuse_parameter_hooks(module: nn.Module) -> None:
    """A hook registered on a parameter (``p.register_hook(fn)``, ``register_post_accumulate_grad_hook``)
    would never run: the units replace the parameters by views of their flat buffers, whose gradients
    autograd accumulates as one flat tensor. Refused, naming the parameter, rather than ignored."""
    for name, p in module.named_parameters():
        if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
            raise ValueError(
                f"parameter {name!r} has a gradient hook of its own (Tensor.register_hook or "
                "register_post_accumulate_grad_hook): FSDP (ZeRO-2/3) flattens the parameters into shards, "
                "so the hook would never run. Put the hook on the module (register_full_backward_hook), "
                "transform the gradients after backward, or use strategy 'ddp' or 'zero1'")


class _CopyGuard:
    """`copy.deepcopy` of a module whose parameters the units hold: refused, naming it, while they are views
    of the flat buffers (a copy would hold no parameters of its own: torch's "Only Tensors created
    explicitly by the user (graph leaves) support the deepcopy protocol", or, before the first forward,
    a copy without weights). Inside `summon_full_params()` and after `release()` the modules hold real
    parameters, and the copy is torch's. Installed as the module's own ``__deepcopy__`` (an instance
    attribute: `copy.deepcopy` looks it up on the object)."""

    def __init__(self, fsdp: "FSDP", module: nn.Module, name: str) -> None:
        self.fsdp, self.module, self.name = weakref.ref(fsdp), weakref.ref(module), name

    @classmethod
    def install(cls, fsdp: "FSDP", root: nn.Module) -> None:
        holders = {id(mod) for unit in fsdp._units for mod, _, _ in unit.refs}
        for name, mod in root.named_modules():
            if id(mod) in holders or mod is root:
                mod.__dict__["__deepcopy__"] = cls(fsdp, mod, name)

    def __reduce__(self):
        # A pickle of the module (`torch.save` inside `summon_full_params()`) holds its weights itself: it
        # loads with None in the guard's place, which `copy.deepcopy` passes over.
        return type(None), ()

    def __call__(self, memo: dict) -> nn.Module:
        fsdp, module = self.fsdp(), self.module()
        if fsdp is not None and not fsdp._summoned and not fsdp._released:
            where = f"{type(module).__name__} {self.name!r}" if self.name else f"the {type(module).__name__}"
            raise RuntimeError(
                f"copy.deepcopy: {where} holds parameters sharded by FSDP (ZeRO-2/3): views into flat buffers, "
                "which a copy cannot own. Copy the model before wrapping it, copy it inside "
                "summon_full_params() (every rank enters it), or load full_state_dict() into a model built "
                "as this one was")
        del module.__dict__["__deepcopy__"]  # the plain copy (the copy then has no guard of its own)
        try:
            duplicate = copy.deepcopy(module, memo)
        finally:
            module.__dict__["__deepcopy__"] = self
        if fsdp is not None:
            _strip_copy(fsdp, module, memo)
        return duplicate


def _strip_copy(fsdp: "FSDP", module: nn.Module, memo: dict) -> None:
    """A plain copy of `module` (made inside `summon_full_params()`) carries the wrapper's hooks, which call
    the original's units (a gather: a collective, on this rank only) and its `requires_grad_` lock:
    take them off the copy's modules, as `release()` does on the original."""
    handles = [fsdp._outside_hook, fsdp._state_hook, *(h for unit in fsdp._units for h in unit.hooks)]
    ids = {h.id for h in handles if hasattr(h, "id")}
    for original in module.modules():
        duplicate = memo.get(id(original))
        if duplicate is None:
            continue
        for hooks in ("_forward_pre_hooks", "_forward_hooks", "_state_dict_hooks", "_forward_pre_hooks_with_kwargs",
                      "_forward_hooks_with_kwargs"):
            table = duplicate.__dict__.get(hooks)
            for key in ids & set(table or ()):
                del table[key]
        duplicate.__dict__.pop("_requires_grad_lock", None)
        duplicate.__dict__.pop("requires_grad_", None)
