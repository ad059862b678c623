"""Split backward for zero-bubble schedules: the input gradient now, the weight gradients later.

A stage's backward does two kinds of work. The gradient with respect to the stage's *input* is on
the pipeline's critical path: the previous stage waits for it. The gradients with respect to the
*weights* are needed only by the optimizer step. ZB-H1 (`schedules.py`) runs them as two actions:
``I`` computes the input gradient and sends it back at once; ``W``, later, computes the weight
gradients, where the rank would otherwise sit idle.

Splitting them with autograd alone (``torch.autograd.grad(out, x)``, then ``backward(inputs=params)``)
does the backward twice: the second pass walks the whole graph again and recomputes every input-side
gradient. The saving comes from the layers where the weight gradient is an expensive product of its
own: the matmuls. For ``y = x W^T + b`` (with ``x`` flattened to ``(N, in)``)::

    dx = dy W            needed by the layer below: done in I
    dW = dy^T x          needed only by the optimizer: deferred to W
    db = dy.sum(0)       deferred with it

Two ways to get ``dy`` without the weight's product, both while a forward is recorded
(`SplitBackward.record(key)`, the engine's F, key ``(microbatch, chunk)``), both by swapping the
forward of each `nn.Linear` of the given modules (any module running `nn.Linear`'s own forward) for an
instance attribute removed on exit: nothing changes outside `record`, and no other op pays anything.

Capture (the default). The swapped forward is plain ``F.linear``; it only notes the layer's input
``x`` (as the matmul sees it: under autocast it does autocast's casts itself, see below) and its
output ``y``. The I (`SplitBackward.backward_input`) is one ``torch.autograd.grad`` of the stage's
output for: the stage's input, the captured outputs ``y`` and every other parameter of the modules
that requires a gradient, but not the captured weights and biases. Autograd's generated backward of
``addmm`` / ``mm`` computes only the gradients its next nodes need, so the captured weights' matmuls
are skipped, while the engine hands back each ``y``'s ``dy`` (the very tensor, no copy) and the other
parameters' gradients, which then accumulate through autograd's engine (their hooks run, once, as in
a plain backward). Where one of those parameters has tensor hooks (``register_hook``), which
``autograd.grad`` would run and the accumulation again, I is instead one ``backward(inputs=...)``
(the same parameters and outputs: hooks once, but autograd copies each ``dy`` into ``y.grad``). The W (`SplitBackward.weight_grad`) computes ``dW = dy^T x`` and
``db = dy.sum(0)`` with the matmuls of autograd's addmm / mm backward and accumulates them through
autograd's engine (``backward`` on the parameters: their hooks run as in a plain backward, a
data-parallel strategy's post-accumulate hooks), releasing ``x`` and ``dy``. Layers of one shape (a
transformer's blocks repeat a few) are computed together: their ``x`` and ``dy`` stacked, one batched
matmul and one sum (`linear_split.batched_grads`). So I + W does the matmul work of one backward: the
gradients equal a plain backward's bit for bit (CPU tests, fp32 and bf16). Host time: a few us per
layer in F (the bookkeeping), nothing per layer inside I's backward, and a few Python calls per layer
shape in W (the plain backward runs its ops in C++; W's Python was ZB-H1's extra host time on a GPU).

Where capture would be wrong, the layer takes the Function's path (below) or is not deferred:

* a weight or bias registered in another module too (the GPT's tied embedding and head on one stage):
  its other use's gradient would be skipped in I; such layers go through the Function (found by
  parameter identity over ``modules()`` once per step);
* a layer's output modified in place after the layer (``ReLU(inplace=True)``): ``y``'s gradient is no
  longer the layer's; its weight and bias are then asked for in I (gradient in I, not deferred);
* a step where some parameter of the modules is not a plain leaf or a linear layer's weight is not a
  registered parameter (FSDP's views of a flat buffer, so ZeRO-3 inside stages): the gradient goes to
  tensors a captured I would not know, so nothing is captured that step (the Function's path, which
  leaves non-leaf weights to plain ``F.linear``, gradients in I);
* a weight replaced during the step, an input that is a tensor subclass: that forward's I is a plain
  backward (its captured layers get their gradients in I).

What capture assumes, checked on the graph of each step's first captured forward (`_inspect`, one walk
of its nodes): the leaves that need a gradient are the modules' parameters and the stage's input (a
tensor requiring a gradient kept as a plain attribute, or a loss with parameters, would get no gradient
in a captured I), and a captured layer's weight and bias reach the graph through that layer's calls
only (``F.linear(x, lin.weight)`` or ``x @ lin.weight.t()`` elsewhere, a tied autoencoder's decoder:
that use's gradient would be lost in I). Where either fails, the rest of that step's I passes are
plain backwards (every gradient in I, none lost); from the next step such a layer goes through the
Function (its own product still deferred, the other uses' gradients in I), and an unknown leaf turns
capture off. A use that appears in later microbatches of a step only is not seen.

The Function (``capture=False``, ``functional=True``, and the fallbacks above). The swapped forward goes
through `_DeferredLinear`, an autograd Function with the same forward whose backward returns ``dx``
only and queues ``(x, dy)`` under its key while `input_grad` is active (a captured I activates it).
About 30 us of host time per layer in F and as much in I on a GPU host: the Python Function and its
Python backward. With ``functional=True`` a `TorchFunctionMode` also catches every other ``F.linear``
call of the recorded forward, whoever makes it (a module calling ``F.linear`` on a parameter of its
own, a tied output head written functionally), at about 5 us of host time per torch call of the
forward. Weights that are not leaves (computed in the forward, or views of a flat buffer) and tensor
subclasses go through plain ``F.linear``: their gradient comes in I (correct, not deferred). The
Function takes the weight and bias as plain (non-differentiable) arguments: an autograd edge to a
parameter that receives no gradient in I would still run its accumulation node, firing its hooks
with nothing accumulated. When the input does not require a gradient (the first layer of a model fed
with data), a zero-element *anchor* tensor stands in as the Function's differentiable input, so that
the backward still reaches it (a captured I asks for its gradient too). With a weight shared with
another module, the gradients equal a plain backward's up to the order in which its uses are added.

Mixed precision. Under autocast, both paths do autocast's casts themselves (input, weight and bias to
the autocast dtype, float64 left alone) and call `F.linear` on the cast tensors, which autocast passes
through unchanged: the very ops autocast would run. The weight's cast is cached per parameter until
`reset` (what autocast's cache does within one autocast region), so the microbatches in flight share
one low-precision copy (capture keeps the cast differentiable, the graph reaches the weight through
it). ``dx`` returns in the input's dtype, ``dW`` and ``db`` are computed in the compute dtype and cast
to the parameter's dtype on accumulation, as autocast's graph does.

A backward of a recorded forward that is not a `backward_input` and runs outside `input_grad` computes
the weight gradients at once: recording alone never loses a gradient. The older I, ``out.backward()``
under `input_grad`, still works: the Function's layers are deferred, captured layers get their weight
gradients in it (nothing deferred for them, nothing lost).

Not covered: weights used through other ops (``x @ w.t()``, ``torch.addmm``): their gradient comes in
I; activation checkpointing of a recorded forward (the recomputation would not be recorded: a layer
given an instance forward, as `activation.checkpoint_module` does, is left alone, and a graph through a
reentrant checkpoint, which refuses a captured I's ``inputs=``, turns capture off: plain I passes);
`torch.compile` of the recorded modules (the records are Python state).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Hashable, Iterator, Sequence

import torch
from torch import nn

from .linear_split import (_accumulate, _captured_forward, _cast, _no_autocast, _RecordFunctional,
                           _swapped_forward, _WeightGrad, batched_grads)

__all__ = ["SplitBackward"]

#: W accumulates its weight gradients into ``.grad`` whenever this many bytes of them are waiting. Each
#: accumulation is one call into autograd's engine (on CUDA a hand-over to its device thread, tens of
#: microseconds of host time): per layer that was about 50 calls per W for a GPT-1.3B stage.
_ACCUMULATE_BYTES = 256 * 2 ** 20


class SplitBackward:
    """Deferred weight gradients of the linear layers of recorded forwards (I/W split backwards).

    Args:
        modules: the modules whose `nn.Linear` layers (any module whose forward is `nn.Linear`'s) defer
            their weight gradients: during `record` each one's forward is swapped (an instance
            attribute, removed on exit) for a capturing one or one going through `_DeferredLinear`
            (the module docstring). No cost for other ops.
        functional: also catch every other ``F.linear`` call of the recorded forward (a module calling
            it with its own parameter, a tied head written functionally), through a `TorchFunctionMode`:
            about 5 us of host time per torch call of the forward (measured on CPU), which matters for
            small layers only. Every layer then goes through the Function (no capture).
        capture: capture the layers where it is safe (default True; the module docstring): plain
            ``F.linear`` in F and one backward in I, a fraction of the Function's host time. False:
            every layer through the Function, for models whose leaves capture cannot see.

    Usage, per microbatch (the engine does this for schedules with ``I`` and ``W`` actions)::

        split = SplitBackward([stage])
        with split.record(key):            # F: linear layers noted (or through the deferring Function)
            out = stage(x)
        dx = split.backward_input(key, out, grad, x)  # I: input gradients; weight gradients kept under key
        ...
        split.weight_grad(key)             # W: the queued weight gradients, accumulated into .grad
        split.reset()                      # end of step: nothing may be left; casts dropped

    `key` is any hashable naming the forward (the engine uses ``(microbatch, chunk)``). Nothing here
    holds state between steps once `reset` ran, but whether the modules' graph goes through a reentrant
    activation checkpoint (looked for once).
    """

    def __init__(self, modules: Sequence[nn.Module] | nn.Module = (), *, functional: bool = False,
                 capture: bool = True) -> None:
        if isinstance(modules, nn.Module):
            modules = [modules]
        modules = list(modules)
        for i, m in enumerate(modules):
            if not isinstance(m, nn.Module):
                raise TypeError(f"modules[{i}] must be an nn.Module, got {type(m).__name__}")
        if not isinstance(functional, bool):
            raise TypeError(f"functional must be a bool, got {functional!r}")
        if not isinstance(capture, bool):
            raise TypeError(f"capture must be a bool, got {capture!r}")
        self.modules = modules
        self.functional = functional
        self.capture = capture
        self._queues: dict[Hashable, list[_WeightGrad]] = {}
        self._deferring = False
        self._recording = False
        self._linears: list[nn.Linear] | None = None
        self._anchors: dict[torch.device, torch.Tensor] = {}
        self._casts: dict[tuple[int, torch.dtype], tuple[torch.Tensor, int, torch.Tensor]] = {}
        self._grad_casts: dict[tuple[int, torch.dtype], tuple[torch.Tensor, int, torch.Tensor]] = {}
        # Capture mode, planned once per step (until reset): id(linear) -> (weight, bias) for the layers
        # captured; the other parameters that require a gradient (the inputs of a captured I).
        self._plan: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._others: list[torch.Tensor] = []
        self._hooked = False  # some of `_others` has tensor hooks (``register_hook``): see backward_input
        # key -> [(x, x's version, y, y's version, weight, bias)] from F to I; key -> work from I to W.
        self._captures: dict[Hashable, list[tuple]] = {}
        self._ready: dict[Hashable, list[_WeightGrad]] = {}
        self._uncaptured: set[Hashable] = set()  # forwards whose I must be a plain backward
        self._anchored: set[Hashable] = set()    # forwards whose Function calls hang on an anchor
        # Whether the modules' graph holds a reentrant activation checkpoint (``use_reentrant=True``), which
        # refuses the ``inputs=`` of a captured I: then no capture (kept across steps; None: not looked yet).
        self._reentrant: bool | None = None
        # What the step's first captured I finds in its graph (`_inspect`): weights and biases (ids) that
        # are also used outside their layer (never captured again: the Function's path), and whether some
        # leaf outside the modules' parameters needs a gradient (capture off from then on). Either makes
        # the rest of that step's I passes plain backwards.
        self._inspected = False
        self._plain_step = False
        self._used_elsewhere: set[int] = set()
        self._foreign_leaf = False

    # ------------------------------------------------------------------------------------------ phases

    @contextmanager
    def record(self, key: Hashable) -> Iterator[None]:
        """A forward whose linear layers' weight gradients can be deferred, their work queued under `key`."""
        if self._recording:
            raise RuntimeError("SplitBackward.record() is already active (nested recorded forwards)")
        if self._linears is None:  # found once per step (until reset): the modules may change between steps
            self._linears = self._find_linears()
            self._plan_capture()
        captures = self._captures.setdefault(key, [])
        swapped = []
        for m in self._linears:
            if "forward" in m.__dict__:  # given an instance forward since the plan (activation checkpointing)
                if id(m) in self._plan:  # planned as captured, it is not: its gradient must come in a plain I
                    self._uncaptured.add(key)
            else:
                planned = self._plan.get(id(m))
                forward = (_swapped_forward(self, key, m) if planned is None
                           else _captured_forward(self, key, m, *planned, captures))
                object.__setattr__(m, "forward", forward)
                swapped.append(m)
        self._recording = True
        try:
            if self.functional:
                with _RecordFunctional(self, key):
                    yield
            else:
                yield
        finally:
            self._recording = False
            for m in swapped:
                del m.__dict__["forward"]
            if not captures:
                del self._captures[key]

    @contextmanager
    def input_grad(self) -> Iterator[None]:
        """Backwards run inside defer the weight gradients of recorded linear layers (``I``)."""
        if self._deferring:
            raise RuntimeError("SplitBackward.input_grad() is already active (nested I passes)")
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    def backward_input(self, key: Hashable, out: torch.Tensor, grad: torch.Tensor | None = None,
                       x: torch.Tensor | None = None) -> torch.Tensor | None:
        """The input-gradient pass (``I``) of the forward recorded under `key`: ``out.backward(grad)`` with the
        weight gradients of its recorded linear layers deferred to ``weight_grad(key)``. Returns the
        gradient with respect to `x` (the forward's input; None when it is not given, needs no gradient or
        got none). Every other gradient accumulates into ``.grad`` as in a plain backward, hooks included.

        Captured layers (see the class): one backward with ``inputs=`` `x`, the layers' outputs and the
        other parameters, so autograd computes each captured output's gradient ``dy`` and skips the
        matmuls of the captured weights (nothing asked their gradient). Otherwise (nothing captured,
        or a forward that went elsewhere) a plain backward under `input_grad`."""
        captures = self._captures.pop(key, None)
        want_x = x is not None and x.requires_grad
        if captures is not None and not self._inspected:  # the step's first captured I looks at its graph
            self._inspected = True
            self._inspect(out, captures, x)
        if captures is None or key in self._uncaptured or self._reentrant or self._plain_step:
            self._uncaptured.discard(key)
            self._anchored.discard(key)
            if want_x and not x.is_leaf:
                x.retain_grad()
            with self.input_grad():
                torch.autograd.backward(out, grad)
            return x.grad if want_x else None
        inputs = [x] if want_x else []
        armed, extra = [], []
        for c in captures:
            if c[2]._version == c[3]:
                armed.append(c)
                inputs.append(c[2])
            else:  # the output was modified in place after the layer: its gradient is not the layer's dy, so
                extra.append(c[4])  # this layer's weight gradient is computed in I (no deferral, correct)
                if c[5] is not None and c[5].requires_grad:
                    extra.append(c[5])
        rest = self._others + extra  # parameters: their gradients accumulate in I
        anchors = list(self._anchors.values()) if key in self._anchored else []
        self._deferring = True
        try:
            if self._hooked:  # a backward accumulating in place: hooks once, but each dy a copy (retain_grad)
                torch.autograd.backward(out, grad, inputs=inputs + rest + anchors)
                dx = x.grad if want_x else None
                dys = []
                for c in armed:
                    dys.append(c[2].grad)
                    c[2].grad = None
            else:  # the engine hands back each dy itself (no copy); the parameters' gradients accumulate after
                got = torch.autograd.grad(out, inputs + rest + anchors, grad, allow_unused=True)
                dx = got[0] if want_x else None
                n = len(inputs)
                dys = got[n - len(armed):n]
                params, grads = [], []
                for p, g in zip(rest, got[n:n + len(rest)]):
                    if g is not None:
                        params.append(p)
                        grads.append(g)
                _accumulate(params, grads)  # hooks and the data-parallel strategy's callbacks, as in backward
        finally:
            self._deferring = False
            self._anchored.discard(key)
        ready = self._ready.setdefault(key, [])
        for (x_c, x_version, _, _, weight, bias), dy in zip(armed, dys):
            if dy is not None:  # None: the output did not reach `out` (no gradient in a plain backward either)
                ready.append(_WeightGrad(x_c, dy, weight, bias, x_version))
        if not ready:
            del self._ready[key]
        return dx

    def weight_grad(self, key: Hashable) -> int:
        """Run the weight-gradient work queued under `key` (``W``): each deferred layer's ``dW`` and ``db``
        accumulate into ``.grad`` (through autograd: the parameters' hooks run), then the tensors it held
        are released. Returns how many layers' work ran (0 when nothing was queued under `key`)."""
        work = self._queues.pop(key, [])
        ready = self._ready.pop(key, None)
        if ready:  # captured layers, last layer first as a backward reaches them
            work.extend(reversed(ready))
        if not work:
            return 0
        params, grads, size = [], [], 0
        groups: dict[tuple, list[_WeightGrad]] = {}  # layers of one shape (a block's qkv, ... in every block)
        for item in work:
            groups.setdefault(item.group_key(), []).append(item)
        with _no_autocast(work[0].dy.device.type):
            for items in groups.values():
                size += items[0].grads(params, grads) if len(items) == 1 else batched_grads(items, params, grads)
                # One autograd call for many small layers (host time), but never a whole stage's gradients
                # waiting at once (memory): a plain backward frees each gradient once accumulated.
                if size >= _ACCUMULATE_BYTES:
                    _accumulate(params, grads)
                    params, grads, size = [], [], 0
        _accumulate(params, grads)
        return len(work)

    def queued(self, key: Hashable) -> int:
        """How many layers' weight-gradient work waits under `key`."""
        return len(self._queues.get(key, ())) + len(self._ready.get(key, ()))

    def pending(self) -> list[Hashable]:
        """The keys with queued work not run yet."""
        return list(dict.fromkeys([key for key, work in self._queues.items() if work] + list(self._ready)))

    def reset(self) -> None:
        """Drop everything: queued work (its gradients are lost), the cached casts of the weights."""
        self._queues.clear()
        self._casts.clear()
        self._grad_casts.clear()
        self._captures.clear()
        self._ready.clear()
        self._uncaptured.clear()
        self._anchored.clear()
        self._plan, self._others, self._hooked = {}, [], False
        self._linears = None
        self._deferring = False
        self._inspected = self._plain_step = False

    # ---------------------------------------------------------------------------------------- internals

    def _find_linears(self) -> list[nn.Linear]:
        """The layers running nn.Linear's own forward (a subclass overriding it is left alone), once each."""
        found: dict[int, nn.Linear] = {}
        for root in self.modules:
            for m in root.modules():
                # (Nor one given an instance forward: activation checkpointing's, a user's patch.)
                if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward and "forward" not in m.__dict__:
                    found.setdefault(id(m), m)
        return list(found.values())

    def _plan_capture(self) -> None:
        """Which of `_linears` are captured this step, and the other parameters a captured I asks for.

        A layer is captured when its weight (and bias) is a plain leaf parameter that requires a gradient
        and is registered in no other module (a tied weight's other use would lose its gradient in I or
        the layer's own would count twice): the others go through the Function. No capture at all this
        step where a parameter of the modules is not a plain leaf, or a linear layer's weight is not a
        registered parameter (FSDP's views of a flat buffer: the gradient flows to tensors we do not
        know, so I must be a plain backward)."""
        self._plan, self._others, self._hooked = {}, [], False
        if self.functional or not self.capture or self._reentrant or self._foreign_leaf:
            return
        params: dict[int, torch.Tensor] = {}
        uses: dict[int, int] = {}
        for root in self.modules:
            for m in root.modules():
                for p in m._parameters.values():
                    if p is not None:
                        params[id(p)] = p
                        uses[id(p)] = uses.get(id(p), 0) + 1
        if not all(type(p) in (torch.Tensor, nn.Parameter) and p.is_leaf for p in params.values()):
            return
        plan = {}
        for m in self._linears:
            weight, bias = m.weight, m.bias
            if id(weight) not in params or (bias is not None and id(bias) not in params):
                return
            if weight.requires_grad and uses[id(weight)] == 1 and (bias is None or uses[id(bias)] == 1) \
                    and not {id(weight), id(bias)} & self._used_elsewhere:
                plan[id(m)] = (weight, bias)
        deferred = {id(t) for pair in plan.values() for t in pair if t is not None}
        self._plan = plan
        self._others = [p for i, p in params.items() if p.requires_grad and i not in deferred]
        # ``autograd.grad`` runs a leaf's tensor hooks on the gradient it returns, and accumulating it runs
        # them again: where one has such hooks, I is a backward accumulating in place (each dy copied).
        self._hooked = any(getattr(p, "_backward_hooks", None) for p in self._others)

    def _inspect(self, out: torch.Tensor, captures: list, x: torch.Tensor | None) -> None:
        """Check what capture assumes, on the graph of the step's first captured forward (one walk of it):
        every leaf that needs a gradient is a parameter of the modules or the stage's input, and every
        captured weight and bias reaches the graph through its own layer's calls only (``F.linear(h,
        layer.weight)`` elsewhere, a tied autoencoder's decoder, would lose its gradient in a captured I).
        A weight used elsewhere goes through the Function from the next step on (its layer's product
        deferred, the other uses' gradients in I); an unknown leaf turns capture off; either way this
        step's I passes are plain backwards (every gradient right, nothing of the step deferred for
        them). Also finds a reentrant checkpoint (looked for once)."""
        into, leaves, reentrant = _leaf_edges(out)  # leaf id -> the graph's nodes with an edge into it
        self._reentrant = reentrant or bool(self._reentrant)
        if self._reentrant:
            return
        # Each captured call's own nodes: from its output back to its input (not beyond) and its parameters.
        # (A call whose output was modified in place since is not deferred: its weight's gradient comes in I.)
        armed = [c for c in captures if c[2]._version == c[3]]
        own: dict[int, set] = {}
        for c in armed:
            for i, nodes in _leaf_edges(c[2], stop=c[0].grad_fn)[0].items():
                own.setdefault(i, set()).update(nodes)
        captured = {id(t) for c in armed for t in (c[4], c[5]) if t is not None}
        elsewhere = {i for i in captured if not into.get(i, set()) <= own.get(i, set())}
        known = {id(p) for root in self.modules for p in root.parameters()} | {id(a) for a in self._anchors.values()}
        if x is not None:
            known.add(id(x))
        foreign = [leaf for i, leaf in leaves.items() if i not in known]
        if elsewhere or foreign:
            self._used_elsewhere |= elsewhere
            self._foreign_leaf = self._foreign_leaf or bool(foreign)
            self._plain_step = True

    @staticmethod
    def _deferrable(x, weight, bias) -> bool:
        def plain(t):
            return type(t) in (torch.Tensor, torch.nn.Parameter)

        if not (plain(x) and plain(weight) and (bias is None or plain(bias))):
            return False
        if not (weight.is_leaf and weight.requires_grad):
            return False
        # A bias computed in the forward (not a leaf) would need its own graph: leave such a call plain.
        return bias is None or bias.is_leaf or not bias.requires_grad

    def _anchor(self, device: torch.device) -> torch.Tensor:
        anchor = self._anchors.get(device)
        if anchor is None:
            anchor = self._anchors[device] = torch.empty(0, device=device, requires_grad=True)
        return anchor

    def _cast_param(self, t: torch.Tensor | None, dtype: torch.dtype | None,
                    differentiable: bool = False) -> torch.Tensor | None:
        """`t` in the compute dtype, cast once per parameter (and per in-place update) until `reset`.
        `differentiable`: the cast made with autograd recording (capture mode, where the graph reaches the
        parameter through it), kept apart from the Function's casts, made without."""
        if t is None or dtype is None or t.dtype == dtype:
            return t
        key = (id(t), dtype)
        casts = self._grad_casts if differentiable else self._casts
        hit = casts.get(key)  # looked up before casting: a cast is a kernel and a new tensor
        if hit is not None and hit[0] is t and hit[1] == t._version:
            return hit[2]
        cast = _cast(t, dtype)
        if cast is not t:
            casts[key] = (t, t._version, cast)
        return cast


def _leaf_edges(out: torch.Tensor, stop=None) -> tuple[dict[int, set], dict[int, torch.Tensor], bool]:
    """One walk of `out`'s backward graph, not past the node `stop`: (leaf id -> the nodes with an edge
    into that leaf's gradient accumulation, leaf id -> leaf, whether a reentrant checkpoint was met)."""
    into: dict[int, set] = {}
    leaves: dict[int, torch.Tensor] = {}
    reentrant = False
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen or node is stop:
            continue
        seen.add(node)
        reentrant = reentrant or type(node).__name__ == "CheckpointFunctionBackward"
        for next_node, _ in node.next_functions:
            leaf = getattr(next_node, "variable", None)  # an AccumulateGrad node
            if leaf is not None:
                leaves[id(leaf)] = leaf
                into.setdefault(id(leaf), set()).add(node)
            elif next_node is not None:
                todo.append(next_node)
    return into, leaves, reentrant

