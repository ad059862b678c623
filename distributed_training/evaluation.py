"""`DistributedTrainer.evaluate`: the exact mean loss (and metrics) over a dataset, across all ranks."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from .batches import batch_rows, call_module, model_loss, to_device
from .comm.collectives import broadcast_coalesced
from .data import ShardedSampler
from .mesh import global_rank
from .loss_weights import classified, counted, label_count, own_loss, scored_targets, sums as sums_over_batch, weigh

__all__ = ["Evaluation"]

Criterion = Callable[[Any, Any], torch.Tensor]


class Evaluation:
    """A mixin of `DistributedTrainer`: evaluation needs its model, strategy and context."""

    def evaluate(
        self,
        data: Dataset | DataLoader | Iterable[Any],
        criterion: Criterion | None = None,
        *,
        batch_size: int | None = None,
        metrics: str | Sequence[str] | Mapping[str, Callable[[Any, Any], torch.Tensor]] | None = None,
    ) -> dict[str, float]:
        """Mean loss (and optional per-sample metrics) over the whole dataset, across all ranks: each
        batch's loss weighted by what its mean is over (its rows, or for class-index targets the targets
        the criterion does not ignore, -100: `loss_weights.counted`), as one pass over the whole set. A
        criterion that sums (``nn.CrossEntropyLoss(reduction="sum")``) has its batches' sums added and
        divided by the samples: the loss per sample, the same at any batch size and world size.

        Each rank evaluates its exact shard (no padding, nothing counted twice) with the unwrapped
        module, so uneven shard sizes cannot stall a collective; one all-reduce sums the results.
        Under a pipeline the ranks of a replica evaluate the same shard, forward only through their
        stages; the last stage's values reach the others at the end (`Strategy.evaluate_batch`).
        An iterable of batches (a DataLoader over an IterableDataset, a generator: `batches_as_given`;
        a list is samples) is taken as `fit` takes one, but not under a pipeline: each rank evaluates the
        batches its own iterable yields (the ranks of one tensor group the same ones; under ZeRO-3 / FSDP,
        whose forwards are collective, the ranks agree batch by batch on when every one is done); batches
        weigh as above, so a stream dealt to the
        replicas without overlap scores as one pass over it. Independent ranks (a parameter server's
        async / ssp workers) score their own iterable alone.
        `metrics` names metrics as `fit`'s ``eval_metrics`` does (``"accuracy"``, ``"top5"``,
        ``"perplexity"``, a list of them, or ``"auto"``), or maps a name to ``fn(outputs, targets) ->
        per-batch mean``, weighted by batch size;
        a function with the attribute ``reduction = "sum"`` returns the batch's sum instead (a count,
        such as `validation.correct_count`: summed exactly), divided by the number of samples, or with
        ``over_targets = True`` by the class-index targets the criterion does not ignore (accuracies).

        Buffers that each replica updates with its own batches (BatchNorm's running statistics: those
        a state dict holds, when every replica holds the same ones) are the first replica's during the
        evaluation, on every rank: the model `full_state_dict()` exports is the one scored. Each rank's
        own come back afterwards.

        Training is left as it was: every module's train/eval mode is restored one by one (a
        submodule you froze in eval mode stays so), and the random number generators (the CPU's and
        this rank's device's) are put back, so the next training step draws what it would have
        drawn without the evaluation.
        """
        from .trainer_step import check_criterion
        from .validation import perplexity_of, resolve_metrics

        check_criterion(criterion)
        self._check_open("evaluate()")
        self._check_not_summoned("evaluate()")
        dataset = data.dataset if isinstance(data, DataLoader) else data
        _, functions, perplexity = resolve_metrics(metrics, dataset, criterion, parameter="metrics")
        when = f"after step {self.step}" if self.step else "before the first step"
        with self._watched(f"the evaluation {when}", call=True):  # a peer failing: named
            names, _, total = self._evaluation_sums(data, criterion, batch_size=batch_size, metrics=functions)
            count = total[-1].item()
        values = {name: (total[k].item() / count if count else float("nan")) for k, name in enumerate(names)}
        if perplexity:
            values["perplexity"] = perplexity_of(values["loss"])
        return values

    def _use_first_replicas_buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every replica evaluates with the first replica's buffers (BatchNorm's running statistics,
        which each rank updates with its own batches): the model that `full_state_dict()` and a
        checkpoint's rank 0 hold, scored as one. Returns (buffer, this rank's own value) to put back."""
        buffers = _buffers(self.module)
        if not buffers or self.strategy.name == "parameter_server":
            # Nothing to agree on (every rank built the same model: no collective); a parameter server's
            # workers evaluate what the servers hold, each with its own buffers, and may lose a peer.
            return []
        group = self.context.mesh.group("data")
        # Only if every replica holds the same buffers (a cache grown to each rank's longest sequence
        # does not): one small gather of their names and shapes first.
        layout = [(name, tuple(b.shape), str(b.dtype)) for name, b in buffers]
        layouts = [None] * dist.get_world_size(group)
        dist.all_gather_object(layouts, layout, group=group)
        if any(other != layout for other in layouts):
            return []
        own = [(b, b.clone()) for _, b in buffers]
        broadcast_coalesced([b for _, b in buffers], global_rank(group, 0), group)
        return own

    @torch.no_grad()
    def _evaluation_sums(
        self,
        data: Dataset | DataLoader,
        criterion: Criterion | None,
        *,
        batch_size: int | None,
        metrics: Mapping[str, Callable[[Any, Any], torch.Tensor]] | None,
    ) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        """`evaluate`'s sums: (names, this replica's sums, every replica's), each sum vector float64 with
        one entry per name (``"loss"`` first, then `metrics`) and the number of samples last."""
        devices = [self.device] if self.device.type == "cuda" else []
        # Not the next training step's communication: a strategy timing it (the step after a log step, see
        # `StepRecording`) would count the evaluation's collectives (FSDP's gathers, tensor-parallel layers').
        measuring = self._measuring
        if measuring:
            self.strategy.measure_communication(self.model, False)
        try:
            # A DataLoader draws its base seed from the global generator, and a model may draw in eval mode.
            with torch.random.fork_rng(devices=devices):
                return self._sums(data, criterion, batch_size, metrics)
        finally:
            if measuring:
                self.strategy.measure_communication(self.model, True)

    def _sums(self, data, criterion, batch_size, metrics) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        ctx = self.context
        given = batches_as_given(data)  # this rank's own batches (as `fit` takes an iterable), not samples
        if given and batch_size is not None and ctx.is_main:
            warnings.warn(f"evaluate(batch_size={batch_size}) is not used: a {type(data).__name__} is iterated as "
                          "given, each item one batch (as fit takes it); for evaluate to shard and batch samples, "
                          "pass a map-style dataset", UserWarning, stacklevel=5)
        if given and ctx.mesh.size("pipeline") > 1:
            # (a stage's error ends a pipeline's evaluation through its own messages, which a per-batch
            # agreement among the ranks would block: the trial's hang; and its ranks must read the same)
            raise ValueError(f"evaluate() under a pipeline takes a map-style dataset (or a DataLoader over one), "
                             f"which it shards by replica exactly, not an iterable of batches ({type(data).__name__})")
        if given:
            dataset, bs, collate = None, None, None
        elif isinstance(data, DataLoader):
            dataset, bs, collate = data.dataset, data.batch_size, data.collate_fn
            if batch_size is not None and batch_size != bs and ctx.is_main:
                warnings.warn(f"evaluate(batch_size={batch_size}) is not used: the DataLoader given brings its own "
                              f"batch size ({bs}), which evaluate keeps; pass the dataset instead, or build the "
                              "DataLoader with the batch you want", UserWarning, stacklevel=5)
        else:
            dataset, bs, collate = data, batch_size, None
        if bs is None and not given:
            hint = (" (a list is taken as samples: for a list of batches pass iter(batches), each item then one "
                    "batch)" if isinstance(data, (list, tuple)) else "")
            raise ValueError(f"evaluate() needs batch_size (or a DataLoader with one){hint}")
        if not given:
            dataset = _evaluated_samples(data, dataset, bs)
        if metrics and criterion is None:
            raise ValueError("evaluate(metrics=...) needs a criterion: metrics are computed from (outputs, targets)")
        # One shard per data-parallel replica: tensor- or pipeline-parallel peers evaluate the same one.
        # Independent ranks (a parameter server's workers under ssp / async) never meet: each evaluates
        # the whole set, so that no rank waits for one that may have died.
        shards, shard = (1, 0) if ctx.independent else (self.dp_world_size, self.dp_rank)
        if given:  # each rank's own batches (where forwards are collective, their ends agreed batch by batch)
            loader = data
        else:
            sampler = ShardedSampler(dataset, shards, shard, shuffle=False, pad=False)
            loader = DataLoader(dataset, batch_size=bs, sampler=sampler, collate_fn=collate)
        # Sharded models gather parameters inside forward, a collective: every rank must run as many
        # forwards as the others, so a rank whose shard is exhausted repeats a batch with weight 0.
        # Replicated models evaluate the bare module, with no collective per batch.
        # (A sharded model keeps its parameters in the wrapper's shards even in a world of one.)
        criterion = self.strategy.loss_criterion(criterion)
        lockstep = self.strategy.collective_forward and shards > 1  # (gathers over the data-parallel group)
        module = self.model if self.strategy.collective_forward else self.module
        modes = [(m, m.training) for m in module.modules()]
        own_buffers = self._use_first_replicas_buffers() if shards > 1 else []
        module.eval()
        names = ["loss", *(metrics or {})]
        summed = [sums_over_batch(fn) for fn in (metrics or {}).values()]
        over_targets = [k + 1 for k, fn in enumerate((metrics or {}).values()) if getattr(fn, "over_targets", False)]
        if over_targets:  # an accuracy scores the targets the criterion does not ignore, and only those
            metrics = {name: _on_classified(fn, criterion) if getattr(fn, "over_targets", False) else fn
                       for name, fn in metrics.items()}
        # (a model's own loss that sums, a Hugging Face CTC model's: added as a summing criterion's)
        loss_sums = sums_over_batch(criterion) if criterion is not None else own_loss(self.module) is not None
        # [loss x its count, metrics x rows..., targets classified, the loss's count, rows]: a cross-entropy's
        # mean is over the targets it keeps (`loss_weights.counted`), an accuracy over the targets it is not
        # told to ignore (`loss_weights.classified`), the other metrics' over the rows.
        sums = torch.zeros(len(names) + 3, dtype=torch.float64, device=self.device)
        batches, previous = iter(loader), None
        try:
            self.strategy.evaluation_begins(self.model)
            while True:
                batch = next(batches, None)
                if lockstep:
                    if self.context.every_rank(batch is None):  # no rank has a batch left
                        break
                elif batch is None:
                    break
                weight = 1.0
                if batch is None:  # this rank's shard is done (or was empty): a batch that counts 0
                    weight = 0.0
                    if previous is None and given:
                        raise ValueError(
                            f"evaluate(): this rank's data ({type(data).__name__}) yielded no batch while another "
                            f"rank's did; under {self.strategy.name} the ranks run every forward together, so each "
                            "needs at least one batch (a rank done early repeats its last one, counted 0)")
                    batch = previous if previous is not None else next(
                        iter(DataLoader(dataset, batch_size=1, collate_fn=collate)))
                previous = batch
                if criterion is not None and (not isinstance(batch, (tuple, list)) or len(batch) != 2):
                    raise ValueError(f"evaluate() with a criterion needs each batch to be an (inputs, targets) pair; "
                                     f"got {_shape_of(batch)} (without a criterion the model computes its own loss)")
                batch = to_device(batch, self.device)
                rows = batch_rows(batch)
                n = rows * weight
                # A strategy that runs the forward itself (a pipeline: through its stages) gives the values.
                values = self.strategy.evaluate_batch(self.model, batch, criterion, metrics)
                if values is None and criterion is None:
                    values = [model_loss(module, batch)]
                elif values is None:
                    inputs, targets = batch
                    outputs = call_module(module, inputs)
                    values = [criterion(outputs, targets)]
                    values += [fn(outputs, targets) for fn in (metrics or {}).values()]
                kept = targets_kept = n
                if criterion is not None and isinstance(batch, (tuple, list)) and len(batch) == 2:
                    kept = counted(criterion, batch[1], rows) * weight
                    targets_kept = classified(criterion, batch[1], rows) * weight
                elif criterion is None:  # the model's own loss: over the labels it keeps (Hugging Face)
                    kept = label_count(self.module, batch, rows) * weight
                for k, v in enumerate(values):
                    # (a batch that keeps no target: its mean is nan, and counts 0; a summing criterion's
                    # sums are added as they are, over the rows: the per-sample loss at any batch and world)
                    part = weigh(v.detach().double(), (weight if loss_sums else kept) if k == 0
                                 else weight if summed[k - 1] else n)
                    sums[k] += part
                sums[-3] += targets_kept
                sums[-2] += kept
                sums[-1] += n
        except BaseException as err:
            self.strategy.evaluation_failed(self.model, err)
            explained = self.strategy.explain_failure(err)
            if explained is not None:
                raise explained from err
            raise
        finally:
            for m, mode in modes:  # one by one: train() on the root would also wake a frozen submodule
                m.training = mode
            for buffer, own in own_buffers:
                buffer.copy_(own)
        sums = self.strategy.evaluation_sums(sums)  # a pipeline: its last stage's values to its other ranks
        local = sums.clone()
        if shards > 1:  # each replica counted once, whatever shares it
            dist.all_reduce(sums, group=ctx.mesh.group("data"))
        if given and not sums[-1]:  # (the same on every rank)
            raise ValueError(f"evaluate(): the data ({type(data).__name__}) yielded no batch on any rank: empty, or an "
                             "iterator used up by an earlier pass (a generator); pass something iter() gives again "
                             "each time, such as a DataLoader")
        return names, _per_row(local, over_targets, not loss_sums), _per_row(sums, over_targets, not loss_sums)


def _buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a state dict holds (running statistics; not caches registered non-persistent), by name."""
    kept = set()
    for prefix, m in module.named_modules():
        kept.update(f"{prefix}.{name}" if prefix else name for name, b in m._buffers.items()
                    if b is not None and name not in m._non_persistent_buffers_set)
    return sorted((name, b) for name, b in module.named_buffers() if name in kept)


def _on_classified(fn: Callable, criterion: Criterion | None) -> Callable:
    """`fn` on the rows whose class target `criterion` does not ignore (`loss_weights.scored_targets`): the
    logits (the outputs, or their ``logits``) of those rows only."""
    from .validation import _logits

    def scored(outputs, targets):
        keep, logits = scored_targets(criterion, targets), _logits(outputs)
        if keep is None or not torch.is_tensor(logits) or len(logits) != len(targets):
            return fn(outputs, targets)
        return fn(logits[keep], targets[keep])

    return scored


def _per_row(sums: torch.Tensor, over_targets: list[int], mean_loss: bool = True) -> torch.Tensor:
    """[loss x count, metrics x rows..., targets, count, rows] -> [values x rows..., rows]: every value over
    the last entry (what callers divide by the rows), the loss's mean over its own count (nan where it
    kept nothing, as one process's mean over no target; a summing criterion's: its sum per row) and the
    metrics at `over_targets` over the targets classified (nan where none was)."""
    out = torch.cat([sums[:-3], sums[-1:]])
    if float(sums[-2]) > 0:
        out[0] = sums[0] / sums[-2] * sums[-1]
    elif mean_loss:
        out[0] = float("nan")
    for k in over_targets:
        out[k] = sums[k] / sums[-3] * sums[-1] if float(sums[-3]) > 0 else float("nan")
    return out


def batches_as_given(data: Any) -> bool:
    """Whether `evaluate` iterates `data` as this rank's batches, as `fit` does an iterable: a DataLoader over
    an IterableDataset, an IterableDataset, or an iterable without ``__getitem__`` and ``__len__`` (a
    generator, a stream); not a map-style dataset (a list too is samples), which it shards and batches."""
    from torch.utils.data import IterableDataset

    if isinstance(data, DataLoader):
        return isinstance(data.dataset, IterableDataset)
    if isinstance(data, IterableDataset):
        return True
    return (hasattr(data, "__iter__") and not isinstance(data, (Dataset, str, bytes, dict))
            and not (hasattr(data, "__getitem__") and hasattr(data, "__len__")))


def _evaluated_samples(data: Any, dataset: Any, batch_size: int) -> Any:
    """The samples `evaluate` scores: `dataset`, less a DataLoader's last partial batch under
    ``drop_last=True`` (as one process iterating that loader). A sampler that picks or weights samples
    (a subset, class balance) is refused: each rank evaluates its shard of the whole dataset with a
    sampler of its own; an IterableDataset (no length to shard by) is refused too."""
    from torch.utils.data import DistributedSampler, IterableDataset, RandomSampler, SequentialSampler, Subset

    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise ValueError(f"evaluate() shards a map-style dataset (one with __len__ and __getitem__) over the "
                         f"data-parallel ranks; got {type(dataset).__name__}. Pass the samples as a Dataset "
                         "(distributed_training.data.MapDataset(list_of_samples))")
    if isinstance(data, DataLoader):
        # (torch's DistributedSampler shards as evaluate does, less its padding: a script ported from torch DDP)
        if not isinstance(data.sampler, (SequentialSampler, RandomSampler, ShardedSampler, DistributedSampler)):
            raise ValueError(
                f"evaluate() cannot use this DataLoader's sampler ({type(data.sampler).__name__}): each rank "
                "evaluates its shard of the loader's whole dataset, in order, with a sampler of its own. To score "
                "part of the data, pass torch.utils.data.Subset(dataset, indices)")
        if data.drop_last and len(dataset) % batch_size:
            return Subset(dataset, range(len(dataset) - len(dataset) % batch_size))
    return dataset


def _shape_of(batch: Any) -> str:
    """How a batch is built, for an error: its type and, for a tuple or list, its length."""
    if isinstance(batch, (tuple, list)):
        return f"a {type(batch).__name__} of {len(batch)} items"
    return f"a {type(batch).__name__}"

