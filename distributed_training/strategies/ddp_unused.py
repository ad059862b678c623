"""DDP's parameters that no rank gave a gradient (`DDP`'s part for them, a mixin): the flags all-reduced
at the end of a backward with ``find_unused_parameters`` (`_used_flags`, and what a subclass reads of the
gradients held, `_read_held`), what is done with the parameters found (`_unused_everywhere`,
`_unready_everywhere`: hooks for ZeRO-1), and the refusal in `sync_gradients`' first calls, where no
backward of the step synchronised (`_refuse_unused_everywhere`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..runtime import collective_device

__all__ = ["UnusedParameters"]


class UnusedParameters:
    """Uses `DDP`'s ``_params``, ``_param_names``, ``_buckets`` and ``process_group``."""

    #: `sync_gradients` calls that look for parameters no rank gave a gradient (one small all-reduce each).
    SYNC_CHECKS = 2

    def _refuse_unused_everywhere(self) -> None:
        """Raise, on every rank alike, where a trainable parameter has no gradient on any rank at
        `sync_gradients`: its bucket would average zeros into it, and an optimizer with momentum or weight
        decay would move it, where one process (and a data-parallel size of one) leaves it alone."""
        device = collective_device(self.process_group, self._buckets[0].buffer.device if self._buckets else None)
        flags = torch.tensor([p.grad is not None for p in self._params], dtype=torch.uint8, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group)
        names = [self._param_names[i] for i, used in enumerate(flags.tolist()) if not used]
        if names:
            shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
            raise RuntimeError(
                f"{len(names)} parameter(s) received no gradient on any rank of the data-parallel group in this step: "
                f"{shown}. Averaged as zeros, they would move under an optimizer with momentum or weight decay, where "
                "one process leaves them alone. If they are never used, set requires_grad=False (or remove them); if "
                "they are unused in some steps only, pass find_unused_parameters=True (DDPStrategy(...))")

    def _read_held(self, held: list[int]) -> Any:
        """What `_used_flags` needs to know of the gradients `held` before their buckets are reduced:
        nothing here (a `.grad` held counts)."""
        return None

    def _used_flags(self, ready: list[bool], held: list[int], read: Any) -> torch.Tensor:
        """This rank's flag per parameter for the all-reduce (MAX) that finds the parameters no rank
        gave a gradient: reached in this backward (`ready`), or, of the others, holding a `.grad`
        (`held`: what earlier no_sync micro-batches fed, or one kept across steps; `read`: what
        `_read_held` found of them)."""
        flags = [int(r) for r in ready]
        for i in held:
            flags[i] = 1
        device = collective_device(self.process_group, self._buckets[0].buffer.device if self._buckets else None)
        return torch.tensor(flags, dtype=torch.int32, device=device)

    def _unused_everywhere(self, indices: list[int]) -> None:
        """Parameters (indices into `_params`) that got no gradient on any rank this backward: their
        ``.grad`` was left None, as without DDP. A subclass whose optimizer sees them otherwise says so."""

    def _unready_everywhere(self, indices: list[int]) -> None:
        """Parameters that no rank's backward reached this time, whatever their ``.grad`` holds (a
        gradient view of a bucket, zeroed after the last step, is not None)."""
