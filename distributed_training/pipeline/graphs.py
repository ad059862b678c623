"""CUDA graphs of a stage's forward and backward: the engine's ``cuda_graphs`` option.

At a GPT-1.3B stage with microbatches of 2 x 1024 tokens the host needs about as long to issue a
step's ~6000 kernels as the GPU needs to run them (docs/pipeline.md): every schedule then waits for the
host, and its measured bubble sits above the formula. A graph replays a whole forward, or a whole
backward, with one launch.

How (`StageGraphs`): a step runs as usual, and each forward notes its chunk's input (a `Spec`: shape,
dtype, whether it needs a gradient, the autocast dtype, and the chunk's mode: every module's train/eval
flag and every parameter's requires_grad, read once a step). After the step, once every message of this
rank has completed, each chunk's first spec is captured: one pair of graphs (forward; backward =
``torch.autograd.grad`` of the output for the input and the parameters, run on fresh leaves that alias
the parameters, see `_Slot`) per microbatch the schedule keeps in flight on that chunk (a "slot"), each
pair in a memory pool of its own, since slots are replayed in any order. Later forwards whose input matches take a free slot: the input is
copied into the slot's static input, the forward graph replays, and the output comes back through an
autograd Function whose backward copies the output's gradient in, replays the backward graph and returns
the input's gradient. The parameters' gradients do not go through autograd: inside the backward graph
each is added, as it is computed, into the chunk's accumulator for that parameter (one per parameter,
shared by the chunk's slots, `StageGraphs.accumulators`), and after the schedule's last backward
`flush` adds the accumulators into ``.grad`` (a copy where it is None) and zeroes them. So the slots'
memory pools hold one parameter's gradient at a time while a backward graph runs, instead of a whole set
of gradients per slot kept between steps (GPipe at P = 2 x DP = 2 kept 8: 37.9 against 21.7 GiB eagerly,
session 27). The price: ``.grad`` post-accumulate hooks do not fire for a graphed microbatch (the
pipeline runs every backward under the data-parallel strategy's `no_sync`, where our DDP's hooks do
nothing, and reduces once after the schedule). A forward whose input does not match (another sequence
length), or that finds every slot taken, runs eagerly, with the same parameters; its gradients reach
``.grad`` through autograd and add up with the flushed ones.

Split backwards (ZB-H1's I and W, ``split=True``): a slot's backward graph is the I pass, with the
chunk's own linear layers' weight gradients left out (autograd is asked for their outputs' gradients
instead, kept in the slot), and a third graph, the W pass, adds each such layer's ``dy^T x`` and bias
gradient into the accumulators, computed as the eager split backward's W computes them
(`split_backward`). A slot is taken from its forward to its W.

Weight casts under autocast: eagerly, autocast casts each weight once per autocast region (its cache)
and every microbatch of the step reads that copy. A graph cannot keep autocast's cache, so the linear
layers' weights and biases are cast into a cache of the chunk's (`linear_casts`), written once a step
by `StageGraphs.refresh_casts` (one multi-tensor copy), which the replayed forwards read; the gradient
goes back through the cast as autocast's does (`_CachedCast`). Measured on one H200 at a 6-block
GPT-1.3B stage, 8 microbatches: casting in every replay made the forwards 8% slower than eager ones.

A chunk whose capture fails (an output that is not one tensor, a forward that synchronises with the
host, memory) warns and stays eager; the step it followed stands. The capture's warm-up passes really
run: the buffers they update (BatchNorm's statistics) are put back.

Limits (checked where possible): CUDA only; parameters are read where they were at capture (an
optimizer updating them in place, as torch's do, is fine; after `param.data = ...` the chunk's graphs
are dropped at the next step and captured again); no module
hooks in the chunk (a hook that gathers parameters, ZeRO's or FSDP's, would not run on replay:
refused); the forward must not synchronise with the host; autocast's own weight-cast cache is off
inside the graphs (the linear layers' casts come from the chunk's cache above; other ops' casts are
replayed kernels); random ops (dropout) draw fresh
numbers on every replay, but not the eager pass's numbers. Memory: one set of activations per slot,
kept between steps, one set of gradient accumulators per chunk, and under autocast one low-precision
copy of the chunk's linear layers' weights (the cast cache).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .linear_split import _autocast_dtype, _cast, _WeightGrad, batched_grads

__all__ = ["Spec", "StageGraphs", "check_no_hooks", "slots_per_chunk"]


@dataclass(frozen=True)
class Spec:
    """What a captured forward was captured for: its input and the mode it ran in."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    autocast: torch.dtype | None
    #: The chunk's mode: each module's ``training`` flag and each parameter's ``requires_grad`` (a submodule
    #: put in eval mode, a layer unfrozen: what a graph captured before would not follow).
    mode: tuple[bool, ...]


def slots_per_chunk(actions: Sequence, chunks: int) -> list[int]:
    """The most microbatches each chunk has in flight in `actions` (one rank's): from its forward to its
    backward, or to its weight-gradient pass (``W``) where the backward is split (a graphed ZB-H1 slot
    keeps the deferred layers' inputs and output gradients until then)."""
    open_, most = [0] * chunks, [0] * chunks
    for action in actions:
        if action.kind == "F":
            open_[action.chunk] += 1
            most[action.chunk] = max(most[action.chunk], open_[action.chunk])
        elif action.kind in ("B", "W"):
            open_[action.chunk] -= 1
    return most


def check_no_hooks(chunks: Sequence[nn.Module]) -> None:
    """Refuse chunks with module hooks: a replayed graph would skip them (ZeRO and FSDP gather parameters
    in forward hooks)."""
    for c, module in enumerate(chunks):
        hooked = [name or "<chunk>" for name, m in module.named_modules()
                  if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks]
        if hooked:
            raise ValueError(f"pipeline cuda_graphs: chunk {c} has module hooks (on {hooked[:3]}), which a replayed "
                             "graph would skip: use cuda_graphs with DDP (or no data parallelism) inside the stages")


def _runner(module: nn.Module, spec: Spec, casts: dict[int, torch.Tensor] | None = None,
            deferred: Sequence[nn.Linear] = ()):
    """(the trainable parameters by name, a function running the chunk's forward on an input under the
    spec's autocast, returning its output and its differentiable inputs: the input if it needs a gradient,
    then one fresh leaf per parameter). `casts` and `deferred`: see `_linear_forwards` (the function's
    `records` argument collects the deferred layers' records)."""
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    cast = (torch.autocast("cuda", dtype=spec.autocast, cache_enabled=False) if spec.autocast is not None
            else nullcontext())
    casts = casts if spec.autocast is not None else None
    linears = _linears(module) if casts or deferred else {}

    def run(x: torch.Tensor, records: list | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        # The forward on new leaves that alias the parameters (same storage: a replay reads the values of
        # the moment). Autograd keeps, for each leaf, the stream it was first used on and makes the caller
        # wait on it after a backward; a parameter's leaf node from the eager steps (default stream) would
        # break the capture. Fresh leaves get theirs inside the capture.
        leaves = {name: p.detach().requires_grad_(True) for name, p in named}
        swapped = (_linear_forwards(linears, leaves, casts, deferred, records if records is not None else [])
                   if linears else nullcontext())
        with cast, swapped:
            out = torch.func.functional_call(module, leaves, (x,))
        return out, ((x,) if spec.requires_grad else ()) + tuple(leaves.values())

    return named, run


def _warm_up(module: nn.Module, spec: Spec, device: torch.device, passes: int,
             casts: dict[int, torch.Tensor] | None = None, deferred: Sequence[nn.Linear] = ()) -> list[str]:
    """Run the chunk's forward and backward `passes` times on a side stream, as CUDA graphs want (libraries'
    lazy set-up stays out of the capture); the names of the parameters that got a gradient. The passes
    really run: buffers they update (BatchNorm's running statistics) get their values back."""
    named, run = _runner(module, spec, casts, deferred)
    kept = [(b, b.detach().clone()) for b in module.buffers()]
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    used: list[str] = []
    with torch.cuda.stream(side):
        for _ in range(passes):
            out, inputs = run(torch.zeros(spec.shape, dtype=spec.dtype, device=device).requires_grad_(spec.requires_grad))
            grads = torch.autograd.grad(out, inputs, torch.ones_like(out), allow_unused=True)
            grads = grads[1:] if spec.requires_grad else grads
            used = [name for (name, _), g in zip(named, grads) if g is not None]
            del out, inputs, grads
    torch.cuda.current_stream(device).wait_stream(side)
    with torch.no_grad():
        for buffer, value in kept:
            buffer.copy_(value)
    return used


def _linears(module: nn.Module) -> dict[nn.Linear, tuple[str, str | None]]:
    """The layers of `module` running `nn.Linear`'s own forward (and no instance forward of someone
    else's) on registered parameters, with their weight's and bias's names in ``named_parameters()`` (a
    tied weight: its first). Other layers keep their own forward in the graphs (autocast's casts)."""
    names = {id(p): name for name, p in module.named_parameters(remove_duplicate=True)}
    found = {}
    for m in module.modules():
        if not (isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward and "forward" not in m.__dict__):
            continue
        weight, bias = m.weight, m.bias  # (a parametrized weight is computed on access: not a parameter here)
        if id(weight) in names and (bias is None or id(bias) in names):
            found[m] = (names[id(weight)], None if bias is None else names[id(bias)])
    return found


def deferrable_linears(module: nn.Module) -> list[nn.Linear]:
    """The linear layers of `module` whose weight gradients a split slot defers to its W graph: those of
    `_linears` whose weight requires a gradient and whose weight and bias are registered in no other
    module (a tied weight's other use gets its gradient in I, so the whole weight's does)."""
    uses: dict[int, int] = {}
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                uses[id(p)] = uses.get(id(p), 0) + 1
    return [m for m in _linears(module) if m.weight.requires_grad and uses[id(m.weight)] == 1
            and (m.bias is None or uses[id(m.bias)] == 1)]


def linear_casts(module: nn.Module, dtype: torch.dtype) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """For the graphs' weight-cast cache: each parameter of `module`'s linear layers that autocast to
    `dtype` would cast (floating point, not float64, not `dtype`), by id, with an empty tensor of
    `dtype` for its cast."""
    found = {}
    for m in _linears(module):
        for p in (m.weight, m.bias):
            if p is not None and p.is_floating_point() and p.dtype not in (dtype, torch.float64):
                found.setdefault(id(p), (p, torch.empty_like(p, dtype=dtype)))
    return found


class _CachedCast(torch.autograd.Function):
    """A parameter's cast to the autocast dtype, read from the chunk's cache (`StageGraphs.refresh_casts`
    writes it once a step, as autocast's own cache casts a weight once per autocast region) instead of
    cast again by every microbatch's replayed forward; backward as autocast's cast's: the gradient
    cast back to the parameter's dtype."""

    @staticmethod
    def forward(ctx, param: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
        ctx.dtype = param.dtype
        return cached.detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


@contextmanager
def _linear_forwards(linears: dict[nn.Linear, tuple[str, str | None]], leaves: dict[str, torch.Tensor],
                     casts: dict[int, torch.Tensor] | None, deferred: Sequence[nn.Linear], records: list):
    """While active, each of `linears` runs ``F.linear`` on its weight's and bias's leaves (a frozen one:
    the parameter) with autocast's casts done here: the input cast, the weight and bias read from
    `casts` (by the parameter's id) where there. Each layer in `deferred` notes ``(input as the matmul
    sees it, output, output's version, weight name, bias name)`` in `records` (a split slot's W needs
    them)."""
    deferred = set(deferred)

    def swapped(m: nn.Linear, names: tuple[str, str | None]):
        record = m in deferred
        w_cast = casts.get(id(m.weight)) if casts else None
        b_cast = casts.get(id(m.bias)) if casts and m.bias is not None else None

        def forward(x: torch.Tensor) -> torch.Tensor:
            weight, bias = leaves.get(names[0], m.weight), leaves.get(names[1], m.bias)
            dtype = _autocast_dtype(x.device.type)
            x = _cast(x, dtype)
            if dtype is not None:
                weight = _CachedCast.apply(weight, w_cast) if w_cast is not None else _cast(weight, dtype)
                bias = _CachedCast.apply(bias, b_cast) if b_cast is not None else _cast(bias, dtype)
            y = F.linear(x, weight, bias)
            if record and y.requires_grad:  # (a call under no_grad has nothing to defer)
                records.append((x, y, y._version, *names))
            return y
        return forward

    for m, names in linears.items():
        object.__setattr__(m, "forward", swapped(m, names))
    try:
        yield
    finally:
        for m in linears:
            del m.__dict__["forward"]


class _Slot:
    """One forward graph and its backward graph, with their static tensors. The backward graph adds the
    parameters' gradients into `accumulators` (the chunk's, by parameter name, shared by its slots), so a
    slot's memory pool holds one parameter's gradient at a time while the graph runs, not all of them
    between steps; the input's gradient is the graph's own output (`grad_x`).

    `split` (ZB-H1's I and W): the backward graph is the I pass. The forward runs the chunk's deferrable
    linear layers (`deferrable_linears`) noting each one's input and output; the I graph asks autograd
    for the gradients of the chunk's input, of those outputs (``dy``: so the layers' weight matmuls are
    skipped) and of the other parameters (added into their accumulators), and keeps each ``dy`` in the
    slot; the W graph (`weight_graph`) adds each layer's ``dy^T x`` and ``dy`` summed over rows into
    its weight's and bias's accumulators. The slot stays taken from the forward to the W."""

    def __init__(self, module: nn.Module, spec: Spec, device: torch.device,
                 accumulators: dict[str, torch.Tensor], split: bool = False,
                 casts: dict[int, torch.Tensor] | None = None) -> None:
        named, run = _runner(module, spec, casts, deferrable_linears(module) if split else ())
        self.params = tuple(p for _, p in named)
        self.x = torch.zeros(spec.shape, dtype=spec.dtype, device=device).requires_grad_(spec.requires_grad)
        pool = torch.cuda.graph_pool_handle()
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        self.weight_graph: torch.cuda.CUDAGraph | None = None
        records: list = []
        # thread_local: the process group's watchdog thread may query its events during the capture.
        with torch.cuda.graph(self.forward_graph, pool=pool, capture_error_mode="thread_local"):
            out, inputs = run(self.x, records)
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            raise ValueError("pipeline cuda_graphs: a chunk must return one tensor that requires grad, got "
                             f"{type(out).__name__}")
        self.out = out
        self.grad_out = torch.zeros_like(out)
        leaves = inputs[1:] if spec.requires_grad else inputs
        if split:
            self._capture_split(module, spec, named, leaves, records, accumulators, pool)
        else:
            # A parameter's leaf whose .grad is its accumulator: AccumulateGrad adds into a .grad it finds,
            # in place (captured as one add per parameter). The input's leaf has none: AccumulateGrad takes
            # the gradient the graph computes, which every replay writes again.
            targets = [self.x] if spec.requires_grad else []
            for (name, _), leaf in zip(named, leaves):
                if name in accumulators:
                    leaf.grad = accumulators[name]
                    targets.append(leaf)
            if not targets:
                raise ValueError("pipeline cuda_graphs: nothing in the chunk gets a gradient")
            with torch.cuda.graph(self.backward_graph, pool=pool, capture_error_mode="thread_local"):
                torch.autograd.backward(out, self.grad_out, inputs=targets)
            self.grad_x = self.x.grad if spec.requires_grad else None
        self.addresses = [p.data_ptr() for p in self.params]  # where the graphs read the parameters
        self.busy = False

    def _capture_split(self, module: nn.Module, spec: Spec, named, leaves, records: list,
                       accumulators: dict[str, torch.Tensor], pool) -> None:
        # A layer whose output was modified in place after it (an inplace ReLU) is not deferred: that
        # output's gradient is not the layer's dy; its weight and bias get their gradients in I.
        armed = [r for r in records if r[1]._version == r[2]]
        deferred = {name for r in armed for name in r[3:] if name is not None}
        others = [(name, leaf) for (name, _), leaf in zip(named, leaves)
                  if name in accumulators and name not in deferred]
        wanted = ([self.x] if spec.requires_grad else []) + [r[1] for r in armed] + [leaf for _, leaf in others]
        if not wanted:
            raise ValueError("pipeline cuda_graphs: nothing in the chunk gets a gradient")
        with torch.cuda.graph(self.backward_graph, pool=pool, capture_error_mode="thread_local"):
            got = torch.autograd.grad(self.out, wanted, self.grad_out, allow_unused=True)
            k = 1 if spec.requires_grad else 0
            for (name, _), g in zip(others, got[k + len(armed):]):
                if g is not None:
                    accumulators[name].add_(g)
        self.grad_x = got[0] if spec.requires_grad else None
        # What W needs until it runs, held by the slot: each layer's input (autograd let go of it) and dy.
        by_name = dict(zip((name for name, _ in named), leaves))
        self.deferred = [(x, dy, w, b) for (x, _, _, w, b), dy in zip(armed, got[k:k + len(armed)])
                         if dy is not None]
        del got
        # W computes as the eager split backward's W does (`linear_split`: layers of one shape in one
        # batched matmul), so graphed and eager microbatches get the same gradients.
        every = dict(module.named_parameters())  # a frozen bias has no leaf: the parameter itself
        work: dict[tuple, list[_WeightGrad]] = {}
        for x, dy, w, b in self.deferred:
            item = _WeightGrad(x, dy, by_name[w], by_name.get(b, every.get(b)))
            work.setdefault(item.group_key(), []).append(item)
        names = {id(leaf): name for name, leaf in by_name.items()}
        if not work:  # nothing deferred on this chunk (an embedding alone, say): W has nothing to do
            return
        self.weight_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.weight_graph, pool=pool, capture_error_mode="thread_local"), \
                torch.autocast("cuda", enabled=False):
            for items in work.values():
                params, grads = [], []
                if len(items) == 1:
                    items[0].grads(params, grads)
                else:
                    batched_grads(items, params, grads)
                for p, g in zip(params, grads):
                    if names.get(id(p)) in accumulators:
                        accumulators[names[id(p)]].add_(g)
                del params, grads


class _Replay(torch.autograd.Function):
    """A slot's forward graph as an autograd node whose backward replays the slot's backward graph."""

    @staticmethod
    def forward(ctx, graphs: "StageGraphs", chunk: int, slot: _Slot, x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.slot, ctx.graphs, ctx.chunk = slot, graphs, chunk
        if x.data_ptr() != slot.x.data_ptr():
            slot.x.copy_(x)
        slot.forward_graph.replay()
        return slot.out.detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        # The parameters' gradients went into the chunk's accumulators (`StageGraphs.flush` hands them to
        # .grad after the schedule): none through autograd here.
        slot = ctx.slot
        slot.grad_out.copy_(grad)
        slot.backward_graph.replay()
        ctx.graphs.dirty[ctx.chunk] = True
        return (None, None, None, slot.grad_x, *(None for _ in slot.params))


class StageGraphs:
    """The CUDA graphs of one rank's chunks (see the module docstring).

    Args:
        chunks: the rank's chunks, as the engine runs them.
        slots: per chunk, how many microbatches the schedule keeps in flight (`slots_per_chunk`).
        device: the CUDA device.
        warmup: eager forward + backward passes before the first capture of a spec.
        split: capture split slots (ZB-H1's I and W, `_Slot`): the backward replayed through autograd
            is the I pass, and `weight_grad` replays the W pass.
    """

    def __init__(self, chunks: Sequence[nn.Module], slots: Sequence[int], device: torch.device,
                 warmup: int = 2, split: bool = False) -> None:
        check_no_hooks(chunks)
        if device.type != "cuda":
            raise ValueError(f"cuda_graphs (the trainer's pipeline_cuda_graphs) needs CUDA devices, got {device}")
        if device.index is None:  # inputs are on "cuda:N": compare with that
            device = torch.device("cuda", torch.cuda.current_device())
        self.chunks, self.slots, self.device, self.warmup = list(chunks), list(slots), device, warmup
        self.split = split
        self.captured: list[tuple[Spec | None, list[_Slot]] | None] = [None] * len(self.chunks)
        #: Per chunk, the gradients its graphs' backward passes added up this step, by parameter name (one
        #: buffer per parameter, shared by the chunk's slots), and whether any were added since the flush.
        self.accumulators: list[dict[str, torch.Tensor]] = [{} for _ in self.chunks]
        self.dirty = [False] * len(self.chunks)
        #: Per chunk with graphs captured under autocast: its linear layers' parameters and their casts
        #: (`linear_casts`), written once a step by `refresh_casts`.
        self.casts: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in self.chunks]
        self._wanted: list[Spec | None] = [None] * len(self.chunks)
        self._modes: list[tuple[bool, ...]] = [self._mode(c) for c in range(len(self.chunks))]
        #: Forwards that ran from a graph / eagerly (for tests and benchmarks).
        self.replayed = 0
        self.eager = 0

    def _mode(self, chunk: int) -> tuple[bool, ...]:
        module = self.chunks[chunk]
        return (tuple(m.training for m in module.modules()) + tuple(p.requires_grad for p in module.parameters()))

    def begin_step(self) -> None:
        """Before a step's first forward: read the chunks' modes (once a step: they do not change inside
        one), and drop the graphs of a chunk whose parameters moved (``param.data = ...``: the graphs would
        read the old memory); it is captured again after the step."""
        self._modes = [self._mode(c) for c in range(len(self.chunks))]
        for chunk, entry in enumerate(self.captured):
            if entry is not None and entry[1] and [p.data_ptr() for p in entry[1][0].params] != entry[1][0].addresses:
                self.captured[chunk] = None
                self.casts[chunk] = {}
        self.refresh_casts()

    def refresh_casts(self) -> None:
        """Cast the linear layers' parameters of the chunks with graphs into their caches: once a step,
        before its first forward (the optimizer has moved them since)."""
        for casts in self.casts:
            if casts:
                with torch.no_grad():
                    torch._foreach_copy_([c for _, c in casts.values()], [p for p, _ in casts.values()])

    def spec_of(self, chunk: int, x: Any) -> Spec | None:
        if not isinstance(x, torch.Tensor) or x.device != self.device:
            return None
        autocast = torch.get_autocast_dtype(self.device.type) if torch.is_autocast_enabled(self.device.type) else None
        return Spec(tuple(x.shape), x.dtype, x.requires_grad, autocast, self._modes[chunk])

    def forward(self, chunk: int, x: Any) -> tuple[torch.Tensor, _Slot] | None:
        """The chunk's output from a free slot's graphs, and the slot (give it back with `weight_grad`
        after its backward, or after its W with a split backward); None where the forward must run
        eagerly (noted, for a capture after the step)."""
        spec = self.spec_of(chunk, x)
        entry = self.captured[chunk]
        if spec is not None and entry is not None and entry[0] == spec:
            slot = next((s for s in entry[1] if not s.busy), None)
            if slot is not None:
                slot.busy = True
                self.replayed += 1
                return _Replay.apply(self, chunk, slot, x, *slot.params), slot
        elif spec is not None and entry is None and self._wanted[chunk] is None and self.slots[chunk] > 0:
            self._wanted[chunk] = spec
        self.eager += 1
        return None

    def weight_grad(self, chunk: int, slot: _Slot) -> None:
        """The slot back, after its W where the backward is split (its deferred weight gradients into the
        chunk's accumulators first), after its backward otherwise."""
        if slot.weight_graph is not None:
            slot.weight_graph.replay()
            self.dirty[chunk] = True
        slot.busy = False

    def flush(self) -> None:
        """Add each chunk's accumulated gradients into its parameters' ``.grad`` (a copy where ``.grad`` is
        None) and zero the accumulators: after the schedule's last backward, before anything reads the
        gradients (tied copies' sums, the data-parallel reduction). Gradients of eager microbatches went to
        ``.grad`` through autograd as usual; the two add up."""
        for chunk, module in enumerate(self.chunks):
            if not self.dirty[chunk]:
                continue
            params = dict(module.named_parameters())
            pairs = [(params[name], acc) for name, acc in self.accumulators[chunk].items()]
            with torch.no_grad():
                added = [(p.grad, acc) for p, acc in pairs if p.grad is not None]
                if added:  # one multi-tensor add over the chunk, not a kernel launch per parameter
                    torch._foreach_add_([g for g, _ in added], [acc for _, acc in added])
                for p, acc in pairs:
                    if p.grad is None:
                        p.grad = acc.clone()
            self._zero_accumulators(chunk)

    def reset(self) -> None:
        """Every slot free and nothing accumulated (after a step, also a failed one: its partial sums go)."""
        for entry in self.captured:
            for slot in entry[1] if entry is not None else ():
                slot.busy = False
        for chunk, dirty in enumerate(self.dirty):
            if dirty:
                self._zero_accumulators(chunk)

    def _zero_accumulators(self, chunk: int) -> None:
        accumulators = list(self.accumulators[chunk].values())
        if accumulators:  # (the multi-tensor ops refuse an empty list)
            with torch.no_grad():
                torch._foreach_zero_(accumulators)
        self.dirty[chunk] = False

    def clear(self) -> None:
        """Drop every captured graph, its memory pool (freed once nothing else holds it), the gradient
        accumulators and the weight-cast cache (the trainer's ``close()``: graphs' private pools are not
        otherwise returned before the engine is garbage-collected, which a reference cycle can delay)."""
        self.captured = [None] * len(self.chunks)
        self.accumulators = [{} for _ in self.chunks]
        self.casts = [{} for _ in self.chunks]
        self.dirty = [False] * len(self.chunks)
        self._wanted = [None] * len(self.chunks)

    def capture_pending(self) -> None:
        """Capture the specs noted since the last capture. Call it between steps, when none of this
        rank's messages is in flight (a capture synchronises the device)."""
        for chunk, spec in enumerate(self._wanted):
            if spec is None:
                continue
            module = self.chunks[chunk]
            if not spec.requires_grad and not any(p.requires_grad for p in module.parameters()):
                self.captured[chunk] = (None, [])  # nothing to differentiate (a frozen stage fed the batch): eager
                self._wanted[chunk] = None
                continue
            self._wanted[chunk] = None
            try:
                check_no_hooks([module])
                # The warm-up also finds the parameters that get a gradient: only those get an accumulator
                # (an unused one keeps .grad None, as eagerly).
                casts = linear_casts(module, spec.autocast) if spec.autocast is not None else {}
                self.casts[chunk] = casts
                self.refresh_casts()
                cached = {key: c for key, (_, c) in casts.items()}
                deferred = deferrable_linears(module) if self.split else ()
                used = _warm_up(module, spec, self.device, max(1, self.warmup), cached, deferred)
                params = dict(module.named_parameters())
                accumulators = {name: torch.zeros_like(params[name]) for name in used}
                made = [_Slot(module, spec, self.device, accumulators, self.split, cached)
                        for _ in range(self.slots[chunk])]
            except Exception as err:  # noqa: BLE001 - the step itself worked: this chunk stays eager
                # (rank-local: the graphs exchange nothing, so other ranks may replay theirs)
                warnings.warn(f"pipeline cuda_graphs: chunk {chunk} could not be captured, it runs eagerly: "
                              f"{type(err).__name__}: {err}", stacklevel=2)
                self.captured[chunk] = (None, [])
                self.casts[chunk] = {}
                continue
            self.captured[chunk] = (spec, made)
            self.accumulators[chunk] = accumulators
