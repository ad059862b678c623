"""Runs one rank's part of a pipeline schedule for one training step.

The batch is cut into microbatches along its first dimension. Each action of this rank's list (see
`schedules.py`) runs in order: a forward takes its input from the batch (first stage) or from the
previous stage's rank, and hands its output to the next stage's rank, or to the loss (last stage); a
backward takes the gradient of its output from the next stage's rank (or from the loss) and hands the
gradient of its input back. Messages leave as soon as they are computed (`p2p.StageLink`).

Split backwards (ZB-H1's ``I`` and ``W``): each forward is recorded by a `split_backward.SplitBackward`
under its (microbatch, chunk), an ``I`` is the backward above with the linear layers' weight gradients
deferred (the input gradient leaves at once), and the ``W`` of that (microbatch, chunk) computes them
later and accumulates them into ``.grad``. Nothing of it outlives the step.

Each microbatch's loss is weighted by what it stands for of the whole batch's loss (`loss_weights`: its
share of the rows, or of the targets not ignored, or 1 for a summing criterion), so the gradients autograd
accumulates over the microbatches are those of the whole batch's loss, as one process computes them; the
step's loss, the same weighted sum, is returned on every rank of the pipeline.

Timing (`PipelineEngine.timing`, off by default): the compute of each action between two marks, the
step's window and its measured bubble against the formula (`timing.PipelineTiming`, in `last_timing`).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..batches import _flattened_targets, tensors_of
from ..loss_weights import StepWeights, counted
from ..runtime import fewest
from .graphs import StageGraphs, slots_per_chunk
from .p2p import PipelineAborted, StageLink
from .schedules import build_schedule, stage_of
from .split_backward import SplitBackward
from .stages import Stage
from .timing import ActionClock, PipelineTiming, combine, rank_row

__all__ = ["PipelineEngine"]


def _split(value: Any, parts: int) -> list[Any]:
    """`value` cut into `parts` along dim 0 (tensors, and tuples / lists / dicts of them)."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] < parts:
            raise ValueError(f"a batch of {value.shape[0] if value.dim() else 0} samples cannot be cut into "
                             f"{parts} microbatches: give microbatches <= the batch size")
        return list(torch.tensor_split(value, parts))
    if isinstance(value, dict):
        cut = {k: _split(v, parts) for k, v in value.items()}
        return [{k: cut[k][i] for k in value} for i in range(parts)]
    if isinstance(value, (tuple, list)):
        cut = [_split(v, parts) for v in value]
        return [type(value)(c[i] for c in cut) for i in range(parts)]
    return [value] * parts


def _split_targets(targets: Any, inputs: Any, pieces: list[Any]) -> list[Any]:
    """`targets` cut as `inputs` was into `pieces`: along dim 0, or, flattened to one per token of
    (rows, tokens, ...) inputs (``tokens[:, 1:].flatten()`` beside flattened logits, as a vocabulary-split
    head needs), at the same rows (cut along their own dim 0, an uneven batch's split them elsewhere)."""
    per_token = _flattened_targets((inputs, targets), _rows(inputs)) if isinstance(inputs, torch.Tensor) else None
    if per_token is None:
        return _split(targets, len(pieces))
    tokens = inputs.shape[1]
    ends = torch.tensor([_rows(x) for x in pieces]).cumsum(0).tolist()
    return [per_token[(end - _rows(x)) * tokens:end * tokens] for x, end in zip(pieces, ends)]


def _starts_in_place(module: nn.Module) -> bool:
    """Whether the first layer `module` runs is one that works in place (an ``inplace=True`` flag, as
    `nn.ReLU` has), following first layers down through a `Stage` and `nn.Sequential`s."""
    while True:
        if getattr(module, "inplace", False) is True:
            return True
        if isinstance(module, Stage) and module._chain:
            module = module._chain[0]
        elif isinstance(module, nn.Sequential) and len(module):
            module = module[0]
        else:
            return False


def _shapes_of(value: Any) -> Any:
    """A hashable description of the tensors' shapes and dtypes in `value` (the link's step key)."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return tuple((k, _shapes_of(v)) for k, v in value.items())
    if isinstance(value, (tuple, list)):
        return tuple(_shapes_of(v) for v in value)
    return type(value).__name__


def _rows(value: Any) -> int:
    """The batch size: the first tensor's first dimension."""
    tensors = tensors_of(value)
    if not tensors or tensors[0].dim() == 0:
        raise TypeError(f"cannot tell the batch size of a {type(value).__name__}")
    return tensors[0].shape[0]


class PipelineEngine:
    """One rank's stage chunks and the schedule that drives them.

    Args:
        chunks: this rank's model chunks, chunk c being stage ``c * P + rank`` (one chunk unless the
            schedule interleaves).
        ranks: the global ranks of the pipeline, in stage order.
        rank: this rank's position in `ranks`.
        group: the pipeline's process group (the loss broadcast, and every message unless given below).
        up_group / down_group / header_group: see `p2p.StageLink` (NCCL needs all three: two NCCL groups
            and a gloo one over the same ranks; on gloo `group` serves for all).
        schedule: a name `schedules.build_schedule` knows.
        microbatches: how many microbatches a batch is cut into.
        loss_fn: ``loss_fn(output, target) -> mean loss`` on the last stage.
        after_backward: called once all of the step's backwards ran (e.g. summing tied weights' gradients).
        split_backward: for schedules with ``I`` and ``W`` actions (``"zbh1"``), what defers the weight
            gradients (`split_backward.SplitBackward`); default ``SplitBackward(chunks)``: the chunks'
            `nn.Linear` layers. Pass ``SplitBackward(chunks, functional=True)`` to also defer other
            ``F.linear`` calls. Ignored by schedules without split backwards.
        cuda_graphs: replay each chunk's forward and backward as CUDA graphs (`graphs.StageGraphs`),
            captured after the first step for the input shape that step had; other shapes run eagerly.
            CUDA only, not with chunks that have module hooks. With split backwards (``"zbh1"``) the I
            pass is the replayed backward and W replays a graph of its own (`graphs._Slot`).

    Attributes:
        timing: set to True to time the coming steps (default False: nothing is timed, nothing waits
            for the device). A timed step marks the compute of each action (CUDA: events on the current
            stream; CPU: `time.perf_counter`), waits once for the device after its last message, and
            exchanges a few numbers with the other pipeline ranks by message (`timing`'s module
            docstring): every rank of the pipeline must time the same steps.
        last_timing: the `timing.PipelineTiming` of the latest timed step (None before one): this
            rank's busy ms by action kind, the pipeline's window and bubble, measured, simulated with
            the measured costs, and by the formula. A step without timing leaves it as it is.
        after_agreement: call `after_backward` only once the step's end is agreed (see `_step`): where it
            runs a collective with other ranks of the pipeline (a tied weight's copies on three or more),
            which a rank whose stage failed would never join, or a reduction that keeps state (compression's
            residuals), which would keep a step that a later failure drops. Default False: right after the
            schedule, so that a rank that finishes early reduces over its data-parallel group while the
            others finish.
    """

    def __init__(self, chunks: Sequence[nn.Module], *, ranks: Sequence[int], rank: int, group=None,
                 up_group=None, down_group=None, header_group=None, schedule: str = "1f1b", microbatches: int, loss_fn: Callable,
                 device: torch.device | str = "cpu", after_backward: Callable[[], None] | None = None,
                 split_backward: SplitBackward | None = None, cuda_graphs: bool = False) -> None:
        self.chunks = list(chunks)
        # Chunks whose first layer works in place (nn.ReLU(inplace=True)) get a copy of their received
        # input: autograd forbids modifying a leaf that requires grad, which a received input is.
        self._copy_input = [_starts_in_place(chunk) for chunk in self.chunks]
        self.pipe_size = len(ranks)
        self.rank = rank
        self.num_stages = self.pipe_size * len(self.chunks)
        self.microbatches = microbatches
        self.loss_fn = loss_fn
        self.device = torch.device(device)
        self.after_backward = after_backward
        self.after_agreement = False
        self.group = group
        self.ranks = list(ranks)
        self.link = StageLink(self.ranks, up_group if up_group is not None else group,
                              down_group if down_group is not None else group,
                              header_group if header_group is not None else group, self.device)
        self._done = torch.zeros((), device=self.device)  # "my schedule ran to its end" (to the last rank)
        self.schedule = schedule
        self.actions = build_schedule(schedule, self.pipe_size, microbatches, chunks=len(self.chunks))[rank]
        self._short_schedules: dict[int, list] = {}  # microbatches -> actions, for batches smaller than configured
        self.split: SplitBackward | None = None
        if any(action.kind in ("I", "W") for action in self.actions):
            if split_backward is None:
                split_backward = SplitBackward(self.chunks)
            elif not isinstance(split_backward, SplitBackward):
                raise TypeError(f"split_backward must be a SplitBackward, got {type(split_backward).__name__}")
            self.split = split_backward
        self.graphs: StageGraphs | None = None
        if cuda_graphs:
            self.graphs = StageGraphs(self.chunks, slots_per_chunk(self.actions, len(self.chunks)), self.device,
                                      split=self.split is not None)
        self._slots: dict[tuple[int, int], Any] = {}  # (microbatch, chunk) -> its graphs' slot, until its B or W
        self._rng_base = 0  # the step's random streams (`_forward`), drawn in `step`
        self.timing = False
        self.last_timing: PipelineTiming | None = None
        self._clock: ActionClock | None = None
        #: What the microbatches' loss weights are read from (`loss_weights.micro_weights`: its reduction and
        #: ignore_index); None: `loss_fn` itself. The trainer sets the user's criterion here.
        self.criterion: Callable | None = None
        #: The last stage's data-parallel group and the number of replicas (the trainer sets them): replicas
        #: whose batches keep different numbers of targets weigh their losses by them (`replica_scale`).
        self.data_group = None
        self.data_size = 1
        #: Whether the replicas must run as many microbatches as each other (the trainer sets it where the
        #: data-parallel strategy gathers the stage's parameters in each microbatch's forward: FSDP / ZeRO-3).
        self.lockstep_replicas = False
        #: Where the replicas agree on that: a CPU group over this rank's data-parallel group
        #: (`Mesh.host_group`), so that reading the agreement back never waits for the GPU's queue (None:
        #: `data_group`, on this rank's device).
        self.rows_group = None

    def _forward(self, chunk: int, stage: int, x: Any, mb: int = 0) -> Any:
        if stage > 0 and self._copy_input[chunk] and isinstance(x, torch.Tensor) and x.requires_grad:
            x = x.clone()  # the gradient still reaches the received tensor, through the copy
        elif self.graphs is not None:  # (a copied input is no leaf: those chunks run eagerly)
            replayed = self.graphs.forward(chunk, x)
            if replayed is not None:
                out, self._slots[mb, chunk] = replayed
                return out
        try:
            # Each (stage, microbatch) draws from a stream of its own (dropout's masks differ from stage to
            # stage, as the layers' draws do in one process), off the global stream, which stays the same
            # on every rank (a user's data drawn from it after this step still agrees between stages).
            cuda = self.device.type == "cuda"
            with torch.random.fork_rng(devices=[self.device] if cuda else []):
                seed = (self._rng_base + 1_000_003 * stage + mb) % (1 << 63)
                torch.default_generator.manual_seed(seed)
                if cuda:
                    torch.cuda.default_generators[self.device.index].manual_seed(seed)
                return self.chunks[chunk](x)
        except RuntimeError as err:
            # A received input is a leaf that requires grad (its gradient goes back to the previous stage),
            # which autograd forbids modifying in place; in one process it was an intermediate result.
            if stage > 0 and "leaf Variable that requires grad is being used in an in-place operation" in str(err):
                raise RuntimeError(f"pipeline stage {stage} modifies its input in place (e.g. `x.add_(...)` in "
                                   "its first layer's forward), which a stage's received input does not allow: cut "
                                   "the model elsewhere (the trainer's pipeline_split_points) or make that operation "
                                   "out of place") from err
            raise

    @property
    def is_last(self) -> bool:
        return self.rank == self.pipe_size - 1

    def step(self, inputs: Any, targets: Any) -> torch.Tensor:
        """Forward and backward of every microbatch by the schedule; gradients accumulate in the chunks'
        parameters. Returns the batch's mean loss on every rank of the pipeline.

        Every rank passes the same batch: the first stage reads `inputs`, the last `targets`. If any
        rank's stage raises, every rank of the pipeline raises (the others `PipelineAborted`) instead of
        waiting for messages that will never come; the next step (or evaluation), on every rank, first
        receives what the failed one left in flight (`StageLink.resync`), then runs as usual."""
        if not torch.is_grad_enabled():  # every rank alike: raised before any message
            raise RuntimeError("PipelineEngine.step runs forward and backward passes: call it with gradients enabled, "
                               "not under torch.no_grad() or torch.inference_mode()")
        if self.link.aborted:  # the last step failed (on every rank): its messages still in flight first
            self.link.resync(self.rank)
        # Cut before the first message, every rank alike (they pass the same batch). A batch with fewer
        # samples than microbatches (an epoch's short last batch) runs as one microbatch per sample, with
        # the schedule built for that many; interleaved, which needs a multiple of the pipeline's ranks,
        # runs the largest such multiple (microbatches of one or two samples), and refuses a batch of
        # fewer samples than ranks with the pipeline still usable.
        total = _rows(inputs)
        self._check_same_rows(total)
        if self.lockstep_replicas and self.data_size > 1:
            # FSDP's per-microbatch gathers pair up over the data-parallel group only if every replica
            # runs as many microbatches: a replica's short batch shortens the others' schedules too
            # (their rows spread over fewer microbatches; the loss weights stay each row's share).
            total = (fewest(total, self.rows_group) if self.rows_group is not None
                     else fewest(total, self.data_group, self.device))
        m = self.microbatches if total >= self.microbatches else total
        if m < self.microbatches and self.schedule == "interleaved_1f1b" and m >= self.pipe_size:
            m -= m % self.pipe_size
        actions = self.actions if m == self.microbatches else self._actions_for(m)
        xs = _split(inputs, m)
        ys = _split_targets(targets, inputs, xs)
        # The last stage weighs each microbatch's loss (`loss_weights`: by the targets it does not ignore);
        # the others never use the weights (by rows: nothing launched).
        criterion = (self.criterion if self.criterion is not None else self.loss_fn) if self.is_last else None
        rows = [_rows(x) for x in xs]
        # (the replicas' factor: the last stages only, their own collective)
        weights = StepWeights(criterion, ys, rows, lambda i: counted(criterion, ys[i], rows[i]), group=self.data_group,
                              replicas=self.data_size if self.is_last else 1, device=self.device)
        # The step's random streams (see `_forward`): one draw of the global generator, alike on every rank.
        self._rng_base = int(torch.randint(0, 1 << 62, (1,)).item())
        try:
            return self._step(xs, ys, weights, actions)
        except BaseException as err:
            failed = getattr(err, "failed_rank", None)
            self.link.abort(self.rank, failed)
            self.link.settle_after_abort(self.rank, err)
            if not isinstance(err, PipelineAborted):
                raise RuntimeError(f"pipeline rank {self.rank} (global rank {self.ranks[self.rank]}): its stage "
                                   f"failed during the step: {err}") from err
            raise

    def _check_same_rows(self, rows: int) -> None:
        """Every rank of the pipeline passed a batch of `rows` samples, or every one raises now, before any
        message. Batches of other sizes ran schedules of other lengths (one rank raised on a mismatched
        gradient while the other stepped its optimizer) or paired microbatches of other rows silently
        (the targets broadcast in the loss). One all-reduce of two integers over the headers' CPU group:
        no wait for a GPU."""
        if self.pipe_size == 1:
            return
        seen = torch.tensor([rows, -rows], dtype=torch.int64)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self.link.header_group)
        most, least = int(seen[0]), -int(seen[1])
        if most != least:
            raise ValueError(f"pipeline rank {self.rank} (global rank {self.ranks[self.rank]}): the ranks of one "
                             f"pipeline passed batches of {least} to {most} samples (this one {rows}): every rank of a "
                             "pipeline must pass the same batch (fit does; in a loop of your own, shard the data by "
                             "trainer.dp_rank of trainer.dp_world_size, not by rank)")

    def _actions_for(self, microbatches: int) -> list:
        """This rank's actions for a batch cut into fewer microbatches than configured."""
        if microbatches not in self._short_schedules:
            try:
                actions = build_schedule(self.schedule, self.pipe_size, microbatches, chunks=len(self.chunks))
            except ValueError as err:
                lockstep = self.lockstep_replicas and self.data_size > 1
                whose = " (the fewest of any data-parallel replica's)" if lockstep else ""
                raise ValueError(f"a batch of {microbatches} samples{whose} is smaller than "
                                 f"microbatches={self.microbatches} "
                                 f"and schedule {self.schedule!r} cannot run it in {microbatches} ({err}): give "
                                 "batches of at least `microbatches` samples (fit(drop_last=True))") from err
            self._short_schedules[microbatches] = actions[self.rank]
        return self._short_schedules[microbatches]

    def _step(self, xs: list[Any], ys: list[Any], weights: StepWeights, actions: list) -> torch.Tensor:
        held: dict[tuple[int, int], tuple[Any, Any]] = {}  # (microbatch, chunk) -> (input, output or loss)
        loss_sum = torch.zeros((), device=self.device)
        last = self.num_stages - 1
        me, link = self.rank, self.link
        split = self.split
        clock = None
        if self.timing:
            clock = self._clock if self._clock is not None else ActionClock(self.device)
            self._clock = clock
            clock.reset()
        link.begin_step(_shapes_of(xs))
        if self.graphs is not None:
            self.graphs.begin_step()
        try:
            for action in actions:
                stage = stage_of(me, action.chunk, self.pipe_size)
                mb, chunk = action.microbatch, action.chunk
                if action.kind == "F":
                    if stage == 0:
                        x = xs[mb]
                    else:
                        x = link.recv(me, (stage - 1) % self.pipe_size)
                        if x.is_floating_point():
                            x.requires_grad_(True)
                    # The start mark after the receive: on CUDA recv() has made the stream wait for the
                    # payload, so the event fires when the input is there, not when the host got here.
                    start = clock.start() if clock is not None else None
                    with split.record((mb, chunk)) if split is not None else nullcontext():
                        out = self._forward(chunk, stage, x, mb)
                    if stage == last:
                        loss = self.loss_fn(out, ys[mb])
                        loss_sum = loss_sum + weights.reported(loss.detach().float(), mb)
                        held[mb, chunk] = (x, weights.backward(loss, mb))
                    if clock is not None:
                        clock.stop("F", mb, chunk, start)
                    if stage != last:
                        if not isinstance(out, torch.Tensor):
                            raise TypeError(f"pipeline stage {stage} returned a {type(out).__name__}: a stage hands "
                                            "the next one a single tensor, so cut the model where a layer's output "
                                            "is one tensor (the trainer's pipeline_split_points)")
                        held[mb, chunk] = (x, out)
                        link.send(out.detach(), me, (stage + 1) % self.pipe_size)
                elif action.kind == "W":  # the weight gradients that the I of (mb, chunk) deferred
                    start = clock.start() if clock is not None else None
                    slot = self._slots.pop((mb, chunk), None)
                    if slot is not None:  # a graphed microbatch: its W graph
                        self.graphs.weight_grad(chunk, slot)
                    split.weight_grad((mb, chunk))
                    if clock is not None:
                        clock.stop("W", mb, chunk, start)
                else:  # "B", or "I": the same pass with the recorded linear layers' weight gradients deferred
                    x, out = held.pop((mb, chunk))
                    # An integer activation (token ids) has no gradient: the next stage sends none back.
                    sent_float = isinstance(out, torch.Tensor) and out.is_floating_point()
                    grad = None if stage == last or not sent_float else link.recv(me, (stage + 1) % self.pipe_size)
                    start = clock.start() if clock is not None else None
                    dx = None
                    if out.requires_grad:  # not: a stage whose parameters are all frozen, fed the batch
                        if action.kind == "I":
                            dx = split.backward_input((mb, chunk), out, grad,
                                                      x if isinstance(x, torch.Tensor) else None)
                        else:
                            out.backward(grad)
                            dx = x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None
                    if (mb, chunk) in self._slots and action.kind == "B":
                        slot = self._slots.pop((mb, chunk))
                        self.graphs.weight_grad(chunk, slot)  # (a split slot's W right away; else a release)
                    back = None
                    if stage > 0 and isinstance(x, torch.Tensor) and x.requires_grad:
                        # An input the stage ignored has no gradient: the previous stage still waits for one.
                        back = dx if dx is not None else torch.zeros_like(x)
                    if clock is not None:
                        clock.stop(action.kind, mb, chunk, start)
                    if back is not None:
                        link.send(back, me, (stage - 1) % self.pipe_size)
            if split is not None and (split.pending() or self._slots):
                raise RuntimeError(f"pipeline rank {self.rank}: the schedule left weight gradients of "
                                   f"{sorted(set(split.pending()) | set(self._slots))} (microbatch, chunk) "
                                   "without a W action")
            if self.graphs is not None:  # the graphed backward passes' parameter gradients, into .grad
                self.graphs.flush()
            link.end_step()
        finally:
            if split is not None:
                split.reset()  # the step's deferred work and casts: nothing survives the step
            if self.graphs is not None:
                self.graphs.reset()
                self._slots.clear()
        if held:
            raise RuntimeError(f"pipeline rank {self.rank}: the schedule left {len(held)} microbatch(es) without a "
                               "backward")
        if self.after_backward is not None and not self.after_agreement:
            self.after_backward()
        if self.pipe_size > 1:
            # The step's end, agreed: every other rank tells the last one its schedule ran to the end (a rank
            # that failed sent it a stop instead), and only then does the last rank send the loss to every
            # rank (by message: no collective a failed rank would leave the others waiting in). A rank whose
            # part ended before the failure (the last one, when an earlier stage's backward raises) thus
            # raises too, and no rank steps its optimizer on a step the others dropped.
            # (The schedule's sends are waited for after it: on gloo a send waits for its receiver, and
            # a rank waiting there for a peer that failed would never hear of the failure.)
            if self.is_last:
                for peer in range(self.pipe_size - 1):
                    link.recv(me, peer)
                for peer in range(self.pipe_size - 1):
                    link.send(loss_sum, me, peer)
            else:
                link.send(self._done, me, self.pipe_size - 1)
                loss_sum = link.recv(me, self.pipe_size - 1)
        if self.after_backward is not None and self.after_agreement:
            self.after_backward()
        link.wait_all()
        if clock is not None:
            self.last_timing = self._exchange_timing(clock, len(xs))
        if self.graphs is not None:  # every message of this rank has completed: nothing waits on a peer
            self.graphs.capture_pending()
        link.settle()
        return loss_sum

    def _exchange_timing(self, clock: ActionClock, microbatches: int) -> PipelineTiming:
        """Every rank's `timing.rank_row`, gathered by the last rank and sent back to every rank as one
        table, combined on each: a star, like the loss's messages (after which these go, on the same
        channels), so no order of sends and receives can wait in a circle, even where a send waits
        for its receiver (NCCL)."""
        P, me, link = self.pipe_size, self.rank, self.link
        mine = rank_row(clock.times_ms(), len(self.chunks))
        rows = [mine]
        if P > 1:
            def check(got: torch.Tensor, shape: tuple, peer: int) -> torch.Tensor:
                if got.dtype != torch.float64 or tuple(got.shape) != shape:
                    raise RuntimeError(f"pipeline rank {me}: timing the step, rank {peer} sent a {got.dtype} tensor "
                                       f"of shape {tuple(got.shape)} instead of timings: set PipelineEngine.timing "
                                       "alike on every rank of the pipeline")
                return got

            if self.is_last:
                rows = [check(link.recv(me, peer), (len(mine),), peer).tolist() for peer in range(P - 1)] + [mine]
                table = torch.tensor(rows, dtype=torch.float64, device=self.device)
                for peer in range(P - 1):
                    link.send(table, me, peer)
            else:
                link.send(torch.tensor(mine, dtype=torch.float64, device=self.device), me, P - 1)
                rows = check(link.recv(me, P - 1), (P, len(mine)), P - 1).tolist()
            link.wait_all()
        return combine(rows, rank=me, schedule=self.schedule, microbatches=microbatches, chunks=len(self.chunks))
