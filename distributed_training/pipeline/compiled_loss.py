"""A loss through ``torch.compile``, for the last pipeline stage (the trainer's ``pipeline_compile_loss``).

Our GPT's loss (`gpt_stages.lm_loss`: cross-entropy with the softmax in fp32) runs eagerly as several
passes over the logits, each a tensor of microbatch tokens x vocabulary: the cast to fp32, the
log-softmax, the gather, and as many again backward. At a GPT-1.3B stage (vocabulary 50,257, 2 x 1024
tokens a microbatch) that is more memory traffic than the head's matmul: one H200 ran a 6-block stage
with the head 117.8 ms a step with the loss as it is, 109.8 ms with it compiled (forward 29.6 -> 25.4 ms,
backward 81.1 -> 77.4; `pipeline_stage_2026-11-28_1xh200_s28_C.log`). The compiled loss reads the bf16
logits once forward and once backward. It also evens a pipeline: the last stage, which holds the head,
no longer carries the loss's extra work (the compute balance then counts none, `gpt_layer_costs(loss=False)`).

`CompiledLoss` compiles on the first call with tensors on one of its `devices` (CUDA by default: on a CPU
the loss runs as it is, inductor there needs a C++ compiler and gains little). Where compiling fails (no
Triton, an op the compiler refuses) it warns once and runs the loss as it is from then on: a step never
fails because of the option (where the loss as it is fails too, its own error is raised: the inputs'
fault, not the compiler's). Shapes that change from batch to batch (sequence lengths) make dynamo
recompile, then compile for dynamic shapes (its default): a few recompilations, not one per length.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from typing import Any, Callable, Sequence

import torch

__all__ = ["CompiledLoss"]


class CompiledLoss:
    """``fn`` through ``torch.compile`` on `devices`, as it is elsewhere or where compiling fails.

    Args:
        fn: the loss, ``fn(output, target) -> loss``.
        devices: device types whose tensors go through the compiled loss (default CUDA only).
        backend: ``torch.compile``'s backend (default ``"inductor"``; tests use others).
    """

    def __init__(self, fn: Callable[..., torch.Tensor], devices: Sequence[str] = ("cuda",),
                 backend: str | Callable = "inductor") -> None:
        if not callable(fn):
            raise TypeError(f"CompiledLoss needs a callable loss, got {type(fn).__name__}")
        self.fn = fn
        self.devices = tuple(devices)
        self.backend = backend
        self._compiled: Callable | None = None
        #: Why compiling failed (the loss then runs as it is), or None.
        self.failure: str | None = None

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        if self.failure is not None or not isinstance(output, torch.Tensor) or output.device.type not in self.devices:
            return self.fn(output, target)
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, backend=self.backend)
        try:
            with _backward_compiled_now():
                return self._compiled(output, target)
        except Exception as err:  # noqa: BLE001 - sorted out below
            # The loss as it is: where it raises too, the error is the inputs' (wrong targets, say), and
            # that error is the one to see; where it works, the compiler failed: as it is from now on
            # (unless the device ran out of memory: that is the moment's, not the compiler's).
            loss = self.fn(output, target)
            if isinstance(err, torch.OutOfMemoryError):
                return loss
            self.failure = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
            warnings.warn(f"pipeline_compile_loss: compiling the loss failed, it runs as it is from now on "
                          f"({self.failure})", RuntimeWarning, stacklevel=2)
            return loss

    def __repr__(self) -> str:
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        return f"CompiledLoss({name}, devices={self.devices}{', failed' if self.failure else ''})"


def _backward_compiled_now():
    """AOTAutograd compiles a backward lazily, at the first ``backward()``: a failure there would escape
    the fallback (raised in the middle of a pipeline step, every step). This compiles it with the
    forward, inside the ``try`` (a no-op where torch lacks the setting)."""
    config = getattr(getattr(torch, "_functorch", None), "config", None)
    if config is None or not hasattr(config, "force_non_lazy_backward_lowering"):
        return nullcontext()
    return config.patch(force_non_lazy_backward_lowering=True)
