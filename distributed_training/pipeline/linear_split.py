"""The per-layer pieces of the split backward (`split_backward.SplitBackward` drives them; its module
docstring says how I and W use them): the autocast helpers, one linear layer's deferred
weight-gradient work (`_WeightGrad`), the autograd Function that defers it (`_DeferredLinear`, the
Function path, with `_linear`, `_RecordFunctional` and `_swapped_forward` routing calls to it) and the
capture path's forward (`_captured_forward`: plain ``F.linear``, noting input and output)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Hashable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from .split_backward import SplitBackward

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

    def __init__(self, x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 x_version: int | None = None) -> None:
        self.x, self.dy, self.weight, self.bias = x, dy, weight, bias
        self.versions = (x._version if x_version is None else x_version, dy._version)

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, dy)``, checked unmodified since they were noted, and dropped from this item."""
        x, dy = self.x, self.dy
        self.x = self.dy = None
        if x._version != self.versions[0] or dy._version != self.versions[1]:
            raise RuntimeError("a tensor a deferred weight gradient needs (a linear layer's input or output "
                               "gradient) was modified in place before the weight gradient (W) used it")
        return x, dy

    def group_key(self) -> tuple:
        """Items with equal keys can be computed as one batched matmul (`batched_grads`)."""
        x, dy, weight, bias = self.x, self.dy, self.weight, self.bias
        return (x.shape, x.dtype, dy.shape, dy.dtype, x.device, weight.dtype, weight.requires_grad,
                None if bias is None else (bias.dtype, bias.requires_grad))

    def grads(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> int:
        """Appends the ``(parameter, gradient)`` pairs to `params` and `grads`; drops ``x`` and ``dy``;
        returns the gradients' bytes in the parameters' dtypes. The gradients are in the compute dtype:
        autograd's engine casts each to its parameter's dtype on the way in (what autocast's graph does
        with a ``ToCopyBackward``, the same cast), saving a Python call per tensor. Autocast must be off
        (W: the caller turns it off once for all its layers: host time)."""
        x, dy = self.take()
        if x.dim() != 2:
            x, dy = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])  # (N, in), (N, out)
        size = 0
        weight, bias = self.weight, self.bias
        if weight.requires_grad:
            # As autograd's addmm / mm backward computes it for F.linear's transposed weight: dy^T x.
            g = dy.t().mm(x)  # (out, in)
            params.append(weight)
            grads.append(g)
            size += g.numel() * weight.element_size()
        if bias is not None and bias.requires_grad:
            params.append(bias)
            grads.append(dy.sum(0))
        return size


def batched_grads(items: list[_WeightGrad], params: list[torch.Tensor], grads: list[torch.Tensor]) -> int:
    """`_WeightGrad.grads` for several layers of one `group_key` at once: their inputs and output
    gradients stacked, ``dW`` of all of them by one batched matmul and ``db`` by one sum, each cast once
    to the parameters' dtype. A W of a GPT stage runs the same few layer shapes once per block: this
    makes its host time a few calls per shape instead of about ten per layer (on a GPU host the W was
    the pipeline's critical path). Each layer's result is that layer's own matmul (bit for bit on CPU);
    the stacks are transient copies of the layers' ``x`` and ``dy``, which are released on return."""
    taken = [item.take() for item in items]
    xs = torch.stack([x for x, _ in taken])
    dys = torch.stack([dy for _, dy in taken])
    del taken
    if xs.dim() != 3:  # (layers, ..., features) -> (layers, N, features), a 1-D input's N being 1
        xs, dys = xs.reshape(len(items), -1, xs.shape[-1]), dys.reshape(len(items), -1, dys.shape[-1])
    first = items[0]
    size = 0
    if first.weight.requires_grad:
        g = torch.bmm(dys.transpose(1, 2), xs)  # (layers, out, in): each layer's dy^T x
        if g.dtype != first.weight.dtype:
            g = g.to(first.weight.dtype)  # the cast autograd's engine would make per tensor
        params.extend(item.weight for item in items)
        grads.extend(g.unbind(0))
        size += g.numel() * g.element_size()
    if first.bias is not None and first.bias.requires_grad:
        b = dys.sum(1)
        if b.dtype != first.bias.dtype:
            b = b.to(first.bias.dtype)
        params.extend(item.bias for item in items)
        grads.extend(b.unbind(0))
    return size


#: Autograd's engine without `torch.autograd.backward`'s Python checks of each (tensor, gradient) pair
#: (about 5 us each on CPU: a W hands it two per layer): our gradients have the parameters' shapes and
#: dtypes by construction. The public function where a torch lacks it.
_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)


def _accumulate(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Add each gradient to its parameter's ``.grad`` through autograd (hooks run, layouts kept)."""
    if not params:
        return
    if _run_backward is None:
        torch.autograd.backward(params, grads)
    else:
        _run_backward(tuple(params), tuple(grads), False, False, (), allow_unreachable=True, accumulate_grad=True)


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
            params, grads = [], []
            with _no_autocast(dy.device.type):
                work.grads(params, grads)
            _accumulate(params, grads)
        return dx, None, None, None, None


def _linear(store: "SplitBackward", key: Hashable, x, weight, bias):
    """``F.linear(x, weight, bias)``, through `_DeferredLinear` when its weight gradient can be deferred."""
    if torch.is_grad_enabled() and store._deferrable(x, weight, bias):
        anchor = None
        if not x.requires_grad:
            anchor = store._anchor(x.device)
            store._anchored.add(key)  # a captured I must ask for the anchor's gradient, or the node never runs
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


def _captured_forward(store: "SplitBackward", key: Hashable, module: nn.Linear, weight: torch.Tensor,
                      bias: torch.Tensor | None, captures: list):
    """`module`'s forward in capture mode: plain `F.linear`, noting the input as the matmul sees it and the
    output under `key` (a few us of host time on top of `F.linear`)."""

    def forward(input: torch.Tensor) -> torch.Tensor:
        if module.weight is not weight or module.bias is not bias or type(input) is not torch.Tensor:
            # A weight replaced since the step's plan, or an input subclass: the Function's path, and this
            # forward's I then a plain backward (its captured layers get their gradients in I).
            store._uncaptured.add(key)
            return _linear(store, key, input, module.weight, module.bias)
        if not torch.is_grad_enabled():
            return F.linear(input, weight, bias)
        dtype = _autocast_dtype(input.device.type)
        if dtype is None:
            x, out = input, F.linear(input, weight, bias)
        else:  # autocast's casts, done here to keep the matmul's input for W (autocast passes them through)
            x = input  # `_cast` inlined (host time)
            if x.dtype != dtype and x.dtype != torch.float64 and x.is_floating_point():
                x = x.to(dtype)
            out = F.linear(x, store._cast_param(weight, dtype, True), store._cast_param(bias, dtype, True))
        captures.append((x, x._version, out, out._version, weight, bias))
        return out

    return forward
