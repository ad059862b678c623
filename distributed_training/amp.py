"""Numeric precision of training: the precision objects the trainer drives, and our dynamic loss scaler.

A precision object owns everything that depends on the number format of the forward and backward
passes, so that the training loop only says *when* (``with precision.autocast()``, then
``strategy.backward(model, loss, precision)`` and ``strategy.optimizer_step(...)``):

* `Precision` (``"fp32"``): no autocast, the loss goes backward as it is, the optimizer always steps.
* `BF16Precision` (``"bf16"``): forward and loss under `torch.autocast` in bfloat16. bf16 keeps fp32's
  8 exponent bits, so gradients cannot underflow where fp32's would not: there is no loss scaler.
* `FP16Precision` (``"fp16"``): autocast in float16 and our `DynamicLossScaler` (below): the loss is
  scaled before backward, the gradients are unscaled before clipping (so the threshold applies to the
  true gradients), and a step whose gradients overflowed on any rank is skipped on every rank.

All three keep fp32 master weights: autocast casts the operands of each operation, not the parameters.
`make_precision` builds one from the trainer's ``mixed_precision=`` string.

The loss scaler
---------------

fp16 has 5 exponent bits: small gradients underflow to zero. Multiplying the loss by a large scale S
lifts them into range; gradients are divided by S again before clipping and the optimizer step. If S is
too large some gradient overflows to inf/NaN: that step is skipped and S halves. After
`growth_interval` clean steps in a row S doubles again, probing for the largest safe scale.

Every rank must take the same decision, or the replicas (or, under ZeRO/FSDP, the shards) drift apart:
the found-inf flag is computed locally and all-reduced with MAX (one 4-byte collective per step), so a
single overflowing element on a single rank makes every rank skip.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterable

import torch
import torch.distributed as dist

from .runtime import collective_device

__all__ = ["DynamicLossScaler", "Precision", "BF16Precision", "FP16Precision", "check_precision_argument",
           "make_precision"]


class DynamicLossScaler:
    """Our own loss scaler (not `torch.amp.GradScaler`).

    Args:
        init_scale: starting scale (2**16).
        growth_factor: multiply the scale by this after `growth_interval` clean steps (2).
        backoff_factor: multiply the scale by this on overflow (0.5).
        growth_interval: clean steps between growths (2000).
        min_scale: the scale never drops below this (1).
        hysteresis: overflows tolerated (each still skips its step) before the scale backs off (1); the
            count starts again when the scale changes, not at each clean step (as Megatron-LM's and
            DeepSpeed's default), so that overflows every other step still back off.
        group: the process group whose ranks must agree (default: all).

    Its `state_dict` carries its settings too; a resume keeps the settings given now and the trainer
    names those that changed.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 1.0, hysteresis: int = 1,
                 group: dist.ProcessGroup | None = None) -> None:
        if not init_scale > 0:
            raise ValueError(f"init_scale must be positive, got {init_scale}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be an integer >= 1, got {growth_interval}")
        if not isinstance(hysteresis, int) or hysteresis < 1:
            raise ValueError(f"hysteresis must be an integer >= 1, got {hysteresis}")
        if not 0 < min_scale <= init_scale:
            raise ValueError(f"min_scale must be in (0, init_scale], got {min_scale}")
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = float(min_scale)
        self.hysteresis = hysteresis
        self.group = group
        self._clean_steps = 0
        self._overflows_left = hysteresis
        self._unscaled = False
        self.found_inf = False
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        self._unscaled = False
        return loss * self.scale

    @torch.no_grad()
    def unscale_(self, grads: Iterable[torch.Tensor | None]) -> bool:
        """Divide gradients by the scale (once per step); return whether any rank found inf/NaN."""
        if self._unscaled:
            return self.found_inf
        grads = [g for g in grads if g is not None]
        device = collective_device(self.group, grads[0].device if grads else None)
        flag = torch.zeros((), dtype=torch.float32, device=device)
        if grads:
            # A few multi-tensor kernels instead of three per gradient. The largest magnitude is inf
            # or NaN exactly when some entry is (max propagates NaN), and cannot overflow.
            torch._foreach_mul_(grads, 1.0 / self.scale)
            largest = torch.stack([n.float() for n in torch._foreach_norm(grads, float("inf"))]).max()
            flag = (~torch.isfinite(largest)).float()
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            if dist.get_backend(self.group) != "nccl":
                flag = flag.cpu()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self.found_inf = bool(flag.item())
        self._unscaled = True
        return self.found_inf

    def step(self, optimizer: torch.optim.Optimizer, grads: Iterable[torch.Tensor | None]) -> bool:
        """Unscale (if not done yet), step unless any rank overflowed, update the scale; return stepped."""
        found_inf = self.unscale_(grads)
        if not found_inf:
            optimizer.step()
        else:
            self.skipped_steps += 1
        self.update()
        return not found_inf

    def update(self) -> None:
        if self.found_inf:
            self._clean_steps = 0
            self._overflows_left -= 1
            if self._overflows_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
                self._overflows_left = self.hysteresis
        else:
            self._clean_steps += 1
            if self._clean_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self._clean_steps = 0
                self._overflows_left = self.hysteresis
        self._unscaled = False
        self.found_inf = False

    def settings(self) -> dict[str, float | int]:
        """The arguments that shape the scale's course (``init_scale`` aside: a state replaces it)."""
        return {"growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "min_scale": self.min_scale, "hysteresis": self.hysteresis}

    def changed_settings(self, state: dict[str, Any] | None) -> list[str]:
        """``"loss_scaler.<setting>: saved -> now"`` for each setting of `state` (a `state_dict`) that
        differs from this scaler's."""
        saved = (state or {}).get("settings") or {}
        return [f"loss_scaler.{key}: {saved[key]} -> {value}" for key, value in self.settings().items()
                if key in saved and saved[key] != value]

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "overflows_left": self._overflows_left,
                "skipped_steps": self.skipped_steps, "settings": self.settings()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a `state_dict`'s scale and counts; this scaler's settings stay (a smaller `hysteresis`
        bounds the overflows still tolerated, a smaller `growth_interval` the clean steps counted)."""
        self.scale = max(float(state["scale"]), self.min_scale)
        self._clean_steps = min(int(state["clean_steps"]), self.growth_interval - 1)
        saved = state.get("settings") or {}
        # (counted under another hysteresis: the count starts again)
        self._overflows_left = self.hysteresis if saved.get("hysteresis", self.hysteresis) != self.hysteresis \
            else min(int(state["overflows_left"]), self.hysteresis)
        self.skipped_steps = int(state.get("skipped_steps", 0))


class Precision:
    """fp32 training (``"fp32"``), and the interface of the mixed-precision modes.

    The order of calls in one optimizer step, for every mode:

        with precision.autocast():
            loss = compute_loss(model, batch)
        precision.backward(loss)                # once per micro-batch
        precision.unscale_(grads)               # before clipping: true gradients from here on
        ...clip...
        stepped = precision.step(optimizer, grads)

    `unscale_` and `step` return what every rank agreed on, so the ranks (or shards) never diverge.

    Args:
        device_type: the device type autocast runs on (``"cuda"``, ``"cpu"``).
    """

    name: str = "fp32"
    #: The dtype of autocast regions, or None for no autocast.
    autocast_dtype: torch.dtype | None = None

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = device_type

    @property
    def scaler(self) -> DynamicLossScaler | None:
        """The loss scaler, for the modes that have one."""
        return None

    #: Whether `unscale_` and `step` read the gradients (a loss scaler's): without one the strategy
    #: does not even list them, which on a model of hundreds of tensors is host time every step.
    reads_gradients = False

    def autocast(self) -> ContextManager:
        """The context for forward and loss."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward from `loss` (scaled first where the mode scales)."""
        loss.backward()

    def unscale_(self, grads: Iterable[torch.Tensor | None]) -> bool:
        """Bring the gradients back to their true values in place, once per step; return whether any
        rank found inf/NaN (always False without a scaler: an fp32 or bf16 step is never skipped)."""
        return False

    def step(self, optimizer: torch.optim.Optimizer, grads: Iterable[torch.Tensor | None]) -> bool:
        """Step `optimizer` unless the gradients overflowed on some rank; return whether it stepped."""
        optimizer.step()
        return True

    def metrics(self) -> dict[str, torch.Tensor]:
        """What the step's metrics report about precision (fp16: the loss scale the step used)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep (the scaler's state; empty without one)."""
        return {}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore `state_dict`; an empty or None state (a checkpoint of a run without a scaler) leaves
        the current state as it is."""


class BF16Precision(Precision):
    """Autocast in bfloat16; no loss scaling (bf16 has fp32's exponent range)."""

    name = "bf16"
    autocast_dtype = torch.bfloat16


class FP16Precision(Precision):
    """Autocast in float16 with our `DynamicLossScaler`, its overflow decision agreed across ranks.

    Args:
        device_type: the device type autocast runs on.
        scaler: the loss scaler (default: ``DynamicLossScaler(group=group)``).
        group: the process group whose ranks must agree on skipping, for the default scaler.
    """

    name = "fp16"
    autocast_dtype = torch.float16

    def __init__(self, device_type: str = "cpu", scaler: DynamicLossScaler | None = None,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__(device_type)
        if scaler is not None and not isinstance(scaler, DynamicLossScaler):
            raise TypeError(f"loss_scaler must be a DynamicLossScaler, got {type(scaler).__name__}")
        self._scaler = scaler if scaler is not None else DynamicLossScaler(group=group)

    @property
    def scaler(self) -> DynamicLossScaler:
        return self._scaler

    reads_gradients = True

    def backward(self, loss: torch.Tensor) -> None:
        self._scaler.scale_loss(loss).backward()

    def unscale_(self, grads: Iterable[torch.Tensor | None]) -> bool:
        return self._scaler.unscale_(grads)

    def step(self, optimizer: torch.optim.Optimizer, grads: Iterable[torch.Tensor | None]) -> bool:
        return self._scaler.step(optimizer, grads)

    def metrics(self) -> dict[str, torch.Tensor]:
        return {"loss_scale": torch.tensor(self._scaler.scale)}

    def state_dict(self) -> dict[str, Any]:
        return self._scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state:
            self._scaler.load_state_dict(state)


_MODES = {"fp32": Precision, "bf16": BF16Precision, "fp16": FP16Precision}


def check_precision_argument(mixed_precision: str | None, loss_scaler: DynamicLossScaler | None = None) -> str:
    """Validate the trainer's ``mixed_precision=`` and ``loss_scaler=`` (before any rendezvous); return
    the mode's name."""
    mode = "fp32" if mixed_precision is None else mixed_precision
    if mode not in _MODES:
        raise ValueError(f"mixed_precision must be 'bf16', 'fp16', 'fp32' or None, got {mixed_precision!r}")
    if loss_scaler is not None and mode != "fp16":
        raise ValueError(
            f"a loss scaler is for fp16 only: with mixed_precision={mixed_precision!r} gradients keep fp32's "
            "exponent range (bf16 has the same 8 exponent bits), so there is nothing to rescue from underflow"
        )
    if loss_scaler is not None and not isinstance(loss_scaler, DynamicLossScaler):
        raise TypeError(f"loss_scaler must be a DynamicLossScaler, got {type(loss_scaler).__name__}")
    return mode


def make_precision(mixed_precision: str | None, device_type: str, *, loss_scaler: DynamicLossScaler | None = None,
                   group: dist.ProcessGroup | None = None) -> Precision:
    """The precision object for the trainer's ``mixed_precision=`` (``None`` / ``"fp32"``, ``"bf16"``,
    ``"fp16"``); `loss_scaler` (fp16 only) replaces the default ``DynamicLossScaler(group=group)``."""
    mode = check_precision_argument(mixed_precision, loss_scaler)
    if mode == "fp16":
        return FP16Precision(device_type, loss_scaler, group=group)
    return _MODES[mode](device_type)
