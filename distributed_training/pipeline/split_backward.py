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

So every ``F.linear`` call (``nn.Linear`` calls it) whose weight is a leaf tensor that requires a
gradient (an `nn.Parameter`) goes, while a forward is recorded (`SplitBackward.record`), through
`_DeferredLinear`: an autograd Function with the same forward whose backward returns ``dx`` only and
hands ``(x, dy)`` to a queue, one queue per recorded forward (per microbatch and chunk in the engine).
`SplitBackward.weight_grad` (W) then runs the queued products and accumulates ``dW`` and ``db`` into
``.grad`` through autograd's own accumulation (``torch.autograd.backward`` on the parameters), so the
parameters' hooks run as in a plain backward (a data-parallel strategy's post-accumulate hooks), and
releases ``x`` and ``dy``. Everything else (LayerNorm, embeddings, biases of other layers,
attention's products of activations) gets its gradient in I as usual. The matmuls are the ones plain
autograd runs for `F.linear` (``dy.mm(W)`` and ``dy^T.mm(x)``), so I + W does the
work of one backward and the gradients equal a plain backward's up to the order in which the two
uses of a tied weight are added.

Interception. During `record`, every `nn.Linear` of the given modules (any module running
`nn.Linear`'s own forward) has its forward swapped, as an instance attribute removed on exit, for
one that goes through the Function: no cost for the other ops, and nothing changed outside `record`,
so a plain forward and backward behave as always. With ``functional=True`` a `TorchFunctionMode`
also catches every other ``F.linear`` call of the recorded forward, whoever makes it (a module
calling ``F.linear`` on a parameter of its own, a tied output head written functionally), at about
5 us of host time per torch call of the forward. Weights that are not leaves (computed in the
forward, or views of a flat buffer) and tensor subclasses go through plain ``F.linear``: their
gradient comes in I (correct, not deferred).

The Function takes the weight and bias as plain (non-differentiable) arguments: an autograd edge to
a parameter that receives no gradient in I would still run its accumulation node, firing its hooks
with nothing accumulated. When the input does not require a gradient (the first layer of a model fed
with data), a zero-element *anchor* tensor stands in as the Function's differentiable input, so that
the backward still reaches it.

Mixed precision. Under autocast, the Function does autocast's casts itself (input, weight and bias to
the autocast dtype, float64 left alone) and calls `F.linear` on the cast tensors, which autocast
passes through unchanged: the very ops autocast would run; the weight's cast is cached per parameter until `reset` (what autocast's cache does within one
autocast region), so the microbatches in flight share one low-precision copy. ``dx`` returns in the
input's dtype, ``dW`` and ``db`` are computed in the compute dtype and cast to the parameter's dtype
before accumulation, as autocast's graph does.

A backward of a recorded forward that runs outside `input_grad` (no deferral asked) computes the
weight gradients at once, inside that backward: recording alone never loses a gradient.

Not covered: weights used through other ops (``x @ w.t()``, ``torch.addmm``): their gradient comes in
I; activation checkpointing of a recorded forward (the recomputation would not go through the
Function); `torch.compile` of the recorded modules (the Function's queue is Python state).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Hashable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["SplitBackward"]

#: W accumulates its weight gradients into ``.grad`` whenever this many bytes of them are waiting. Each
#: accumulation is one call into autograd's engine (on CUDA a hand-over to its device thread, tens of
#: microseconds of host time): per layer that was about 50 calls per W for a GPT-1.3B stage.
_ACCUMULATE_BYTES = 256 * 2 ** 20


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes `F.linear` in on `device_type` now, or None when it is off."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except RuntimeError:  # a device type autocast does not know
        pass
    return None


def _no_autocast(device_type: str):
    """Autocast off for `device_type` (a no-op context when it is off already: the cheap common case)."""
    return torch.autocast(device_type, enabled=False) if _autocast_dtype(device_type) is not None else nullcontext()


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    # Autocast's eligibility rule: floating point, not float64, not already the dtype.
    if t is None or dtype is None or not t.is_floating_point() or t.dtype in (dtype, torch.float64):
        return t
    return t.to(dtype)


class _WeightGrad:
    """One linear layer's deferred weight-gradient work: ``x`` and ``dy`` until W consumes them."""

    __slots__ = ("x", "dy", "weight", "bias", "versions")

    def __init__(self, x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.x, self.dy, self.weight, self.bias = x, dy, weight, bias
        self.versions = (x._version, dy._version)

    def grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(parameter, gradient)`` pairs, the gradients in the parameters' dtypes; drops ``x`` and ``dy``."""
        x, dy = self.x, self.dy
        self.x = self.dy = None
        if (x._version, dy._version) != self.versions:
            raise RuntimeError("a tensor a deferred weight gradient needs was modified in place between the input "
                               "gradient (I) and the weight gradient (W)")
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])  # (N, in), (N, out)
        with _no_autocast(x.device.type):
            out = []
            if self.weight.requires_grad:
                # As autograd's addmm / mm backward computes it for F.linear's transposed weight: dy^T x.
                out.append((self.weight, dy2.t().mm(x2).to(self.weight.dtype)))  # (out, in)
            if self.bias is not None and self.bias.requires_grad:
                out.append((self.bias, dy2.sum(0).to(self.bias.dtype)))
        return out


def _accumulate(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Add each gradient to its parameter's ``.grad`` through autograd (hooks run, layouts kept)."""
    if pairs:
        torch.autograd.backward([p for p, _ in pairs], [g for _, g in pairs])


class _DeferredLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose backward returns the input gradient and queues the weight's.

    `anchor` (a zero-element tensor requiring grad, or None) makes the node part of the graph when `x`
    does not require a gradient. `params` is ``(weight, bias)``, passed inside a tuple so that autograd
    draws no edge to them."""

    @staticmethod
    def forward(ctx, x, anchor, params, store, key):
        weight, bias = params
        dtype = _autocast_dtype(x.device.type)
        if dtype is None:
            x_c, w_c, out = x, weight, F.linear(x, weight, bias)
        else:  # autocast passes tensors already in its dtype through: no autocast context needed (host time)
            x_c, w_c, b_c = _cast(x, dtype), store._cast_param(weight, dtype), store._cast_param(bias, dtype)
            out = F.linear(x_c, w_c, b_c)
        ctx.save_for_backward(x_c, w_c)
        ctx.x_dtype = x.dtype
        ctx.params, ctx.store, ctx.key = params, store, key
        return out

    @staticmethod
    def backward(ctx, dy):
        x_c, w_c = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            with _no_autocast(dy.device.type):
                dx = dy.reshape(-1, dy.shape[-1]).mm(w_c).reshape(x_c.shape).to(ctx.x_dtype)  # (N, out) @ (out, in)
        work = _WeightGrad(x_c, dy, *ctx.params)
        ctx.params = None
        store = ctx.store
        if store._deferring:
            store._queues.setdefault(ctx.key, []).append(work)
        else:  # a backward without I/W: the weight gradients now
            _accumulate(work.grads())
        return dx, None, None, None, None


def _linear(store: "SplitBackward", key: Hashable, x, weight, bias):
    """``F.linear(x, weight, bias)``, through `_DeferredLinear` when its weight gradient can be deferred."""
    if torch.is_grad_enabled() and store._deferrable(x, weight, bias):
        anchor = None if x.requires_grad else store._anchor(x.device)
        return _DeferredLinear.apply(x, anchor, (weight, bias), store, key)
    return F.linear(x, weight, bias)


class _RecordFunctional(TorchFunctionMode):
    """Sends every `F.linear` call of a forward to `_linear` (``functional=True``)."""

    def __init__(self, store: "SplitBackward", key: Hashable) -> None:
        super().__init__()
        self.store, self.key = store, key

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            given = dict(zip(("input", "weight", "bias"), args), **(kwargs or {}))
            return _linear(self.store, self.key, given["input"], given["weight"], given.get("bias"))
        return func(*args, **(kwargs or {}))


def _swapped_forward(store: "SplitBackward", key: Hashable, module: nn.Linear):
    def forward(input: torch.Tensor) -> torch.Tensor:
        return _linear(store, key, input, module.weight, module.bias)

    return forward


class SplitBackward:
    """Deferred weight gradients of the linear layers of recorded forwards (I/W split backwards).

    Args:
        modules: the modules whose `nn.Linear` layers (any module whose forward is `nn.Linear`'s) defer
            their weight gradients: during `record` each one's forward is swapped (an instance
            attribute, removed on exit) for one going through `_DeferredLinear`. No cost for other ops.
        functional: also catch every other ``F.linear`` call of the recorded forward (a module calling
            it with its own parameter, a tied head written functionally), through a `TorchFunctionMode`:
            about 5 us of host time per torch call of the forward (measured on CPU), which matters for
            small layers only.

    Usage, per microbatch (the engine does this for schedules with ``I`` and ``W`` actions)::

        split = SplitBackward([stage])
        with split.record(key):            # F: linear layers go through the deferring Function
            out = stage(x)
        with split.input_grad():           # I: input gradients; linear weight gradients queued under key
            out.backward(grad)
        ...
        split.weight_grad(key)             # W: the queued weight gradients, accumulated into .grad
        split.reset()                      # end of step: nothing may be left; casts dropped

    `key` is any hashable naming the forward (the engine uses ``(microbatch, chunk)``). Nothing here
    holds state between steps once `reset` ran.
    """

    def __init__(self, modules: Sequence[nn.Module] | nn.Module = (), *, functional: bool = False) -> None:
        if isinstance(modules, nn.Module):
            modules = [modules]
        modules = list(modules)
        for i, m in enumerate(modules):
            if not isinstance(m, nn.Module):
                raise TypeError(f"modules[{i}] must be an nn.Module, got {type(m).__name__}")
        if not isinstance(functional, bool):
            raise TypeError(f"functional must be a bool, got {functional!r}")
        self.modules = modules
        self.functional = functional
        self._queues: dict[Hashable, list[_WeightGrad]] = {}
        self._deferring = False
        self._recording = False
        self._linears: list[nn.Linear] | None = None
        self._anchors: dict[torch.device, torch.Tensor] = {}
        self._casts: dict[tuple[int, torch.dtype], tuple[torch.Tensor, int, torch.Tensor]] = {}

    # ------------------------------------------------------------------------------------------ phases

    @contextmanager
    def record(self, key: Hashable) -> Iterator[None]:
        """A forward whose linear layers' weight gradients can be deferred, their work queued under `key`."""
        if self._recording:
            raise RuntimeError("SplitBackward.record() is already active (nested recorded forwards)")
        if self._linears is None:  # found once per step (until reset): the modules may change between steps
            self._linears = self._find_linears()
        swapped = []
        for m in self._linears:
            if "forward" not in m.__dict__:  # not given an instance forward by someone else
                object.__setattr__(m, "forward", _swapped_forward(self, key, m))
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

    def weight_grad(self, key: Hashable) -> int:
        """Run the weight-gradient work queued under `key` (``W``): each deferred layer's ``dW`` and ``db``
        accumulate into ``.grad`` (through autograd: the parameters' hooks run), then the tensors it held
        are released. Returns how many layers' work ran (0 when nothing was queued under `key`)."""
        work = self._queues.pop(key, [])
        pairs, size = [], 0
        for item in work:
            for param, grad in item.grads():
                pairs.append((param, grad))
                size += grad.numel() * grad.element_size()
            # One autograd call for many small layers (host time), but never a whole stage's gradients
            # waiting at once (memory): a plain backward frees each gradient once accumulated.
            if size >= _ACCUMULATE_BYTES:
                _accumulate(pairs)
                pairs, size = [], 0
        _accumulate(pairs)
        return len(work)

    def queued(self, key: Hashable) -> int:
        """How many layers' weight-gradient work waits under `key`."""
        return len(self._queues.get(key, ()))

    def pending(self) -> list[Hashable]:
        """The keys with queued work not run yet."""
        return [key for key, work in self._queues.items() if work]

    def reset(self) -> None:
        """Drop everything: queued work (its gradients are lost), the cached casts of the weights."""
        self._queues.clear()
        self._casts.clear()
        self._linears = None
        self._deferring = False

    # ---------------------------------------------------------------------------------------- internals

    def _find_linears(self) -> list[nn.Linear]:
        """The layers running nn.Linear's own forward (a subclass overriding it is left alone), once each."""
        found: dict[int, nn.Linear] = {}
        for root in self.modules:
            for m in root.modules():
                if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward:
                    found.setdefault(id(m), m)
        return list(found.values())

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

    def _cast_param(self, t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
        """`t` in the compute dtype, cast once per parameter (and per in-place update) until `reset`."""
        if t is None or dtype is None or t.dtype == dtype:
            return t
        key = (id(t), dtype)
        hit = self._casts.get(key)  # looked up before casting: a cast is a kernel and a new tensor
        if hit is not None and hit[0] is t and hit[1] == t._version:
            return hit[2]
        cast = _cast(t, dtype)
        if cast is not t:
            self._casts[key] = (t, t._version, cast)
        return cast
