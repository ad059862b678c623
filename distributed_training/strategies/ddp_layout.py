"""`DDP`'s layout of its gradient buckets (a mixin of `DDP`): which parameters share a bucket, in launch
order; the layout saved in checkpoints and adopted on resume, so that the reduction order and with it the
floating-point result stay the same; and the rebuild after the first iteration in the order gradients
arrived, with error feedback's residuals following their parameters."""

from __future__ import annotations

from ..comm.bucket import Bucket, allocate_buckets, assign_buckets, bucket_layout
from .ddp_buckets import agreed_bucket_order, index_buckets, move_grads_to_views

__all__ = ["BucketLayout"]


class BucketLayout:
    """Uses `DDP`'s parameters (``_params``), caps, bucket reducer, rebuild state and process group."""

    def bucket_groups(self) -> list[list[int]]:
        """Parameter indices of each bucket, in launch order (saved in checkpoints)."""
        return [list(b.param_indices) for b in self._buckets]

    def set_bucket_groups(self, groups: list[list[int]], rebuild_pending: bool = False,
                          arrival_order: list[int] | None = None) -> None:
        """Adopt a saved bucket layout (every rank must pass the same), keeping current gradients.

        Resuming with the buckets of the interrupted run keeps the reduction order, and so the
        floating-point result, identical; so do `rebuild_pending`, whether that run had still to
        rebuild them in arrival order (saved before its second step), and the `arrival_order` it had
        seen for it (the rebuild then comes at the next forward, as it would have). A run of one rank has no buckets:
        it ignores a saved layout, and its own (none) leaves the current one."""
        if self._solo or not groups:
            return
        if not self.bucket_layout_fits(groups):
            raise ValueError(f"bucket layout does not cover this model's {len(self._params)} parameters exactly once")
        self._install_buckets([list(g) for g in groups])
        self._rebuild_pending = bool(rebuild_pending) and self._rebuild_buckets
        self._arrival_order = list(arrival_order or []) if self._rebuild_pending else None
        if self._rebuild_pending and arrival_order:
            self._rebuild_ready = True

    def bucket_layout_fits(self, groups: list[list[int]]) -> bool:
        """Whether `groups` (a saved `bucket_groups()`) covers this wrapper's parameters exactly once."""
        return sorted(i for g in groups for i in g) == list(range(len(self._params)))

    def _build_buckets(self, order: list[int]) -> None:
        self._place_buckets(assign_buckets(self._params, order, self._cap_bytes, self._first_cap_bytes))

    def _install_buckets(self, groups: list[list[int]]) -> None:
        """Switch to new buckets, copying live gradients into their new views."""
        if groups == [b.param_indices for b in self._buckets]:
            return
        old_views = self._view_of
        self._place_buckets(groups)
        self._reset_iteration()
        move_grads_to_views(self._params, old_views, self._view_of)

    def _place_buckets(self, groups: list[list[int]]) -> None:
        self._buckets: list[Bucket] = allocate_buckets(self._params, groups, pad_to=self._bucket_pad_to,
                                                       keep_layout=self._bucket_keep_layout)
        self._bucket_of, self._view_of = index_buckets(self._buckets, len(self._params))
        set_layout = getattr(self.bucket_reducer, "set_bucket_layout", None)
        if set_layout is not None:  # e.g. PowerSGD: one matrix per weight
            set_layout({b.index: bucket_layout(b) for b in self._buckets})

    def _rebuild_buckets_in_arrival_order(self) -> None:
        order = agreed_bucket_order(self._arrival_order or [], len(self._params), self._buckets,
                                    world_size=self.world_size, group=self.process_group, src=self._global_rank(0))
        self._rebuild_pending = False
        self._arrival_order = None
        before = self._placements()
        self._install_buckets(assign_buckets(self._params, order, self._cap_bytes, self._first_cap_bytes))
        after = self._placements()
        rebucket = getattr(self.bucket_reducer, "rebucket", None)
        if rebucket is not None and after != before:  # error feedback's residuals follow their parameters
            rebucket([(*before[i][:2], *after[i][:2], n) for i, (_, _, n) in before.items()],
                     {b.index: b.buffer.numel() for b in self._buckets})

    def _placements(self) -> dict[int, tuple[int, int, int]]:
        """Where each parameter's gradient lives: (its bucket's index, its offset there, its numel)."""
        return {i: (self._buckets[self._bucket_of[i]].index,
                    view.storage_offset() - self._buckets[self._bucket_of[i]].buffer.storage_offset(), view.numel())
                for i, view in enumerate(self._view_of)}
