"""A dynamic loss scaler for fp16 training, agreed across ranks and shards.

fp16 has 5 exponent bits: small gradients underflow to zero. Multiplying the loss by a large scale S
lifts them into range; gradients are divided by S again before clipping and the optimizer step. If S is
too large some gradient overflows to inf/NaN: that step is skipped and S halves. After
`growth_interval` clean steps in a row S doubles again, probing for the largest safe scale.

Every rank must take the same decision, or the replicas (or, under ZeRO/FSDP, the shards) drift apart:
the found-inf flag is computed locally and all-reduced with MAX (one 4-byte collective per step), so a
single overflowing element on a single rank makes every rank skip.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

__all__ = ["DynamicLossScaler"]


class DynamicLossScaler:
    """Our own loss scaler (not `torch.amp.GradScaler`).

    Args:
        init_scale: starting scale (2**16).
        growth_factor: multiply the scale by this after `growth_interval` clean steps (2).
        backoff_factor: multiply the scale by this on overflow (0.5).
        growth_interval: clean steps between growths (2000).
        min_scale: the scale never drops below this (1).
        hysteresis: overflows tolerated (each still skips its step) before the scale backs off (1).
        group: the process group whose ranks must agree (default: all).
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
        device = grads[0].device if grads else torch.device("cpu")
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
            self._overflows_left = self.hysteresis
            if self._clean_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self._clean_steps = 0
        self._unscaled = False
        self.found_inf = False

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "overflows_left": self._overflows_left,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._overflows_left = int(state["overflows_left"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
