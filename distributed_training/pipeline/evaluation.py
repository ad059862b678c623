"""`evaluate` through a pipeline (`PipelineStrategy`'s part for it).

Forward only: each batch, whole, through this rank's stages over the engine's `StageLink`, the last
stage computing the criterion and the metrics (`evaluate_batch`); its sums reach the pipeline's other
ranks in one broadcast at the end (`evaluation_sums`).

A failure. The first ranks of an evaluation only send, so a later stage's error would never reach them
through the messages they wait for. The last rank therefore acknowledges each batch to the others, who
wait for the acknowledgement of the batch P batches back before starting one (`StageLink.batch_starts`:
the pipeline stays full), and a failure anywhere reaches the last rank, which sends a stop there instead
(`evaluation_failed`, `StageLink.abort`). So when one stage raises, every rank of the pipeline raises
(the others `PipelineAborted`), and the pipeline goes on: the messages left in flight are paired at once
where no rank can be blocked elsewhere (`StageLink.settle_after_abort`), else at the next step or
evaluation (`StageLink.resync`). Where the stages gather parameters in their forward (ZeRO-3 / FSDP
inside the stages) at a data-parallel size above one, `evaluate` runs every rank of the job in lockstep
(a collective a batch): a rank blocked there hears nothing. Ranks of the job outside the pipeline (data-
parallel replicas, tensor-parallel peers) go on only if they failed too (`failure_agreement`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from .p2p import PipelineAborted

__all__ = ["PipelineEvaluation"]


class PipelineEvaluation:
    """`evaluate`'s strategy hooks for a pipeline (mixed into `PipelineStrategy`)."""

    def evaluation_begins(self, model: nn.Module) -> None:
        link = self.engine.link
        if link.aborted:  # a failed step or evaluation before (every rank): its messages in flight first
            link.resync(self._pipe_rank)
        link.begin_evaluation(lag=self.options.size)

    def evaluate_batch(self, model: nn.Module, batch: Any, criterion: Callable | None,
                       metrics: dict[str, Callable] | None) -> list[torch.Tensor]:
        """Forward only: the whole batch through this rank's stages in stage order (no microbatches,
        so the values are those of one process's forward on the batch), each output sent on as soon as
        it is computed; the last stage computes the criterion and the metrics, the other ranks return
        zeros (`evaluation_sums` brings the last stage's sums to them). Every rank of the pipeline gets
        the same batches (`evaluate` shards by data-parallel replica), so the messages pair up; a rank
        starts a batch once the last stage has finished the one P batches back, so a fast first stage
        cannot run far ahead. As `evaluate` does without a pipeline, the forward runs without
        autocast. If a stage raises, every rank of the pipeline raises."""
        criterion, inputs, targets = self._criterion_and_pair(criterion, batch, "evaluate")
        P, me, last = self.options.size, self._pipe_rank, self.options.num_stages - 1
        link = self.engine.link
        values = None
        try:
            link.batch_starts(me)
            for chunk, stage in enumerate(self.unwrap(model).stages):
                s = chunk * P + me
                x = inputs if s == 0 else link.recv(me, (s - 1) % P)
                out = stage(x)
                if s == last:
                    values = [criterion(out, targets), *(fn(out, targets) for fn in (metrics or {}).values())]
                else:
                    link.send(out, me, (s + 1) % P)
            link.batch_ends(me)
        except BaseException as err:
            self.evaluation_failed(model, err)
            if isinstance(err, PipelineAborted) or not isinstance(err, Exception):
                raise
            raise RuntimeError(f"pipeline rank {me} (global rank {self._pipe_ranks[me]}): its stage failed "
                               f"during evaluate: {err}") from err
        if values is None:
            values = [torch.zeros((), device=self.device)] * (1 + len(metrics or {}))
        return values

    def evaluation_failed(self, model: nn.Module, err: BaseException) -> None:
        """This rank's evaluation raised (its stage, its data, a stop heard from a peer): stop the
        pipeline's other ranks, once."""
        link = self.engine.link
        if not link.evaluating:
            return
        link.abort(self._pipe_rank, getattr(err, "failed_rank", None))
        lockstep = self.collective_forward and self.engine.data_size > 1  # (a rank may be blocked there)
        link.settle_after_abort(self._pipe_rank, err, resync=not lockstep)

    def evaluation_sums(self, sums: torch.Tensor) -> torch.Tensor:
        link = self.engine.link
        try:
            link.end_evaluation(self._pipe_rank)
        except BaseException as err:
            self.evaluation_failed(None, err)
            raise
        dist.broadcast(sums, src=self._pipe_ranks[-1], group=self._pipe_group)
        link.after_evaluation()
        link.settle(everything=True)  # (an evaluation of many batches logged each message)
        return sums

    def smallest_batch(self) -> int:
        # Interleaved runs a short batch as a multiple of the ranks' microbatches: at least one a rank.
        return self.options.size if self.options.schedule == "interleaved_1f1b" else 1

    def batch_cuts(self) -> int:
        return self.options.microbatch_count
