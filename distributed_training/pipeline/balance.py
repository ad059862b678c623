"""What the stages are balanced by: one cost per chain layer, which `stages.partition` cuts.

``pipeline_balance`` (`PipelineOptions.balance`) chooses the costs:

* ``"parameters"`` (default): each layer's parameter count (a tied weight counted in every layer using it).
* ``"compute"``: our GPT only, each layer's forward and backward cost per token from a compute model
  (`gpt_stages.gpt_layer_costs`: matmul FLOPs, the attention core, the loss and the embedding's
  gradient, fitted to an H200).
* ``"time"``: each layer's forward + backward, measured on this rank's device with one microbatch
  (`measure_layer_times`), averaged over the ranks (`agree`).

Why measure? Both counts mis-weigh something. Parameter counts weigh the GPT's tied token embedding (a
lookup) like its head (a matmul over the vocabulary); FLOP counts ignore that a small model's step is
bound by the host's kernel launches, not by the GPU's arithmetic: GPT-2 124M cut by FLOPs kept the
first rank busy 151 ms a step and the last 38 (2x H200). A measured time sees both.

How a chain is timed (`measure_layer_times`): layer by layer, on a *copy* of each layer moved to the
device (the model object is left alone: no gradients, no running statistics, no storage given to a
meta model), with layer i's input the output of layer i - 1 (detached; floating tensors require
grad, as a received activation does). Each layer runs forward, then backward with a gradient of ones
shaped like its output (our GPT's last layer: from its loss, `lm_loss`, whose softmax over the
vocabulary the last stage computes too), a few times as warm-up and then a few timed repeats, the
device synchronised around each (so the time is the host's launches and the device's work together);
the cost is the median repeat, in seconds. A layer of a model on the meta device (too large for one device) is
materialised alone (`to_empty`, filled from N(0, 0.02) and then its modules' ``reset_parameters``:
values do not matter for the time, but NaNs and denormals would), timed and freed before the next:
the device never holds more than one layer and its activations. The global RNG is restored afterwards.

Where the cut falls (`schedule_cut`, for ``"compute"`` and ``"time"``): not only where the largest
stage is smallest (`stages.partition`, which parameter counts use: memory), but where the schedule's
simulated step is shortest (`schedules.simulate` with each stage's summed forward and backward costs),
searched from that cut by moving one boundary at a time (each candidate's step computed for all of a
move's candidates at once, `_StepModel`; the search's work bounded, `MAX_SEARCH_WORK`: a few seconds
at most, the same cut on every rank). The two differ where a schedule does not wait
on the largest stage alone: with 2 chunks a rank, the last chunk's forward sits on every microbatch's
turn from forward to backward. At GPT-1.3B on 4 ranks, 8 microbatches, half blocks (the compute model's
costs), the interleaved schedule's simulated bubble is 1.08x its formula at the smallest-largest-stage
cut and 0.86x at this one; GPipe, 1F1B and ZB-H1 keep the same cut there (with whole blocks 1F1B moves
a block: 1.075x -> 1.062x).

Every rank then needs the same cut, though the times it measured differ from its neighbours' (noise,
a busier host): `agree` averages them over the job's ranks and broadcasts rank 0's result, so that
every rank partitions the same costs.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from typing import Any, Callable, ContextManager, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..batches import call_module, map_tensors, tensors_of
from ..mesh import global_rank
from ..models.gpt import GPT
from .gpt_stages import AttentionHalf, MLPHalf, gpt_layer_costs, lm_loss
from .meta_init import _children_first, _reset_method, has_meta
from .options import BALANCES
from .schedules import build_schedule, simulate, stage_of
from .stages import Layers, partition

__all__ = ["BALANCES", "MAX_SEARCH_WORK", "TIME_BUDGET_S", "default_sample", "measure_layer_times", "agree",
           "layer_costs", "schedule_cut", "split_step"]

#: Seconds `measure_layer_times` aims to spend on the whole chain (its warm-ups and repeats included),
#: shared evenly among the layers: a layer whose runs use up its share stops early, but every layer runs
#: at least once as warm-up and once timed. Copying each layer to the device comes on top.
TIME_BUDGET_S = 20.0
WARMUP = 2
REPEATS = 5


def default_sample(model: nn.Module) -> torch.Tensor | None:
    """The input of one microbatch for timing `model`'s layers when none is given: for our `GPT`, token
    ids of shape (1, ``cfg.block_size``) (drawn from a fixed generator, not the global RNG); None for
    any other model (the caller must pass ``pipeline_sample_input``)."""
    if isinstance(model, GPT):
        cfg = model.cfg
        return torch.randint(0, cfg.vocab_size, (1, cfg.block_size), generator=torch.Generator().manual_seed(0))
    return None


def check_sample(sample: Any, where: str = "pipeline_sample_input") -> None:
    """Raise TypeError unless `sample` is a tensor, or a tuple, list or dict of them (nested)."""
    if isinstance(sample, torch.Tensor):
        return
    if isinstance(sample, (tuple, list)) and sample:
        for i, item in enumerate(sample):
            check_sample(item, f"{where}[{i}]")
        return
    if isinstance(sample, dict) and sample:
        for key, item in sample.items():
            check_sample(item, f"{where}[{key!r}]")
        return
    raise TypeError(f"{where} must be a tensor, or a non-empty tuple, list or dict of tensors (one microbatch's "
                    f"input to the model's first layer), got {type(sample).__name__}")


def _received(t: torch.Tensor) -> torch.Tensor:
    """What the next stage receives: the values, detached, requiring grad if floating."""
    t = t.detach()
    return t.requires_grad_() if t.is_floating_point() else t


def _on_device(layer: nn.Module, device: torch.device) -> nn.Module:
    """A copy of `layer` on `device`, with storage and finite values: a real layer's values, a meta
    layer's from N(0, 0.02) then its modules' ``reset_parameters`` (children first)."""
    twin = copy.deepcopy(layer)  # meta tensors copy as shapes: nothing allocated yet
    if not has_meta(twin):
        return twin.to(device)
    twin.to_empty(device=device)
    with torch.no_grad():
        for t in (*twin.parameters(), *twin.buffers()):
            t.normal_(0.0, 0.02) if t.is_floating_point() else t.zero_()
        for module in _children_first(twin, set()):
            reset = _reset_method(module)
            if reset is not None:
                reset()
    return twin


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_layer_times(layers: Layers, sample: Any, device: torch.device | str, *,
                        autocast: Callable[[], ContextManager] | None = None, warmup: int = WARMUP,
                        repeats: int = REPEATS, budget_s: float = TIME_BUDGET_S,
                        loss: Callable[[Any], torch.Tensor] | None = None) -> list[float]:
    """Seconds of each layer's forward + backward on one microbatch, on `device` (see the module
    docstring for how).

    Args:
        layers: the chain (``(name, module)`` pairs); the modules are copied, never changed.
        sample: one microbatch's input to the first layer (a tensor, or a tuple, list or dict of them).
        device: where to time.
        autocast: a callable returning the context the forward runs under (the trainer's mixed
            precision), or None.
        loss: the last stage's loss as a function of the last layer's output, timed with the last
            layer (its backward starts from the loss then), or None (a gradient of ones).
        warmup, repeats: untimed and timed runs per layer (fewer where the budget runs out; at
            least one of each).
        budget_s: about how many seconds the whole chain may take (`TIME_BUDGET_S`).

    Returns:
        one median time per layer, in seconds.
    """
    device = torch.device(device)
    check_sample(sample)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    share = budget_s / max(1, len(layers))
    times: list[float] = []
    cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
    x = map_tensors(lambda t: t.detach().to(device), sample)
    # fork_rng: the layers' dropout draws leave the trainer's RNG as it was.
    with torch.random.fork_rng(devices=[index] if cuda else []), torch.enable_grad():
        for i, (name, layer) in enumerate(layers):
            last = loss if i == len(layers) - 1 else None
            twin = _on_device(layer, device)
            runs: list[float] = []
            spent, run, untimed = 0.0, 0, warmup
            out = None
            while len(runs) < repeats:
                _synchronize(device)
                start = time.perf_counter()
                try:
                    with autocast() if autocast is not None else contextlib.nullcontext():
                        out = call_module(twin, x) if i == 0 else twin(x)  # (the inputs as Stage passes them)
                        ends = [last(out)] if last is not None else [t for t in tensors_of(out) if t.requires_grad]
                        if ends:
                            torch.autograd.backward(ends, [torch.ones_like(t) for t in ends])
                except (MemoryError, torch.OutOfMemoryError):
                    raise  # as it is: not the sample's fault
                except Exception as err:  # a sample that does not fit the model, most often
                    message = (f"pipeline_balance='time': layer {name!r} failed on the sample (pipeline_sample_input, "
                               f"one microbatch's input to the first layer; this layer got {_describe(x)}): {err}")
                    try:
                        wrapped = type(err)(message)  # the same kind
                    except Exception:  # noqa: BLE001 - an exception type that takes other arguments
                        wrapped = RuntimeError(message)
                    raise wrapped from err
                _synchronize(device)
                took = time.perf_counter() - start
                spent, run = spent + took, run + 1
                if run > untimed:
                    runs.append(took)
                if spent >= share:  # this layer's share of the budget is spent
                    if runs:
                        break
                    untimed = run  # still warming up: one timed run, then stop
            times.append(statistics.median(runs))
            x = map_tensors(_received, out)
            del twin, out
    if cuda:
        torch.cuda.empty_cache()  # the copies' blocks, before the stages go to the device
    for (name, _), seconds in zip(layers, times):
        if not math.isfinite(seconds):
            raise RuntimeError(f"pipeline_balance='time': layer {name!r} measured {seconds} s")
    return times


def _describe(value: Any) -> str:
    """Shapes and dtypes of a sample, for messages."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    return type(value).__name__


def _gpt_loss(logits: torch.Tensor) -> torch.Tensor:
    """Our GPT's loss (`lm_loss`: the softmax over the vocabulary in fp32, often more time than the head's
    matmul) on the logits, against targets of zeros (the cost does not depend on them)."""
    return lm_loss(logits, torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device))


def agree(values: Sequence[float], device: torch.device, group=None) -> list[float]:
    """The mean of `values` over the ranks of `group` (default: the world), identical on every rank
    (rank 0's result broadcast after the all-reduce): every rank cuts the chain the same way."""
    if not dist.is_initialized():
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    t /= dist.get_world_size(group)
    src = global_rank(group, 0)
    dist.broadcast(t, src=src, group=group)
    return t.tolist()


def layer_costs(module: nn.Module, layers: Layers, balance: str, *, device: torch.device | str = "cpu",
                sample: Any = None, autocast: Callable[[], ContextManager] | None = None, group=None,
                collective_device: torch.device | None = None, budget_s: float = TIME_BUDGET_S,
                loss: bool = True) -> list[float]:
    """One cost per chain layer for `partition`, by `balance` (``"parameters"``, ``"compute"`` or
    ``"time"``; see the module docstring). For ``"time"``, collective over `group` (every rank measures
    on `device` and `agree` averages), with `sample` the input of one microbatch (None: `default_sample`;
    a ValueError naming ``pipeline_sample_input`` where there is none) and `collective_device` where the
    agreement's tensor lives (the backend's: CUDA for NCCL). `loss`: whether the GPT's last layer counts
    its loss (`lm_loss` as it is; False where it is compiled: next to nothing)."""
    if balance == "parameters":
        return [sum(p.numel() for p in layer.parameters()) for _, layer in layers]
    if balance == "compute":
        if not isinstance(module, GPT):
            raise ValueError(f"pipeline_balance='compute' knows the compute of our GPT only, not of a "
                             f"{type(module).__name__}: use 'parameters', 'time' or pipeline_split_points")
        forward, backward = _gpt_costs(module, layers, sample, loss)
        return [f + b for f, b in zip(forward, backward)]
    if balance != "time":
        raise ValueError(f"pipeline_balance must be one of {list(BALANCES)}, got {balance!r}")
    if sample is None:
        sample = default_sample(module)
    if sample is None:
        raise ValueError(f"pipeline_balance='time' times the layers on one microbatch, and a "
                         f"{type(module).__name__} has no default one: pass pipeline_sample_input (one "
                         "microbatch's input to the first layer: a tensor, or a tuple or dict of tensors)")
    try:
        mine = measure_layer_times(layers, sample, device, autocast=autocast, budget_s=budget_s,
                                   loss=_gpt_loss if isinstance(module, GPT) and loss else None)
        failure = None
    except Exception as err:  # out of memory on one rank, say: every rank must leave, not wait for it
        mine, failure = [0.0] * len(layers), err
    # The failure count travels with the times (one collective): every rank raises, or none does.
    agreed = agree([*mine, float(failure is not None)], torch.device(collective_device or "cpu"), group)
    if failure is not None:
        raise failure
    if agreed[-1] > 0:
        raise RuntimeError("pipeline_balance='time': timing the layers failed on another rank (its error is in "
                           "its log)")
    return agreed[:-1]


def _gpt_costs(module: GPT, layers: Layers, sample: Any = None, loss: bool = True) -> tuple[list[float], list[float]]:
    """The GPT's compute model (`gpt_layer_costs`) for its chain `layers`, at the sequence length and
    tokens a microbatch of `sample` (one microbatch's token ids, (rows, length); None: one sequence of
    ``cfg.block_size``)."""
    halves = any(isinstance(layer, (AttentionHalf, MLPHalf)) for _, layer in layers)
    seq = tokens = None
    if sample is not None:
        if not isinstance(sample, torch.Tensor) or sample.dim() != 2 or sample.is_floating_point():
            raise ValueError(f"pipeline_sample_input with pipeline_balance='compute' is one microbatch of our "
                             f"GPT's token ids, an integer tensor (rows, sequence length); got {_describe(sample)}")
        seq, tokens = int(sample.shape[1]), int(sample.numel())
        if tokens == 0:
            raise ValueError(f"pipeline_sample_input is empty ({_describe(sample)}): give one microbatch's token ids")
    return gpt_layer_costs(module.cfg, seq, halves=halves, loss=loss, microbatch_tokens=tokens)


def split_step(module: nn.Module, layers: Layers, balance: str, costs: Sequence[float],
               sample: Any = None, loss: bool = True) -> tuple[list[float], list[float]]:
    """(forward, backward) per layer for `schedule_cut`: the GPT's compute model for ``"compute"`` (at
    `sample`'s shape, see `_gpt_costs`); otherwise each layer's step cost (`costs`, e.g. measured seconds)
    a third forward, two thirds backward."""
    if balance == "compute" and isinstance(module, GPT):
        return _gpt_costs(module, layers, sample, loss)
    return [c / 3.0 for c in costs], [2.0 * c / 3.0 for c in costs]


#: How much work `schedule_cut`'s hill climb may do, in simulated actions: a move scoring C candidate
#: cuts of a schedule of A actions (P x V x M x 2, or x 3 for ZB-H1) costs A x (C + `_PASS_COST`), the
#: pass over the actions counted too. About 2-3 s on one CPU core; before, the search had no bound but
#: its 200 moves and took 17 s at 200 layers, P = 8, 2 chunks, 32 microbatches, and 6 minutes at 98
#: layers, P = 8, 4 chunks, 64 microbatches. A move that would pass the bound is not tried: the best cut
#: so far is returned. Counted, not timed, so that every rank stops at the same cut. GPT-1.3B's cuts at
#: P = 4 with 8 microbatches use under a hundredth of it.
MAX_SEARCH_WORK = 100_000_000
#: What one pass over a schedule's actions costs besides the candidates, per action (in candidates).
_PASS_COST = 100
#: Floats per block of candidates evaluated at once (`_StepModel.makespans`): about 32 MiB.
_BLOCK_FLOATS = 4_000_000


class _StepModel:
    """`schedules.simulate`'s makespan of one schedule, for many cuts at once (vectorised over the cuts).

    With free communication and each rank running its actions in order, an action starts when the rank's
    previous action and the action whose output it needs (the previous stage's forward, the next stage's
    input gradient) have ended: the makespan is a longest path through the actions, taken here in one
    pass over them in an order where each comes after its inputs (their order by end time in one
    simulation with positive costs). The same additions and maxima as `simulate`, so the same numbers."""

    def __init__(self, schedule: str, pipe_size: int, microbatches: int, chunks: int) -> None:
        P, V = pipe_size, chunks
        actions = build_schedule(schedule, P, microbatches, V)
        timeline = simulate(actions, P, V, microbatches=microbatches).timeline  # checks it, orders it
        entries = sorted((end, rank, i) for rank, line in enumerate(timeline) for i, (_, end, _) in enumerate(line))
        index = {(rank, i): k for k, (_, rank, i) in enumerate(entries)}
        produced = {}  # ("F" | "G", microbatch, stage) -> the action's index
        for (rank, i), k in index.items():
            a = actions[rank][i]
            if a.kind != "W":
                produced["F" if a.kind == "F" else "G", a.microbatch, stage_of(rank, a.chunk, P)] = k
        A, S = len(entries), P * V
        self.size = A
        self.kind = [0] * A  # 0: forward; 1: backward; 2: half of it (I or W)
        self.stage, self.previous, self.input = [0] * A, [A] * A, [A] * A  # index A: a row of zeros
        self.first: list[int] = []  # each rank's first action
        for (rank, i), k in index.items():
            a = actions[rank][i]
            s = stage_of(rank, a.chunk, P)
            self.kind[k], self.stage[k] = {"F": 0, "B": 1}.get(a.kind, 2), s
            if i:
                self.previous[k] = index[rank, i - 1]
            else:
                self.first.append(k)
            if a.kind == "F" and s > 0:
                self.input[k] = produced["F", a.microbatch, s - 1]
            elif a.kind in ("B", "I") and s < S - 1:
                self.input[k] = produced["G", a.microbatch, s + 1]

    def makespans(self, fsum, bsum, cuts) -> np.ndarray:
        """The simulated step of each cut (rows of `cuts`, bounds as `stages.partition`), with stage
        costs from the prefix sums `fsum` and `bsum` of the layers' forward and backward costs."""
        cuts = np.asarray(cuts, dtype=np.int64)
        fsum, bsum = np.asarray(fsum, dtype=np.float64), np.asarray(bsum, dtype=np.float64)
        out = np.empty(len(cuts))
        block = max(1, _BLOCK_FLOATS // (self.size + 1))
        kind, stage = np.asarray(self.kind), np.asarray(self.stage)
        first = set(self.first)
        for lo in range(0, len(cuts), block):
            c = cuts[lo:lo + block]
            fw = fsum[c[:, 1:]] - fsum[c[:, :-1]]
            bw = bsum[c[:, 1:]] - bsum[c[:, :-1]]
            cost = np.stack([fw, bw, bw / 2.0])[kind, :, stage]  # (actions, cuts)
            end = np.zeros((self.size + 1, len(c)))
            start = None
            for k in range(self.size):
                row = end[k]
                np.maximum(end[self.previous[k]], end[self.input[k]], out=row)
                if k in first:
                    start = row.copy() if start is None else np.minimum(start, row)
                row += cost[k]
            out[lo:lo + len(c)] = end[:self.size].max(axis=0) - start
        return out


def schedule_cut(forward: Sequence[float], backward: Sequence[float], schedule: str, pipe_size: int,
                 microbatches: int, chunks: int = 1, *, max_moves: int = 200,
                 max_work: int = MAX_SEARCH_WORK) -> list[int]:
    """Bounds (as `stages.partition`) of the cut of a chain into ``pipe_size x chunks`` stages whose step
    under `schedule` is shortest by `schedules.simulate` (each stage's forward, backward and, for ZB-H1,
    half of its backward as the weight gradient, summed over its layers; free communication).

    Searched, not exhaustive: from `partition` of the step costs (forward + backward), the cut moves to
    its neighbour with the shortest simulated step (a neighbour: a run of consecutive boundaries shifted
    by one layer, or one boundary by two), while that is shorter (by more than 1e-9 of it), for at most
    `max_moves` moves, and while its work stays within `max_work` (`MAX_SEARCH_WORK`, a few seconds: a
    move that would pass it is not tried, the best cut so far is returned).
    Deterministic: every rank given the same costs cuts alike. At GPT-1.3B on 4 ranks with 8 microbatches
    it finds the exhaustive search's cut for GPipe, 1F1B and ZB-H1 (tested)."""
    forward, backward = [float(f) for f in forward], [float(b) for b in backward]
    if len(forward) != len(backward):
        raise ValueError(f"forward has {len(forward)} costs and backward {len(backward)}: one each per layer")
    S = pipe_size * chunks
    bounds = partition([f + b for f, b in zip(forward, backward)], S)
    if S == 1:
        return bounds
    model = _StepModel(schedule, pipe_size, microbatches, chunks)
    fsum, bsum = [0.0], [0.0]
    for f, b in zip(forward, backward):
        fsum.append(fsum[-1] + f)
        bsum.append(bsum[-1] + b)

    best = float(model.makespans(fsum, bsum, [bounds])[0])
    budget = max_work - model.size * (1 + _PASS_COST)
    for _ in range(max_moves):
        candidates = []
        for i in range(1, S):  # boundaries i..j move together (a run of stages shifts), or one alone by 2
            for j in range(i, S):
                for delta in (-1, 1) if j > i else (-2, -1, 1, 2):
                    cut = list(bounds)
                    for k in range(i, j + 1):
                        cut[k] += delta
                    if all(a < b for a, b in zip(cut, cut[1:])):
                        candidates.append(cut)
        work = model.size * (len(candidates) + _PASS_COST)
        if not candidates or work > budget:
            break
        budget -= work
        steps = model.makespans(fsum, bsum, candidates)
        pick = int(np.argmin(steps))  # the first of the shortest, as min() over the list
        if steps[pick] >= best * (1.0 - 1e-9):
            break
        best, bounds = float(steps[pick]), candidates[pick]
    return bounds
