"""ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP) inside each stage's data-parallel group, P=2 x DP=2 on gloo.

Each step, the pipelined trainer (its stages' gradients reduce-scattered once after the schedule,
the tied GPT embedding's copies summed before that, clipping by the norm over stages and shards)
must give the parameters one process gets on the whole batch, 1e-5 after every step, with SGD with
momentum (which, unlike Adam, does not hide a wrongly scaled gradient) and AdamW. A checkpoint saved
under ZeRO-3 at P=2 x DP=2 loads without a pipeline and back, exactly.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed_training import DistributedTrainer, FSDPStrategy
from distributed_training.testing import run_distributed

from _models import tiny_gpt
from _pipeline import step_against_reference, train_against_reference

TOL = 1e-5
STEPS = 3


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        return tiny_gpt()
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def _batch(kind: str, step: int, rows: int):
    g = torch.Generator().manual_seed(100 + step)
    if kind == "mlp":
        return torch.randn(rows, 16, generator=g), torch.randn(rows, 4, generator=g)
    tokens = torch.randint(0, 64, (rows, 9 + step), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _strategy(name: str):
    if name == "zero2-object":
        return FSDPStrategy(reshard_after_forward=False)
    if name == "zero3-hybrid":  # one-rank "nodes": nothing sharded, the shards averaged over the replicas
        return FSDPStrategy(sharding_strategy="hybrid", ranks_per_node=1)
    return name


def parity_worker(rank, world, kind, strategy, schedule, microbatches, clip, optimizer, context=None):
    factory = _sgd if optimizer == "sgd" else _adamw
    base = _model(kind)
    reference = copy.deepcopy(base)
    ref_opt = factory(reference.parameters())
    trainer = DistributedTrainer(copy.deepcopy(base), factory, strategy=_strategy(strategy), gradient_clip_val=clip,
                                 pipeline_parallel_size=2, pipeline_schedule=schedule, microbatches=microbatches,
                                 progress=False, **({} if context is None else {"context": context}))
    worst, losses, norms = train_against_reference(trainer, reference, ref_opt, _batch, kind, clip, rank,
                                                   2 * microbatches, STEPS)
    name = trainer.strategy.name
    trainer.close()
    return worst, losses, norms, name


@pytest.mark.parametrize("kind, strategy, schedule, microbatches, clip, optimizer", [
    ("gpt", "zero3", "1f1b", 2, 0.5, "sgd"),
    ("gpt", "zero3", "zbh1", 2, None, "sgd"),
    ("mlp", "zero3", "gpipe", 4, 0.05, "adamw"),
    ("gpt", "zero1", "zbh1", 2, 0.5, "sgd"),
    ("mlp", "zero1", "1f1b", 2, None, "adamw"),
    ("gpt", "zero2-object", "gpipe", 4, None, "sgd"),
    ("mlp", "zero3-hybrid", "zbh1", 2, 0.05, "sgd"),
])
def test_zero_inside_stages_matches_one_process(kind, strategy, schedule, microbatches, clip, optimizer):
    results = run_distributed(parity_worker, 4, args=(kind, strategy, schedule, microbatches, clip, optimizer),
                              timeout=180)
    worst = results[0][0]
    assert len(worst) == STEPS and max(worst) <= TOL, f"parameters differ from one process by {worst}"
    for rank, (_, losses, norms, name) in enumerate(results):
        assert name == {"zero2-object": "fsdp", "zero3-hybrid": "fsdp"}.get(strategy, strategy)
        for got, want in losses:  # every rank of a pipeline reports its replica's whole-batch loss
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (rank, losses)
        for got, want in norms:  # the norm over both stages and every shard, the tie counted once
            assert abs(got - want) <= 1e-5 * max(1.0, want), (rank, norms)
        if clip is not None:
            assert any(want > clip for _, want in norms), "the clip threshold must actually clip"


# Rows of each replica's batch, step by step: one replica's batch shorter than the microbatches (4) while
# the other's is not, then both full, then the other way round.
UNEVEN_ROWS = [(2, 14), (8, 8), (13, 3)]


def uneven_replicas_worker(rank, world, schedule, host_group):
    """ZeRO-3 at P=2 x DP=2 with replicas whose batches differ in rows (as `fit` gives them at an epoch's
    end): the replicas must run as many microbatches as each other, since ZeRO-3 gathers each stage's
    parameters over the data group in every microbatch; one process on the whole batch is the reference.
    `host_group`: they agree over new gloo groups, as `Mesh.host_group` builds them on NCCL."""
    base = _model("mlp")
    reference = copy.deepcopy(base)
    ref_opt = _sgd(reference.parameters())
    trainer = DistributedTrainer(copy.deepcopy(base), _sgd, strategy="zero3", pipeline_parallel_size=2,
                                 pipeline_schedule=schedule, microbatches=4, progress=False)
    if host_group:
        trainer.strategy.engine.rows_group = trainer.context.mesh._new_host_groups("data")
    worst, losses = [], []
    for step, counts in enumerate(UNEVEN_ROWS):
        x, y = _batch("mlp", step, sum(counts))
        first = sum(counts[:trainer.dp_rank])
        diff, loss, _ = step_against_reference(trainer, reference, ref_opt, x, y,
                                               slice(first, first + counts[trainer.dp_rank]), "mlp", None, rank)
        worst += [diff] if diff is not None else []
        losses.append(loss)
    trainer.close()
    return worst, losses


@pytest.mark.parametrize("schedule, host_group", [("1f1b", False), ("interleaved_1f1b", True)])
def test_zero3_replicas_with_uneven_batches_match_one_process(schedule, host_group):
    """Was a hang (or gloo's "collective mismatch" abort): the short replica ran fewer microbatches,
    so fewer gathers, than the other."""
    results = run_distributed(uneven_replicas_worker, 4, args=(schedule, host_group), timeout=120)
    worst = results[0][0]
    assert len(worst) == len(UNEVEN_ROWS) and max(worst) <= TOL, f"parameters differ from one process by {worst}"
    for rank, (_, losses) in enumerate(results):
        for got, want in losses:
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (rank, losses)


# ------------------------------------------------------------------ checkpoints
ROWS = 8


def _ckpt_batches():
    g = torch.Generator().manual_seed(3)
    return [(lambda t: (t[:, :-1], t[:, 1:]))(torch.randint(0, 64, (ROWS, 13), generator=g)) for _ in range(2)]


def checkpoint_worker(rank, world, pipe, strategy, directory, load, seed):
    """The tiny GPT at P=`pipe` under `strategy` (initialised from `seed`): loads `directory`, or takes
    two steps and saves there. Returns the full state, and this rank's AdamW moments as pieces of the
    model's tensors (by the strategy's own layout)."""
    torch.manual_seed(seed)
    model = tiny_gpt()
    kwargs = dict(pipeline_parallel_size=pipe, microbatches=2) if pipe > 1 else {}
    trainer = DistributedTrainer(model, _adamw, strategy=strategy, progress=False, **kwargs)
    n = ROWS // trainer.dp_world_size
    rows = slice(trainer.dp_rank * n, (trainer.dp_rank + 1) * n)
    if load:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # RNG states are not restored at another world size
            trainer.load_checkpoint(directory)
    else:
        for x, y in _ckpt_batches():
            trainer.train_step((x[rows], y[rows]))
        trainer.save_checkpoint(directory)
    params = trainer.full_state_dict()
    optim = {}
    layout = trainer.strategy.state_layout(trainer.model, trainer.optimizer)
    for holding in layout.optimizer:  # AdamW's state of each element, by the model's names
        state = trainer.optimizer.state[holding.tensor]
        for piece in holding.pieces:
            for k, v in state.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    part = v.detach().reshape(-1)[piece.local:piece.local + piece.length].clone()
                    optim.setdefault(piece.key, {}).setdefault(k, []).append((piece.start, part))
    trainer.close()
    return params, optim


def _tiling(spans) -> list[tuple[int, int]]:
    """`spans` (rank, start, length) sorted, if they tile their range without overlap."""
    ordered = sorted((start, length) for _, start, length in spans)
    assert all(a + n == b for (a, n), (b, _) in zip(ordered, ordered[1:])), ordered
    return ordered


def _full_optimizer(results, shapes) -> dict:
    """AdamW's moments as whole tensors, from every rank's pieces (overlapping pieces must agree)."""
    out = {}
    for _, optim in results:
        for key, states in optim.items():
            for k, pieces in states.items():
                full = out.setdefault(key, {}).setdefault(k, torch.full((shapes[key].numel(),), float("nan")))
                for start, data in pieces:
                    held = full[start:start + data.numel()]
                    seen = ~held.isnan()
                    assert torch.equal(held[seen], data[seen]), (key, k)
                    held.copy_(data)
    return out


def test_zero3_checkpoint_crosses_pipeline_sizes_exactly(tmp_path):
    """Saved under ZeRO-3 at P=2 x DP=2 (shards of stages, the tied embedding written once), loaded
    by one process without a pipeline ("ddp"), saved there and loaded back at P=2 x DP=2: parameters
    and AdamW's moments equal the saving run's bit for bit, each time."""
    first, back = str(tmp_path / "p2"), str(tmp_path / "p1")
    saved = run_distributed(checkpoint_worker, 4, args=(2, "zero3", first, False, 0), timeout=180)
    index = torch.load(os.path.join(first, "meta.pt"), weights_only=False)["index"]
    shapes = {k: v.shape for k, v in saved[0][0].items()}
    for what in ("params", "optim"):  # each element written once: the tie's second copy is not
        for key, spans in index[what].items():
            assert sorted((start, length) for _, start, length in spans) == _tiling(spans), (what, key, spans)
            assert sum(length for _, _, length in spans) == shapes[key].numel(), (what, key, spans)
    assert {rank for rank, _, _ in index["params"]["wte.weight"]} == {0, 1}, "pipeline rank 0's two shards"
    want_params, want_optim = saved[0][0], _full_optimizer(saved, shapes)
    assert want_optim and all(not v.isnan().any() for s in want_optim.values() for v in s.values())

    loaded = run_distributed(checkpoint_worker, 1, args=(1, "ddp", first, True, 9), timeout=120)
    _assert_loaded_exactly(loaded, shapes, want_params, want_optim)

    # ... and from one process back into ZeRO-3 stages (the tie's two copies both filled).
    run_distributed(_save_loaded, 1, args=(first, back), timeout=120)
    again = run_distributed(checkpoint_worker, 4, args=(2, "zero3", back, True, 9), timeout=180)
    _assert_loaded_exactly(again, shapes, want_params, want_optim)


def _assert_loaded_exactly(results, shapes, want_params, want_optim):
    """The parameters (rank 0's full state) and the optimizer state gathered from every rank of a
    loading run equal the saving run's, bit for bit."""
    for key, value in want_params.items():
        assert torch.equal(results[0][0][key], value), key
    got_optim = _full_optimizer(results, shapes)
    for key, states in want_optim.items():
        for k, value in states.items():
            assert torch.equal(got_optim[key][k], value), (key, k)


def _save_loaded(rank, world, source, target):
    torch.manual_seed(9)
    trainer = DistributedTrainer(tiny_gpt(), _adamw, strategy="ddp", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.load_checkpoint(source)
    trainer.save_checkpoint(target)
    trainer.close()


# ------------------------------------------------------------------ mixed precision, evaluate
def mixed_precision_worker(rank, world, strategy, mode):
    model = _model("gpt")
    x, y = _batch("gpt", 0, 4)
    with torch.no_grad():
        fp32_loss = model(x, y).item()
    trainer = DistributedTrainer(model, _sgd, strategy=strategy, mixed_precision=mode, gradient_clip_val=1.0,
                                 pipeline_parallel_size=2, microbatches=2, progress=False)
    losses = [float(trainer.train_step((x, y))["loss"]) for _ in range(3)]
    trainer.close()
    return fp32_loss, losses


@pytest.mark.parametrize("strategy, mode", [("zero3", "fp16"), ("zero1", "bf16")])
def test_zero_inside_stages_mixed_precision_learns(strategy, mode):
    """fp16 with the loss scaler (its overflow decision agreed by every stage and shard) and bf16: the
    reported loss is unscaled (near fp32's) and falls."""
    for fp32_loss, losses in run_distributed(mixed_precision_worker, 4, args=(strategy, mode), timeout=180):
        assert abs(losses[0] - fp32_loss) < 0.05 * fp32_loss, (losses, fp32_loss)
        assert losses[-1] < losses[0], losses


def _eval_data(kind):
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(9)
    if kind == "gpt":
        tokens = torch.randint(0, 64, (18, 13), generator=g)
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return TensorDataset(torch.randn(18, 16, generator=g), torch.randn(18, 4, generator=g))


def evaluate_worker(rank, world, kind, strategy, pipe, schedule):
    kwargs = dict(pipeline_parallel_size=pipe, pipeline_schedule=schedule, microbatches=2 * pipe) if pipe > 1 else {}
    trainer = DistributedTrainer(_model(kind), _sgd, strategy=strategy, progress=False, **kwargs)
    criterion = F.mse_loss if kind == "mlp" else None
    metrics = {"mae": lambda out, y: (out - y).abs().mean()} if kind == "mlp" else None
    results = []
    for step in range(2):  # evaluate, then train on: the stages' gathers and messages still pair up
        x, y = _batch(kind, step, 8)
        n = 8 // trainer.dp_world_size
        trainer.train_step((x[trainer.dp_rank * n:(trainer.dp_rank + 1) * n], y[trainer.dp_rank * n:(trainer.dp_rank + 1) * n]),
                           criterion)
        results.append(trainer.evaluate(_eval_data(kind), criterion, batch_size=4, metrics=metrics))
    trainer.close()
    return results


@pytest.mark.parametrize("kind, strategy, schedule", [
    ("mlp", "zero3", "gpipe"),  # 9 samples per replica: batches of 4, 4 and 1
    ("gpt", "zero2", "interleaved_1f1b"),  # two chunks per rank, each its own FSDP units
])
def test_evaluate_with_zero_inside_stages_matches_one_process(kind, strategy, schedule):
    want = run_distributed(evaluate_worker, 1, args=(kind, "ddp", 1, "1f1b"), timeout=120)[0]
    for rank, got in enumerate(run_distributed(evaluate_worker, 4, args=(kind, strategy, 2, schedule), timeout=180)):
        for got_one, want_one in zip(got, want):
            assert set(got_one) == set(want_one)
            for name, value in want_one.items():
                assert abs(got_one[name] - value) <= 1e-5 * max(1.0, abs(value)), (rank, name, got_one, want_one)
    assert want[0] != want[1]


def gathers_worker(rank, world, strategy):
    import distributed_training.strategies.fsdp as fsdp

    launched = [0]
    gather = fsdp.all_gather_flat

    def counting(*args, **kwargs):
        launched[0] += 1
        return gather(*args, **kwargs)

    fsdp.all_gather_flat = counting
    trainer = DistributedTrainer(_model("gpt"), _sgd, strategy=strategy, pipeline_parallel_size=2, microbatches=4,
                                 progress=False)
    units = sum(1 for unit in trainer.model._units if unit.padded)
    counts = []
    for step in range(2):
        launched[0] = 0
        trainer.train_step(_batch("gpt", step, 8))
        counts.append(launched[0])
    trainer.close()
    return units, counts


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_parameter_gathers_per_step(strategy):
    """ZeRO-3 gathers each unit before every microbatch's forward and again before its backward; ZeRO-2
    keeps what it gathered until the step's reduction: one gather per unit and step."""
    for units, counts in run_distributed(gathers_worker, 4, args=(strategy,), timeout=180):
        assert units == 2  # each rank: two layers of the tiny GPT, each a unit
        assert counts == [units] * 2 if strategy == "zero2" else counts == [2 * 4 * units] * 2, counts


def frozen_stage_worker(rank, world, strategy):
    base = _model("mlp")
    for p in list(base.parameters())[:4]:  # the first two Linear layers: all of stage 0 (by parameter count)
        p.requires_grad_(False)
    reference = copy.deepcopy(base)
    ref_opt = _adamw([p for p in reference.parameters() if p.requires_grad])
    trainer = DistributedTrainer(copy.deepcopy(base), _adamw, strategy=strategy, pipeline_parallel_size=2,
                                 microbatches=2, progress=False)
    held = sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"] if p.requires_grad)
    per_replica = 4
    worst = []
    for step in range(STEPS):
        x, y = _batch("mlp", step, per_replica * trainer.dp_world_size)
        sl = slice(trainer.dp_rank * per_replica, (trainer.dp_rank + 1) * per_replica)
        diff, _, _ = step_against_reference(trainer, reference, ref_opt, x, y, sl, "mlp", None, rank)
        if diff is not None:
            worst.append(diff)
    trainer.close()
    return worst, held


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_a_frozen_stage_trains_under_zero_inside_stages(strategy):
    """Every parameter of stage 0 frozen (P=2 x DP=2): that stage's ranks have nothing to shard or step
    and the other stage trains as one process does."""
    results = run_distributed(frozen_stage_worker, 4, args=(strategy,), timeout=180)
    assert max(results[0][0]) <= 1e-5, results[0][0]
    assert [r[1] > 0 for r in results] == [False, False, True, True], [r[1] for r in results]  # stage 0: ranks 0, 1
