"""The checks of `DistributedTrainer`'s own arguments, made before any rendezvous: each error names its
argument, and every rank raises alike (no rank waits in a collective the others never reach)."""

from __future__ import annotations

import inspect
import os
import re
import warnings
from typing import Any

from .amp import check_precision_argument

__all__ = ["check_arguments", "check_optimizer", "check_optimizer_after_setup", "check_parallel_arguments",
           "check_optimizer_layout", "check_same_options", "check_scheduler", "compile_options_of",
           "describe_compile", "check_no_closure", "per_element"]


def compile_options_of(compiled: Any) -> dict[str, Any] | None:
    """The `torch.compile` arguments a compiled module was made with, as a dict for ``module.compile``: its
    backend (the object torch.compile made of ``backend=``, ``mode=`` and ``options=``, itself a backend),
    ``fullgraph`` and ``dynamic``; None where this torch keeps them elsewhere. (The trainer compiles the
    module inside a compiled one again, in place: without them a user's backend or mode was replaced by
    the default, inductor.) Read from torch's private fields, hence the fallback."""
    try:
        context = compiled.dynamo_ctx
        backend = context.callback
        while hasattr(backend, "_torchdynamo_orig_backend"):  # torch's wrappers around the backend it made
            backend = backend._torchdynamo_orig_backend
        options = {"backend": backend, "fullgraph": bool(context.fullgraph), "dynamic": context._dynamic}
    except AttributeError:
        return None
    return options if callable(backend) else None


def describe_compile(options: dict[str, Any]) -> str:
    """``backend 'aot_eager', fullgraph`` for the options `compile_options_of` read."""
    backend = options["backend"]
    name = getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None) or type(backend).__name__
    config = getattr(backend, "config", None)
    said = [f"backend {name!r}"] + ([f"options {config}"] if config else [])
    said += ["fullgraph"] if options["fullgraph"] else []
    said += [f"dynamic={options['dynamic']}"] if options["dynamic"] is not None else []
    return ", ".join(said)


def check_arguments(*, gradient_accumulation_steps, gradient_clip_val, heartbeat_timeout, mixed_precision,
                     loss_scaler, compile, checkpoint_every, checkpoint_dir, checkpoint_async,
                     lr_scheduler=None) -> None:
    """The trainer's own arguments, checked before any rendezvous (each error names its argument)."""
    if lr_scheduler is not None and not callable(lr_scheduler):
        raise TypeError(f"lr_scheduler takes a callable that builds the scheduler over the optimizer the trainer makes "
                        f"(e.g. lambda opt: get_cosine_schedule_with_warmup(opt, 100, 1000)), not a "
                        f"{type(lr_scheduler).__name__} built already, over an optimizer the trainer does not step")
    if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be an integer >= 1, got {gradient_accumulation_steps!r}")
    if gradient_clip_val is not None and (isinstance(gradient_clip_val, bool) or
                                          not isinstance(gradient_clip_val, (int, float)) or not gradient_clip_val > 0):
        raise ValueError(f"gradient_clip_val must be positive or None, got {gradient_clip_val!r}")
    if heartbeat_timeout is not None and (isinstance(heartbeat_timeout, bool) or
                                          not isinstance(heartbeat_timeout, (int, float)) or
                                          not heartbeat_timeout > 0):
        raise ValueError(f"heartbeat_timeout must be a positive number of seconds or None, got "
                         f"{heartbeat_timeout!r}")
    check_precision_argument(mixed_precision, loss_scaler)
    if not isinstance(compile, (bool, dict)):
        raise TypeError(f"compile must be True, False or a dict of torch.compile arguments, got "
                        f"{type(compile).__name__}")
    if checkpoint_every is not None and (not isinstance(checkpoint_every, int) or checkpoint_every < 1):
        raise ValueError(f"checkpoint_every must be a positive integer or None, got {checkpoint_every!r}")
    if checkpoint_every is not None and checkpoint_dir is None:
        raise ValueError("checkpoint_every needs a checkpoint_dir to write to")
    if checkpoint_dir is not None and os.path.isfile(checkpoint_dir):  # found at the first save, after training
        raise ValueError(f"checkpoint_dir {os.fspath(checkpoint_dir)!r} is a file: name a directory (fit writes "
                         "step_<N>/ checkpoints under it)")
    if not isinstance(checkpoint_async, bool):
        raise TypeError(f"checkpoint_async must be True or False, got {checkpoint_async!r}")
    if checkpoint_async and checkpoint_dir is None:
        raise ValueError("checkpoint_async needs a checkpoint_dir to write to (it applies to fit's checkpoints)")


def check_scheduler(scheduler: Any) -> None:
    """The scheduler `lr_scheduler` built: the trainer calls its ``step()`` without arguments once per
    optimizer step, so one whose step needs an argument is refused here, before a step (timm's schedulers,
    ``step(epoch)``, failed after the optimizer had stepped; ReduceLROnPlateau, ``step(metric)``)."""
    import inspect

    import torch

    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError("lr_scheduler: ReduceLROnPlateau steps on a metric (scheduler.step(val_loss)), but the "
                         "trainer steps its schedule once per optimizer step without one. Leave lr_scheduler "
                         "out and step a ReduceLROnPlateau of your own over trainer.optimizer with what "
                         "evaluate() or fit's history returns")
    step = getattr(scheduler, "step", None)
    if not callable(step):
        raise TypeError(f"lr_scheduler returned a {type(scheduler).__name__}, which has no step(): return a torch "
                        "learning-rate scheduler (torch.optim.lr_scheduler)")
    try:
        needed = [p.name for p in inspect.signature(step).parameters.values()
                  if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return
    if needed:
        raise TypeError(f"lr_scheduler returned a {type(scheduler).__name__}, whose step() needs {', '.join(needed)}; "
                        "the trainer calls step() without arguments once per optimizer step (as torch's schedulers "
                        "take it). Leave lr_scheduler out and step it yourself: a timm scheduler by "
                        "scheduler.step_update(trainer.step) after each train_step (or step(epoch) after each "
                        "epoch), over trainer.optimizer")


def check_optimizer(optimizer: Any, model: Any) -> None:
    """An optimizer object must step the model's own parameters: one built over another module (or a
    copy of the model) trained nothing, silently. An optimizer over some of them (the rest frozen by
    leaving them out) is fine."""
    import torch

    if not isinstance(optimizer, torch.optim.Optimizer):
        return
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("optimizer: an optimizer object over a model on the meta device would step the meta "
                         "tensors, which the trainer replaces when it gives the model storage (training nothing): "
                         "pass a callable instead, such as lambda params: torch.optim.AdamW(params, lr=3e-4)")
    own = {id(p) for p in model.parameters()}
    given = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [i for i, p in enumerate(given) if id(p) not in own]
    if not foreign:
        return
    which = f"{len(foreign)} of its {len(given)} parameters (indices {foreign[:5]}{' ...' if len(foreign) > 5 else ''})"
    if len(foreign) == len(given):
        raise ValueError(f"optimizer: {which} are not the model's, so stepping it would not train the model: build "
                         "it over model.parameters() of the model given to the trainer (not a copy of it), or pass "
                         "a callable such as lambda params: torch.optim.AdamW(params)")
    warnings.warn(f"optimizer: {which} are not the model's (a criterion's own parameters?): the strategy does not "
                  "average their gradients across ranks, so each rank's copies drift apart. Make them part of the "
                  "model given to the trainer", stacklevel=4)


def check_optimizer_after_setup(given: Any, model_params: set[int], set_up: Any) -> None:
    """An optimizer object holding parameters of the model that the strategy replaced while setting it up
    (tensor parallelism splits layers into new parameters) would step tensors nothing trains with: the
    split layers would silently stay as they were. `model_params`: ids of the model's parameters before."""
    import torch

    if not isinstance(given, torch.optim.Optimizer):
        return
    now = {id(p) for p in set_up.parameters()}
    replaced = [p for group in given.param_groups for p in group["params"] if id(p) in model_params and id(p) not in now]
    if replaced:
        raise ValueError(f"optimizer: {len(replaced)} of its parameters (first of shape {tuple(replaced[0].shape)}) "
                         "were replaced when the strategy set the model up (tensor parallelism splits layers into "
                         "new parameters), so stepping it would leave them untrained: pass a callable that builds "
                         "the optimizer over the parameters it is given, such as "
                         "lambda params: torch.optim.AdamW(params, lr=3e-4)")


def check_parallel_arguments(pipeline: Any, tensor: Any, *, strategy: Any, microbatches: int | None,
                             activation_checkpointing: Any, gradient_accumulation_steps: int, compile: Any) -> None:
    """The pipeline's and tensor parallelism's options (`PipelineOptions`, `TensorOptions`, already
    checked one by one) against the trainer's other arguments."""
    if not pipeline.enabled and microbatches not in (None, 1):
        warnings.warn(f"microbatches={microbatches} does nothing without a pipeline (pipeline_parallel_size=1): "
                      "each batch runs whole; to accumulate gradients over smaller batches use "
                      "gradient_accumulation_steps", stacklevel=4)  # the user's line (through the constructor's wrapper)
    if not pipeline.enabled:
        return
    if pipeline.cuda_graphs and activation_checkpointing is not None:
        raise ValueError("pipeline_cuda_graphs=True does not combine with activation_checkpointing: a "
                         "checkpointed block recomputes in the backward with the random state set from the "
                         "host, which a graph cannot replay")
    if pipeline.cuda_graphs and isinstance(strategy, str) and strategy != "ddp":
        raise ValueError(f"pipeline_cuda_graphs=True needs strategy='ddp' inside the stages, got "
                         f"strategy={strategy!r}: ZeRO and FSDP gather parameters in module hooks, which a "
                         "replayed graph would skip")
    if pipeline.cuda_graphs and tensor.enabled:
        raise ValueError("pipeline_cuda_graphs=True does not combine with tensor_parallel_size > 1 yet: "
                         "the graphs would hold the tensor-parallel collectives (not built, not measured)")
    if gradient_accumulation_steps != 1:
        raise NotImplementedError(f"gradient_accumulation_steps with pipeline_parallel_size={pipeline.size} is not "
                                  "supported yet: use microbatches")
    if compile is not False:
        raise NotImplementedError(f"compile with pipeline_parallel_size={pipeline.size} is not supported yet")


#: Said with an option set on some ranks only, most often a file written "on rank 0 only".
_ON_EVERY_RANK = {
    "log_dir": "the monitor exchanges step times at its log steps (each rank writes its own files under "
               "log_dir/rank_<i>; the bar and the messages come from rank 0 only)",
    "checkpoint_dir": "every rank writes its own part of a checkpoint and the ranks agree on each one; with "
                      "node-local disks give each node's ranks their own directory",
    "eval_dataset": "an evaluation adds up every rank's sums",
}


def describe_option(value: Any) -> Any:
    """What of an option must be equal on every rank: its value where it is a plain one, whether it is set
    for a path (ranks on different nodes may name their own), its kind for anything else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, os.PathLike):
        return "set"
    if isinstance(value, (list, tuple)) and all(v is None or isinstance(v, (bool, int, float, str)) for v in value):
        return tuple(value)
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return tuple(sorted(value))
    return f"<{type(value).__name__}>"


def check_same_options(options: dict[str, Any], where: str, group: Any) -> None:
    """Raise the same ValueError on every rank of `group` where `options` (described by `describe_option`;
    paths and datasets by whether they are given) differ between ranks, naming the first that differs and
    two ranks' values. These options decide what the ranks communicate: given on some ranks only, the
    ranks would wait for one another in collectives the others never reach (a job that hangs, unnamed).
    One all-gather of a few small values."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world == 1:
        return
    mine = {name: describe_option(value) for name, value in options.items()}
    every: list[dict[str, Any] | None] = [None] * world
    dist.all_gather_object(every, mine, group=group)
    for name in mine:
        values = [d.get(name) for d in every]
        if all(v == values[0] for v in values):
            continue
        other = next(r for r, v in enumerate(values) if v != values[0])
        shown = [("set" if v == "set" else "not given" if v is None else repr(v)) for v in (values[0], values[other])]
        why = _ON_EVERY_RANK.get(name, "it decides what the ranks communicate and compute together")
        raise ValueError(f"{where}: {name} differs across ranks: rank 0 has {shown[0]}, rank {other} has {shown[1]}. "
                         f"Give every rank the same {name}: {why}; given on some ranks only, the ranks would "
                         "wait for each other in collectives the others never reach")


def check_same_optimizer(optimizer: Any, group: Any) -> None:
    """Raise the same ValueError on every rank of `group` (a data-parallel group: replicas of the same
    parameters) where the optimizer's settings differ between ranks: a learning rate, weight decay or
    beta that one rank computed its own way (from its node's environment, say) trains its replica
    otherwise, and the replicas drift apart without any other error. One all-gather of the param groups'
    settings (their numbers, strings and flags; not the parameters)."""
    import torch
    import torch.distributed as dist

    from .mesh import global_rank

    world = dist.get_world_size(group)
    if world == 1 or optimizer is None:
        return

    def setting(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return value.item()
        if isinstance(value, (tuple, list)):
            return tuple(setting(v) for v in value)
        return value if value is None or isinstance(value, (bool, int, float, str)) else None

    mine = {(k, key): setting(value) for k, g in enumerate(optimizer.param_groups)
            for key, value in g.items() if key != "params"}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine, group=group)
    for other, theirs in enumerate(every[1:], start=1):
        differing = sorted(k for k in set(every[0]) | set(theirs)
                           if not _same_setting(every[0].get(k, "none"), theirs.get(k, "none")))
        if differing:
            k, key = differing[0]
            raise ValueError(
                f"fit: the optimizer's {key} (param group {k}) differs across ranks: rank {global_rank(group, 0)} has "
                f"{every[0].get((k, key), 'none')!r}, rank {global_rank(group, other)} has "
                f"{theirs.get((k, key), 'none')!r}. Each replica would apply its own and they would drift apart: give "
                "every rank the same optimizer settings")


def _same_setting(a: Any, b: Any) -> bool:
    """Equal, NaN equal to NaN (an "unset" sentinel), in tuples too."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_setting(x, y) for x, y in zip(a, b))
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


#: Optimizers whose step reads a tensor's shape or its whole norm (factored moments, orthogonalised
#: matrices, per-layer trust ratios, LBFGS's dot products): over a slice of a tensor they run another algorithm.
_SHAPED = re.compile(r"lamb|lars|adafactor|muon|shampoo|soap|novograd|lbfgs", re.IGNORECASE)


def check_no_closure(optimizer: Any) -> None:
    """The trainer calls ``optimizer.step()`` without a closure: an optimizer whose step needs one (LBFGS,
    which evaluates the loss several times a step) failed at the first step with torch's TypeError."""
    try:
        closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):
        return
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(f"optimizer {type(optimizer).__name__}'s step needs a closure (it evaluates the loss again "
                         "within a step), and the trainer steps once per batch without one: use an optimizer whose "
                         "closure is optional (SGD, Adam, ...), or your own loop with the DDP wrapper")


def per_element(optimizer: Any) -> bool | None:
    """Whether `optimizer`'s update of each element depends on that element alone (SGD, Adam, ...), tried on
    two small tensors against their concatenation, as a flat shard holds them (two steps of its class with
    its first group's settings, on the CPU): False for one that reads a tensor's shape, rows or whole norm
    (Adafactor, LAMB, one's own); None where it cannot be tried (its constructor takes other arguments, its
    step needs a closure). A list of names found only those it knew (a row-wise optimizer of one's own ran
    another algorithm under ZeRO, 7e-2 off one process in 5 steps, without a word)."""
    import torch

    cached = getattr(type(optimizer), "_dt_per_element", {})
    settings = {k: v for k, v in optimizer.param_groups[0].items() if k in optimizer.defaults
                and k not in ("params", "foreach", "fused", "capturable", "differentiable")}
    try:  # (only what its constructor takes: AdamW's defaults hold Adam's decoupled_weight_decay)
        taken = inspect.signature(type(optimizer).__init__).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in taken.values()):
            settings = {k: v for k, v in settings.items() if k in taken}
    except (TypeError, ValueError):
        pass
    key = repr(sorted(settings.items()))
    if key in cached:
        return cached[key]
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(3, 4, generator=g) + 2, torch.randn(5, generator=g)]
    grads = [[torch.randn(v.shape, generator=g) for v in values] for _ in range(2)]
    apart = [v.clone().requires_grad_() for v in values]
    joined = torch.cat([v.flatten() for v in values]).requires_grad_()
    try:
        one, other = type(optimizer)(apart, **settings), type(optimizer)([joined], **settings)
        for step in grads:
            for p, grad in zip(apart, step):
                p.grad = grad.clone()
            joined.grad = torch.cat([grad.flatten() for grad in step])
            one.step()
            other.step()
        result = bool(torch.allclose(torch.cat([p.detach().flatten() for p in apart]), joined.detach(),
                                     rtol=1e-5, atol=1e-7))
    except Exception:  # (whatever it raises: it cannot be tried here, which says nothing of it)
        result = None
    try:
        type(optimizer)._dt_per_element = {**cached, key: result}
    except (AttributeError, TypeError):
        pass
    return result


def check_optimizer_layout(optimizer: Any, module: Any, tensor_parallel: bool) -> None:
    """The optimizer the strategy built, against what it is handed: our LARS / LAMB need each layer's whole
    norm, which ZeRO-2/3's shards carry (``segments``) but ZeRO-1's flat shards and tensor parallelism's
    slices do not (refused: they ran silently as another algorithm, 1e-3 off one process in 3 steps);
    other optimizers that read a tensor's shape or norm (Adafactor, Muon, others' LAMB) are warned about
    under any of them."""
    from .optim import LAMB, LARS

    params = [p for group in optimizer.param_groups for p in group["params"]]
    own = {id(p) for p in module.parameters()}
    flat = any(getattr(p, "segments", None) is None and id(p) not in own and p.numel() for p in params)
    segmented = any(getattr(p, "segments", None) is not None for p in params)
    name = type(optimizer).__name__
    if tensor_parallel:
        where = "tensor parallelism (each rank holds a slice of a layer)"
    elif flat:
        where = "strategy 'zero1' (flat shards without layer boundaries)"
    elif segmented:
        where = "flat shards of several layers (ZeRO-2/3, FSDP)"
    else:
        return
    if isinstance(optimizer, (LARS, LAMB)):
        if tensor_parallel or flat:
            raise ValueError(f"optimizer {name} needs each layer's whole norm, which it does not see under {where}: "
                             "use strategy ddp, zero2 or zero3 (their shards tell it the layers)")
        return
    if per_element(optimizer) is False or (per_element(optimizer) is None and _SHAPED.search(name)):
        warnings.warn(f"optimizer {name} computes with each tensor's shape or whole norm, but under {where} it is "
                      "handed slices: it then runs another algorithm than on one process, silently. Use DDP, or "
                      "an elementwise optimizer (SGD, Adam, AdamW, ...)", stacklevel=4)
