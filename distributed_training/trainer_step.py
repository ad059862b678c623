"""The trainer's step (`Stepping`, a mixin of `DistributedTrainer`): one optimizer step on a batch, its
micro-batches weighted as one process on the whole global batch would weigh them (`loss_weights`);
and the check of its criterion."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import torch

from .batches import batch_size_of, call_module, check_readable, model_loss, split_batch, to_device
from .hangs import CollectiveTimeoutError, block_activities, diagnose_lost_peer, diagnose_timeout, heartbeat, is_timeout
from .loss_weights import StepWeights, batch_count, counted, label_count, own_loss
from .peer_watch import looks_like_peer_loss
from .runtime import fewest

Criterion = Callable[[Any, Any], torch.Tensor]


def check_criterion(criterion: Any) -> None:
    """A criterion is a callable ``loss(outputs, targets)`` or None (the model returns the loss): anything else
    (``criterion="cross_entropy"``) is a TypeError naming it, before any step (it failed in the first step's
    forward with "'str' object is not callable")."""
    if criterion is not None and not callable(criterion):
        raise TypeError(f"criterion must be a callable loss(outputs, targets), such as F.cross_entropy or "
                        f"nn.CrossEntropyLoss(), or None when the model returns the loss; got {criterion!r}")


class Stepping:
    """`train_step` for `DistributedTrainer` (which holds the model, strategy, precision and the rest)."""

    def train_step(self, batch: Any, criterion: Criterion | None = None) -> dict[str, torch.Tensor]:
        """One optimizer step on `batch`; returns ``{"loss", "lr"[, "grad_norm"]}``.

        `batch` is ``(inputs, targets)`` when a `criterion` is given (the loss is
        ``criterion(model(inputs), targets)``); without one, `batch` is the model's input and the
        model returns the loss (a tensor, a dict with ``"loss"``, or an object with ``.loss``).
        Inputs that are tuples are unpacked as positional arguments, dicts as keyword arguments.

        The loss values are 0-dim tensors on the device: reading one (``float(...)``) waits for the
        GPU, so do it only when logging.
        """
        self._check_open("train_step()")
        check_criterion(criterion)
        self._check_not_summoned("train_step()")
        if self._checkpoint_write is not None:
            self._check_checkpoint_write()  # a background checkpoint write that failed raises here
        watch = self._peer_watch()
        if watch is not None:
            watch.step = self.step
            watch.raise_if_failed()  # a peer died since the last step
        self._failure_agreement.check(watch)  # an earlier failed call: every rank's? (`failure_agreement`)
        heartbeat(self.context, self.step)
        self._step_failed = True  # until it returns: `close` must not wait for peers inside its collectives
        try:
            with self._watching(f"training step {self.step + 1}"):
                metrics = self._train_step(batch, criterion)
            self._step_failed = False
            self._synced_at = time.monotonic()
            return metrics
        except BaseException as err:
            if not isinstance(err, Exception):  # Ctrl-C: the step's gradients dropped too, nothing to report
                with contextlib.suppress(Exception):
                    self._zero_grad()
                raise
            # The step was not taken: gradients its backward left (DDP's parameters reached before the
            # error) must not join the next step's, as one process skipping the batch would not add them.
            with contextlib.suppress(Exception):
                self._zero_grad()
            explained = self.strategy.explain_failure(err)
            if explained is not None:
                explained.__cause__, err = err, explained
            self._failed(err)  # a peer's failure named; this rank's own error told to the peers
            self._failure_agreement.failed(err, f"training step {self.step + 1}")
            if is_timeout(err) or (looks_like_peer_loss(err) and block_activities(self.context)):
                # (gloo closes the connection of a collective that timed out: the rank whose wait ended
                # second sees that, here while a peer is inside a collective call of its own)
                raise CollectiveTimeoutError(diagnose_timeout(self.context, self.step, err)) from err
            if looks_like_peer_loss(err):  # (a peer that gave up waiting for this rank, or the store's host gone)
                idle = (time.monotonic() - self._synced_at) if self._synced_at is not None else None
                said = diagnose_lost_peer(self.context, self.step, err, idle)
                if said is not None:
                    raise CollectiveTimeoutError(said) from err
                left = self._watch.left_early() if self._watch is not None else None  # (a peer that stopped early)
                if left is not None:
                    raise left from err
            if isinstance(err, ValueError) and "Expected more than 1 value per channel" in str(err):
                raise ValueError(f"training step {self.step + 1}: {err}: a (micro-)batch of one sample reached a "
                                 "BatchNorm layer that sees one value a channel (a ResNet's last layers on small "
                                 "images). In fit, pass drop_last=True (each epoch's last batch then goes) or a "
                                 "batch_size that leaves 2 or more a replica and micro-batch") from err
            if explained is not None:
                raise err
            raise

    def _zero_grad(self) -> None:
        """The optimizer's gradients, and those of the parameters an optimizer object over some of the model
        left out (its zero_grad reaches only its own): they grew step after step, and the clipping norm
        counted them (0.64 for a step whose gradients' norm was 0.46, then more)."""
        self.optimizer.zero_grad(set_to_none=True)
        for p in self._left_out:
            p.grad = None

    def _train_step(self, batch: Any, criterion: Criterion | None) -> dict[str, torch.Tensor]:
        if not self.model.training:  # train() walks every module: not per step, and it would undo a
            self.model.train()       # submodule the user put in eval mode on purpose (frozen BatchNorm)
        check_readable(batch)
        batch = to_device(batch, self.device)
        criterion = self.strategy.loss_criterion(criterion)  # tensor parallelism: the vocabulary-parallel loss
        # A strategy that schedules forward and backward itself (a pipeline) runs the whole batch.
        loss_sum = self.strategy.forward_backward(self.model, batch, criterion, self.precision)
        parts = self.gradient_accumulation_steps
        if (loss_sum is None and parts > 1 and self.strategy.collective_forward and self.dp_world_size > 1
                and not self.context.independent):
            # FSDP gathers parameters in every forward: the replicas must run as many micro-batches as each
            # other, and a replica whose batch has fewer rows than `parts` (an epoch's short last batch)
            # runs fewer. They agree on the fewest (each micro-batch's weight keeps the whole batch's loss).
            # A replica with no rows runs as many empty ones as the others run (it made them all run their
            # whole batch in one forward: the memory accumulation was asked to bound).
            rows = batch_size_of(batch)
            parts = fewest(min(parts, rows) if rows else parts, self.context.mesh.host_group("data"))
        micro_batches = split_batch(batch, parts) if loss_sum is None else []
        if len(micro_batches) == 1 and micro_batches[0][1] == 0:
            micro_batches *= parts  # (an empty batch: `parts` empty micro-batches, where the replicas agreed on it)
        # Each micro-batch's loss weighted so that the accumulated gradient is that of the whole batch's
        # loss, even when the batch does not split evenly or its micro-batches ignore different numbers of
        # targets (`loss_weights`). (One micro-batch: weight 1, and no kernel launched for it.)
        targets = [micro[1] if criterion is not None and isinstance(micro, (tuple, list)) and len(micro) == 2 else None
                   for micro, _ in micro_batches]
        # Replicas whose batches keep different numbers of targets count by them too; a model computing
        # its own loss from the batch's labels counts what it averages over (`label_count`).
        meet = self.strategy.replicas_meet and not self.context.independent
        replicas = self.dp_world_size if meet and loss_sum is None else 1
        wants_count = self.strategy.wants_batch_count and bool(micro_batches)  # a parameter server's sync
        weighing = criterion if criterion is not None else own_loss(self.module)  # (a model's own sum: as one)
        weights = StepWeights(
            weighing, targets, [size for _, size in micro_batches],
            lambda i: (label_count(self.module, *micro_batches[i]) if criterion is None
                       else counted(criterion, targets[i], micro_batches[i][1])),
            group=self.context.mesh.group("data"), replicas=replicas, device=self.device, keep_counts=wants_count)
        if wants_count:  # its servers weigh each worker's gradient by what its batch counts
            self.strategy.set_batch_count(self.model, batch_count(weighing, weights.counts))
        for k, (micro, _) in enumerate(micro_batches):
            last = k == len(micro_batches) - 1
            with contextlib.nullcontext() if last else self.strategy.no_sync(self.model):
                with self.precision.autocast():
                    loss = self._loss(micro, criterion)
                self.strategy.backward(self.model, weights.backward(loss, k), self.precision)
            weighted = weights.reported(loss.detach().float(), k)
            loss_sum = weighted if loss_sum is None else loss_sum + weighted

        # This replica's factor, for the global loss on log steps (`_with_global_loss`): its value, already
        # waited for by the backward, not the scale (whose all-reduce handle would keep the group alive).
        self._replica_scale = weights.scale.value() if weights.scale is not None and micro_batches else None
        metrics: dict[str, torch.Tensor] = {"loss": loss_sum, **self.precision.metrics()}
        lr = torch.tensor(self.optimizer.param_groups[0]["lr"], dtype=torch.float64)  # the rate this step uses
        _, grad_norm = self.strategy.optimizer_step(self.model, self.optimizer, self.precision,
                                                    self.gradient_clip_val)
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm
        metrics["lr"] = lr
        self._zero_grad()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.step += 1
        return metrics

    def _loss(self, batch: Any, criterion: Criterion | None) -> torch.Tensor:
        if criterion is None:
            return model_loss(self.model, batch)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError("with a criterion, each batch must be an (inputs, targets) pair")
        inputs, targets = batch
        return criterion(call_module(self.model, inputs), targets)
