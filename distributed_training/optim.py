"""Our own large-batch optimizers (LARS, LAMB), weight-decay exclusions, and warm-up schedules.

* `LARS` (You, Gitman & Ginsburg 2017, "Large Batch Training of Convolutional Networks", Algorithm 1):
  SGD with momentum where each layer's step is scaled by a *trust ratio* computed from the layer's own
  norms, ``eta * ||w|| / (||g|| + beta * ||w||)``, so that no layer moves by more than a fixed fraction
  of its weights however large the global learning rate (what large batches need).
* `LAMB` (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
  Algorithm 2): the same idea over Adam's update: bias-corrected moments, ``r = m^ / (sqrt(v^) + eps)``,
  decoupled weight decay ``u = r + lambda * w``, then ``w -= lr * ||w|| / ||u|| * u``.

A *layer* is one parameter tensor. In both, a zero norm (a layer initialised to zero, or one without
a gradient signal) gives a trust ratio of 1: the plain update, never a division by zero. A param
group with ``layerwise=False`` (what `param_groups` gives the weight-decay exclusions: biases and
normalisation layers, as in the papers' experiments) skips the trust ratio.

Sharded strategies: FSDP (ZeRO-2/3) hands the optimizer one flat shard per unit, holding slices of
several layers. Such a shard carries a `ParamSegments` (``shard.segments``): which elements belong to
which layer and the shard group. The optimizers then sum each layer's squares over its slices, all-reduce
those sums over the shard group (one small all-reduce per shard and norm), and scale each element by its
own layer's ratio: exactly the unsharded result. Per-layer exclusions travel as the group's ``exclude``
(layer names), since one shard cannot be split between param groups. torch's AdamW and SGD cannot read
them: `decay_by_segments` takes their weight decay over (the group's own set to 0) and applies it per
element before each step, as they would have, to the layers that are not excluded.

Schedules: `WarmupSchedule` (a `LambdaLR` factor: linear warm-up, then cosine, linear, step or constant;
a plain object, so its settings are part of the scheduler's state dict and of checkpoints) and
`linear_scaling` (Goyal et al. 2017: the learning rate proportional to the global batch).
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["LARS", "LAMB", "ParamSegments", "WarmupSchedule", "excluded_names", "param_groups", "linear_scaling",
           "EXCLUSION_RULES", "decay_by_segments"]


# ---------------------------------------------------------------------------------------- layouts
@dataclass
class ParamSegments:
    """Which elements of a flat shard belong to which layer (parameter) of the model.

    Attributes:
        names: each layer's state-dict names (tied weights have several), by layer index.
        ranges: ``(start, end, layer index)`` in the shard's own coordinates, one per slice it holds.
        group: the process group the shards of these layers are spread over (None: the default group).
        world_size: the group's size (1: no all-reduce needed).
    """

    names: list[list[str]]
    ranges: list[tuple[int, int, int]]
    group: Any = None
    world_size: int = 1
    _index: dict = field(default_factory=dict, repr=False)

    def __deepcopy__(self, memo: dict) -> "ParamSegments":
        return self  # a description (holding a process group), shared by copies of its shard

    @classmethod
    def for_shard(cls, infos: Sequence[Any], shard_rank: int, shard_numel: int, group: Any,
                  world_size: int) -> "ParamSegments":
        """The segments of shard `shard_rank` (`shard_numel` elements) of a flat vector laid out by
        `infos` (objects with ``fqns``, ``offset`` and ``numel``, as FSDP's units keep them)."""
        lo, hi = shard_rank * shard_numel, (shard_rank + 1) * shard_numel
        ranges = []
        for i, info in enumerate(infos):
            start, end = max(lo, info.offset), min(hi, info.offset + info.numel)
            if start < end:
                ranges.append((start - lo, end - lo, i))
        return cls([list(info.fqns) for info in infos], ranges, group, world_size)

    def index(self, like: torch.Tensor) -> torch.Tensor:
        """Per element, its layer's index (padding: ``len(names)``, a bucket of its own)."""
        key = (like.device, like.numel())
        if key not in self._index:
            idx = torch.full((like.numel(),), len(self.names), dtype=torch.long, device=like.device)
            for start, end, i in self.ranges:
                idx[start:end] = i
            self._index[key] = idx
        return self._index[key]


def _segments(p: torch.Tensor) -> ParamSegments | None:
    return getattr(p, "segments", None)


def _layer_norms(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The 2-norm of each layer `x` (shaped like `p`) holds: a 0-d tensor for a whole parameter, one
    value per layer (index as in ``p.segments``, plus the padding's) for a shard, summed over the group."""
    seg = _segments(p)
    dtype = torch.promote_types(x.dtype, torch.float32)  # bf16 / fp16 layers are summed in fp32
    if seg is None:
        return torch.linalg.vector_norm(x.to(dtype))
    flat = x.reshape(-1).to(dtype)
    sums = torch.zeros(len(seg.names) + 1, dtype=dtype, device=x.device)
    sums.index_add_(0, seg.index(flat), flat * flat)
    if seg.world_size > 1:
        dist.all_reduce(sums, group=seg.group)
    return sums.sqrt()


def _per_element(p: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per-layer `values` (from `_layer_norms`' layout) as a tensor that broadcasts over `p`."""
    seg = _segments(p)
    if seg is None:
        return values
    return values[seg.index(p.reshape(-1))].reshape(p.shape).to(p.dtype)


def _layer_flags(p: torch.Tensor, group: dict) -> tuple[torch.Tensor | float, torch.Tensor | bool]:
    """(weight decay, layer-wise adaptation on) for each layer of `p`: the group's values, with the
    layers named in ``group["exclude"]`` at (0, off) when `p` is a shard of several layers."""
    wd, layerwise = float(group["weight_decay"]), bool(group["layerwise"])
    seg = _segments(p)
    if seg is None:
        return wd, layerwise
    exclude = set(group.get("exclude", ()))
    kept = torch.tensor([not (set(names) & exclude) for names in seg.names] + [False], device=p.device)
    return (torch.where(kept, wd, 0.0).to(torch.promote_types(p.dtype, torch.float32)), kept & layerwise)


def _trust(numerator: torch.Tensor, denominator: torch.Tensor, norms: tuple[torch.Tensor, torch.Tensor],
           layerwise: torch.Tensor | bool) -> torch.Tensor:
    """numerator / denominator per layer where both `norms` (the weights' and the gradient's or the
    update's) are positive and the layer adapts, else 1."""
    ok = (norms[0] > 0) & (norms[1] > 0) & torch.as_tensor(layerwise, device=numerator.device)
    return torch.where(ok, numerator / torch.where(ok, denominator, 1.0), 1.0)


def _check(name: str, value: float, low: float = 0.0, high: float | None = None, open_low: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value) \
            or (value <= low if open_low else value < low) or (high is not None and value >= high):
        bound = f"> {low}" if open_low else f">= {low}"
        raise ValueError(f"{name} must be {bound}{f' and < {high}' if high is not None else ''}, got {value!r}")


# ------------------------------------------------------------------------------------------ LARS
class LARS(torch.optim.Optimizer):
    """Layer-wise Adaptive Rate Scaling (You et al. 2017, Algorithm 1), for each layer w with gradient g::

        local_lr = trust_coefficient * ||w|| / (||g|| + weight_decay * ||w|| + eps)   (1 if ||w|| or ||g|| is 0)
        v = momentum * v + lr * local_lr * (g + weight_decay * w)
        w = w - v                                  (nesterov: w - (momentum * v + lr * local_lr * (g + wd * w)))

    Args:
        params: parameters or param groups (a group may set ``layerwise=False``: local_lr = 1).
        lr: the global learning rate (the schedule's).
        momentum: momentum m, in [0, 1).
        weight_decay: beta, the L2 penalty, inside the trust ratio as in the paper.
        trust_coefficient: eta, the largest relative change of a layer per step (0.001 in the paper).
        eps: added to the trust ratio's denominator (0: the paper's formula).
        nesterov: Nesterov momentum (needs momentum > 0).
    """

    def __init__(self, params, lr: float = 1.0, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 0.0, nesterov: bool = False) -> None:
        _check("lr", lr, open_low=True)
        _check("momentum", momentum, high=1.0)
        _check("weight_decay", weight_decay)
        _check("trust_coefficient", trust_coefficient, open_low=True)
        _check("eps", eps)
        if nesterov and momentum == 0:
            raise ValueError("nesterov needs momentum > 0")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient,
                        eps=eps, nesterov=nesterov, layerwise=True, exclude=())
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            m, lr, eta, eps = group["momentum"], group["lr"], group["trust_coefficient"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                wd, layerwise = _layer_flags(p, group)
                w_norm, g_norm = _layer_norms(p, p), _layer_norms(p, g)
                local = _trust(eta * w_norm, g_norm + wd * w_norm + eps, (w_norm, g_norm), layerwise)
                if isinstance(wd, torch.Tensor):  # a shard of several layers: each layer's own decay
                    d = g + _per_element(p, wd) * p
                else:
                    d = g.add(p, alpha=wd) if wd else g.clone()
                d.mul_(_per_element(p, local) * lr)
                state = self.state[p]
                if m == 0:
                    p.sub_(d)
                    continue
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = d.clone()
                else:
                    state["momentum_buffer"].mul_(m).add_(d)
                v = state["momentum_buffer"]
                p.sub_(d.add(v, alpha=m) if group["nesterov"] else v)
        return loss


# ------------------------------------------------------------------------------------------ LAMB
class LAMB(torch.optim.Optimizer):
    """Layer-wise Adaptive Moments for Batch training (You et al. 2019, Algorithm 2), for each layer::

        m = beta1 * m + (1 - beta1) * g            v = beta2 * v + (1 - beta2) * g^2
        m^ = m / (1 - beta1^t)                     v^ = v / (1 - beta2^t)      (bias_correction)
        r = m^ / (sqrt(v^) + eps)                  u = r + weight_decay * w
        w = w - lr * ||w|| / ||u|| * u             (the ratio is 1 if a norm is 0 or layerwise=False)

    with the paper's scaling function phi the identity.

    Args:
        params: parameters or param groups (a group may set ``layerwise=False``).
        lr: the learning rate.
        betas: (beta1, beta2), each in [0, 1).
        eps: added to sqrt(v^).
        weight_decay: lambda, decoupled (inside the trust ratio, as in the paper).
        bias_correction: divide the moments by (1 - beta^t), as Algorithm 2 does.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, bias_correction: bool = True) -> None:
        _check("lr", lr, open_low=True)
        if len(betas) != 2:
            raise ValueError(f"betas must be two numbers, got {betas!r}")
        _check("betas[0]", betas[0], high=1.0)
        _check("betas[1]", betas[1], high=1.0)
        _check("eps", eps)
        _check("weight_decay", weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, layerwise=True, exclude=())
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            (b1, b2), eps, lr = group["betas"], group["eps"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = float(state["step"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                c1, c2 = (1 - b1 ** t, 1 - b2 ** t) if group["bias_correction"] else (1.0, 1.0)
                u = (m / c1) / ((v / c2).sqrt() + eps)
                wd, layerwise = _layer_flags(p, group)
                if isinstance(wd, torch.Tensor):
                    u.add_(_per_element(p, wd) * p)
                elif wd:
                    u.add_(p, alpha=wd)
                w_norm, u_norm = _layer_norms(p, p), _layer_norms(p, u)
                ratio = _trust(w_norm, u_norm, (w_norm, u_norm), layerwise)
                p.sub_(u * (_per_element(p, ratio) * lr))
        return loss


# -------------------------------------------------------------------- weight-decay exclusions
#: Words `exclude_from_weight_decay` understands; anything else is a glob on parameter names.
EXCLUSION_RULES = {
    "bias": "every parameter named bias",
    "norm": "the parameters of normalisation layers (BatchNorm, LayerNorm, GroupNorm, RMSNorm, ...)",
    "embedding": "the weights of embedding layers (nn.Embedding)",
}

_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm) + (
    (nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


def excluded_names(model: nn.Module, rules: Iterable[str]) -> set[str]:
    """The names of `model`'s parameters (``named_parameters``) that `rules` exclude from weight decay.

    A rule is ``bias``, ``norm``, ``embedding`` (see `EXCLUSION_RULES`) or a glob on the name
    (``"head.*"``). Works on a model on the meta device (names and module types only)."""
    rules = list(rules)
    out: set[str] = set()
    for path, module in model.named_modules():
        kind_norm = isinstance(module, _NORMS) or type(module).__name__.endswith("Norm")
        kind_embedding = isinstance(module, nn.Embedding)
        for attr, p in module.named_parameters(recurse=False):
            name = f"{path}.{attr}" if path else attr
            for rule in rules:
                if (rule == "bias" and attr == "bias") or (rule == "norm" and kind_norm) \
                        or (rule == "embedding" and kind_embedding) \
                        or (rule not in EXCLUSION_RULES and fnmatch.fnmatchcase(name, rule)):
                    out.add(name)
    return out


def param_groups(params: Iterable[torch.Tensor], names: dict[int, str], exclude: set[str],
                 weight_decay: float) -> list[dict[str, Any]]:
    """Param groups: the parameters to decay, and (when `exclude` names any of `params`, by `names`: id
    -> name) the excluded ones, with ``weight_decay=0`` and ``layerwise=False`` (LARS / LAMB do not adapt
    them either). A shard of several layers (``p.segments``) stays in the first group, the exclusions
    travelling as its ``exclude``. An empty group is left out."""
    params = list(params)
    if exclude and any(_segments(p) is None and id(p) not in names and p.numel() for p in params):
        raise ValueError("param_groups: the strategy hands the optimizer tensors that are neither the model's "
                         "parameters nor shards that say their layers (strategy 'zero1''s flat shards), so the "
                         "exclusions from weight decay cannot be applied: use ddp, zero2 or zero3")
    decay, kept = [], []
    for p in params:
        (kept if _segments(p) is None and names.get(id(p)) in exclude else decay).append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay, "exclude": tuple(sorted(exclude))})
    if kept:
        groups.append({"params": kept, "weight_decay": 0.0, "layerwise": False, "exclude": tuple(sorted(exclude))})
    return groups


def decay_by_segments(optimizer: torch.optim.Optimizer) -> bool:
    """Make torch's `AdamW` or `SGD` skip the excluded layers of flat shards (``p.segments``) when
    decaying weights; True if any group needed it.

    Such a group's ``weight_decay`` moves to ``segment_weight_decay`` (the optimizer itself then decays
    nothing there) and a step pre-hook applies it to the layers not in the group's ``exclude``, exactly
    as the optimizer would have: AdamW's decoupled ``p *= 1 - lr * wd`` (what its step does first),
    SGD's ``grad += wd * p`` (what it adds before momentum; ``grad -= wd * p`` with ``maximize``, which
    negates the gradient first). The other layers, and the padding, are left
    alone. Per-parameter groups (DDP) need none of this: `param_groups` gives the exclusions a group."""
    decoupled = isinstance(optimizer, torch.optim.AdamW)
    if not decoupled and not isinstance(optimizer, torch.optim.SGD):
        raise TypeError(f"decay_by_segments takes torch.optim.AdamW or SGD, got {type(optimizer).__name__}")
    groups = [g for g in optimizer.param_groups if g.get("exclude") and g["weight_decay"]
              and any(_segments(p) is not None for p in g["params"])]
    for g in groups:
        g["segment_weight_decay"], g["weight_decay"] = g["weight_decay"], 0.0

    masks: dict[int, torch.Tensor | bool] = {}  # per parameter: which elements decay (built once, on its device)

    def mask(p: torch.Tensor, exclude: set[str]) -> torch.Tensor | bool:
        if id(p) not in masks:
            seg = _segments(p)
            if seg is None:
                masks[id(p)] = True
            else:
                kept = torch.tensor([not (set(names) & exclude) for names in seg.names] + [False], device=p.device)
                masks[id(p)] = kept[seg.index(p.reshape(-1))].reshape(p.shape)
        return masks[id(p)]

    def decay(opt, args, kwargs) -> None:
        for g in opt.param_groups:
            wd = g.get("segment_weight_decay")
            if not wd:
                continue
            exclude = set(g["exclude"])
            for p in g["params"]:
                if p.grad is None:
                    continue
                keep = mask(p, exclude)
                with torch.no_grad():
                    if decoupled:  # the same scalar AdamW multiplies by, cast as it casts it
                        p.copy_(torch.where(keep, p * (1 - g["lr"] * wd), p))
                    else:  # (SGD with maximize negates the gradient, then adds wd * p: the hook's term, too)
                        sign = -1.0 if g.get("maximize") else 1.0
                        p.grad.copy_(torch.where(keep, p.grad.add(p, alpha=sign * wd), p.grad))

    if groups:
        optimizer.register_step_pre_hook(decay)
    return bool(groups)


# ---------------------------------------------------------------------------------- schedules
class WarmupSchedule:
    """The learning-rate factor at each optimizer step (a `torch.optim.lr_scheduler.LambdaLR` lambda).

    With W = `warmup_steps`, T = `total_steps` and r = `min_ratio` (min_lr / lr), at step s (0-based):

    * warm-up, s < W: ``(s + 1) / W`` (linear, reaching 1 at the last warm-up step);
    * then, with p = (s - W) / (T - W) held in [0, 1]: cosine ``r + (1 - r) * (1 + cos(pi p)) / 2``,
      linear ``1 - (1 - r) * p``, constant ``1``, or step ``gamma ** (number of milestones <= s)``.

    A plain object (not a closure): `LambdaLR.state_dict` keeps its fields, so a checkpoint records the
    schedule it was trained with.
    """

    KINDS = ("constant", "cosine", "linear", "step")

    def __init__(self, kind: str = "constant", warmup_steps: int = 0, total_steps: int | None = None,
                 min_ratio: float = 0.0, milestones: Sequence[int] = (), gamma: float = 0.1) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"kind must be one of {', '.join(self.KINDS)}, got {kind!r}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if kind in ("cosine", "linear") and (total_steps is None or total_steps <= warmup_steps):
            raise ValueError(f"kind {kind!r} needs total_steps > warmup_steps ({warmup_steps}), got {total_steps}")
        if not 0 <= min_ratio <= 1:
            raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio}")
        if list(milestones) != sorted(set(milestones)):
            raise ValueError(f"milestones must be increasing, got {list(milestones)}")
        self.kind, self.warmup_steps, self.total_steps = kind, int(warmup_steps), total_steps
        self.min_ratio, self.milestones, self.gamma = float(min_ratio), list(milestones), float(gamma)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        if self.kind == "step":
            return self.gamma ** sum(1 for m in self.milestones if m <= step)
        p = min(1.0, max(0.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)))
        r = self.min_ratio
        if self.kind == "cosine":
            return r + (1 - r) * 0.5 * (1 + math.cos(math.pi * p))
        return 1 - (1 - r) * p


def linear_scaling(lr: float, global_batch: int, base_batch: int) -> float:
    """Goyal et al. 2017's linear scaling rule: `lr` was tuned for `base_batch` samples a step; at
    `global_batch` samples it becomes ``lr * global_batch / base_batch``."""
    if base_batch < 1 or global_batch < 1:
        raise ValueError(f"batch sizes must be >= 1, got global {global_batch}, base {base_batch}")
    return lr * global_batch / base_batch
