"""The pipeline engine against one process on the whole batch: parameters equal after every step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distributed_training.pipeline.engine import PipelineEngine
from distributed_training.testing import run_distributed

from _models import reference_step

STEPS = 3
WIDTH = 8


def _model(layers: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    mods = []
    for i in range(layers):
        mods.append(nn.Linear(WIDTH, WIDTH))
        if i < layers - 1:
            mods.append(nn.Tanh())
    return nn.Sequential(*mods)


def _batch(step: int, rows: int = 8):
    g = torch.Generator().manual_seed(100 + step)
    length = 3 + step  # the sequence length changes every step: shapes are not fixed
    x = torch.randn(rows, length, WIDTH, generator=g)
    y = torch.randn(rows, length, WIDTH, generator=g)
    return x, y


def _cut(model: nn.Sequential, stages: int) -> list[nn.Sequential]:
    layers = list(model)
    bounds = [round(i * len(layers) / stages) for i in range(stages + 1)]
    return [nn.Sequential(*layers[bounds[i]:bounds[i + 1]]) for i in range(stages)]


def engine_worker(rank, world, schedule, chunks, microbatches, optimizer):
    base = _model(layers=2 * world * chunks)
    reference = copy.deepcopy(base)
    stages = _cut(base, world * chunks)
    mine = [stages[c * world + rank] for c in range(chunks)]
    params = [p for m in mine for p in m.parameters()]
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01)}[optimizer]
    opt, ref_opt = make(params), make(reference.parameters())
    engine = PipelineEngine(mine, ranks=list(range(world)), rank=rank, group=None, schedule=schedule,
                            microbatches=microbatches, loss_fn=F.mse_loss)
    worst, losses = 0.0, []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = engine.step(x, y)
        opt.step()
        opt.zero_grad()
        ref_loss = reference_step(reference, ref_opt, x, y, loss_fn=F.mse_loss)
        losses.append((loss.item(), ref_loss.item()))
        ref_stages = _cut(reference, world * chunks)
        for c in range(chunks):
            for p, q in zip(mine[c].parameters(), ref_stages[c * world + rank].parameters()):
                worst = max(worst, (p - q).abs().max().item())
    return worst, losses


@pytest.mark.parametrize("schedule,world,chunks,microbatches", [
    ("gpipe", 2, 1, 4), ("1f1b", 2, 1, 4), ("1f1b", 2, 1, 3), ("gpipe", 3, 1, 5),
    pytest.param("1f1b", 4, 1, 8, marks=pytest.mark.slow),
    ("interleaved_1f1b", 2, 2, 4),
])
def test_engine_matches_one_process(schedule, world, chunks, microbatches):
    for rank, (worst, losses) in enumerate(run_distributed(engine_worker, world, args=(schedule, chunks, microbatches,
                                                                                          "sgd"), timeout=120)):
        assert worst <= 1e-5, f"rank {rank}: parameters differ from one process by {worst:.3g}"
        for got, want in losses:  # every rank reports the whole batch's loss
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (rank, got, want)


def test_engine_with_adamw():
    for worst, _ in run_distributed(engine_worker, 2, args=("1f1b", 1, 4, "adamw"), timeout=120):
        assert worst <= 1e-5


def gpt_worker(rank, world, schedule, microbatches, halves=False):
    from distributed_training.models import GPTConfig
    from distributed_training.pipeline import GPTStages, lm_loss, sync_tied_grads

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=16, dropout=0.0)
    maker = GPTStages(cfg, seed=3, halves=halves)
    stage = maker.build(rank, world)
    reference = maker.model("cpu")
    tied = maker.tied_groups(world)
    # The ranks holding copies of the tied embedding / head (the first and last stage): a group of their own,
    # created by every rank (a collective).
    tie_group = dist.new_group(list(tied[0].stages)) if tied else None
    opt = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    engine = PipelineEngine([stage], ranks=list(range(world)), rank=rank, schedule=schedule,
                            microbatches=microbatches, loss_fn=lm_loss,
                            after_backward=lambda: sync_tied_grads(stage, tied, tie_group))
    worst, losses = 0.0, []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(7 + step)
        idx = torch.randint(0, cfg.vocab_size, (8, 5 + 2 * step), generator=g)  # length changes each step
        targets = torch.randint(0, cfg.vocab_size, idx.shape, generator=g)
        loss = engine.step(idx, targets)
        opt.step()
        opt.zero_grad()
        ref_loss = reference_step(reference, ref_opt, idx, targets)
        losses.append((loss.item(), ref_loss.item()))
        whole = dict(reference.named_parameters(remove_duplicate=False))  # the tied head too
        from distributed_training.pipeline import gpt_key

        for key, p in stage.named_parameters():
            worst = max(worst, (p - whole[gpt_key(key)]).abs().max().item())
    return worst, losses


@pytest.mark.parametrize("schedule,world,halves", [("1f1b", 2, False), ("gpipe", 2, False), ("zbh1", 3, True),
                                                   pytest.param("1f1b", 4, False, marks=pytest.mark.slow)])
def test_engine_trains_a_gpt_with_tied_embeddings_like_one_process(schedule, world, halves):
    """Half blocks (`GPTStages(halves=True)`): stages cut inside a block (3 stages of 10 half-layers)."""
    for rank, (worst, losses) in enumerate(run_distributed(gpt_worker, world, args=(schedule, 4, halves),
                                                           timeout=120)):
        assert worst <= 1e-5, f"rank {rank}: parameters differ from one process by {worst:.3g}"
        for got, want in losses:
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (rank, got, want)


class _Fails(nn.Module):
    """A layer that raises on its third call (a stage that breaks in the middle of a step)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            raise ValueError("boom in the middle stage")
        return x


def failing_worker(rank, world, schedule):
    import time

    base = _model(layers=2 * world)
    stages = _cut(base, world)
    if rank == 1:
        stages[1] = nn.Sequential(*stages[1], _Fails())
    engine = PipelineEngine([stages[rank]], ranks=list(range(world)), rank=rank, schedule=schedule, microbatches=4,
                            loss_fn=F.mse_loss)
    x, y = _batch(0)
    started = time.monotonic()
    try:
        engine.step(x, y)
    except RuntimeError as err:
        return type(err).__name__, str(err), time.monotonic() - started
    return None


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_stage_that_raises_makes_every_rank_raise(schedule):
    results = run_distributed(failing_worker, 3, args=(schedule,), timeout=60)
    assert all(r is not None for r in results), results
    assert "boom in the middle stage" in results[1][1], results[1]
    for rank in (0, 2):
        kind, message, elapsed = results[rank]
        assert kind == "PipelineAborted" and "global rank 1 failed" in message, results[rank]
        assert elapsed < 20, elapsed


def known_shapes_worker(rank, world, schedule):
    base = _model(layers=2 * world)
    reference = copy.deepcopy(base)
    mine = [_cut(base, world)[rank]]
    opt = torch.optim.SGD(mine[0].parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    engine = PipelineEngine(mine, ranks=list(range(world)), rank=rank, group=None, schedule=schedule,
                            microbatches=4, loss_fn=F.mse_loss)
    engine.link.known_shapes = True  # off by default on gloo (a payload receive blocks the host there anyway)
    worst, known = 0.0, []
    for step in range(5):
        x, y = _batch(step % 2)  # two sequence lengths in turn: from the third step on, every shape is known
        engine.step(x, y)
        opt.step()
        opt.zero_grad()
        reference_step(reference, ref_opt, x, y, loss_fn=F.mse_loss)
        for p, q in zip(mine[0].parameters(), _cut(reference, world)[rank].parameters()):
            worst = max(worst, (p - q).abs().max().item())
        known.append(sum(len(shapes) for shapes in engine.link._known.values()))
    return worst, known, engine.link.received_by_known_shape


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_known_shapes_receive_without_headers_and_match_one_process(schedule):
    """Steps whose input shapes were seen before receive each message by the shape it had then (its
    header checked at the end of the step), and train exactly as one process does."""
    for rank, (worst, known, by_shape) in enumerate(run_distributed(known_shapes_worker, 2, args=(schedule,),
                                                                     timeout=120)):
        assert by_shape == 4 * 3, (rank, by_shape)  # steps 3, 4 and 5
        assert worst <= 1e-5, f"rank {rank}: parameters differ from one process by {worst:.3g}"
        # 4 messages a step from the neighbour, per sequence length; nothing new learned after two steps
        assert known == [4, 8, 8, 8, 8], (rank, known)


# Uneven stages: different widths at each boundary (so each channel carries its own shape) and different
# numbers of layers per stage, cut unevenly.
_WIDTHS = [8, 24, 4, 12, 16, 6, 10, 20, 8]


def _uneven_stages(num_stages: int) -> tuple[nn.Sequential, list[nn.Sequential]]:
    torch.manual_seed(1)
    layers = []
    for i, (a, b) in enumerate(zip(_WIDTHS, _WIDTHS[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(_WIDTHS) - 2:
            layers.append(nn.GELU())
    model = nn.Sequential(*layers)
    n = len(layers)
    # Stage sizes 1, 2, 3, ... layers (the last stage takes the rest): no two alike.
    bounds = [0]
    for s in range(num_stages - 1):
        bounds.append(min(bounds[-1] + s + 1, n - (num_stages - 1 - s)))
    bounds.append(n)
    return model, [nn.Sequential(*layers[bounds[i]:bounds[i + 1]]) for i in range(num_stages)]


def uneven_worker(rank, world, schedule, chunks, microbatches, optimizer):
    num_stages = world * chunks
    reference, _ = _uneven_stages(num_stages)
    _, stages = _uneven_stages(num_stages)  # the same weights (same seed), separate modules
    mine = [stages[c * world + rank] for c in range(chunks)]
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01)}[optimizer]
    opt, ref_opt = make([p for m in mine for p in m.parameters()]), make(reference.parameters())
    engine = PipelineEngine(mine, ranks=list(range(world)), rank=rank, schedule=schedule,
                            microbatches=microbatches, loss_fn=F.mse_loss)
    mine_index = []  # each of my parameters' index in the reference model (same layer order)
    offset = 0
    for s, stage in enumerate(stages):
        for p in stage.parameters():
            if s in [c * world + rank for c in range(chunks)]:
                mine_index.append((p, offset))
            offset += 1
    ref_params = list(reference.parameters())
    worst = 0.0
    for step in range(STEPS):
        g = torch.Generator().manual_seed(50 + step)
        x = torch.randn(microbatches * 2, 3 + step, _WIDTHS[0], generator=g)
        y = torch.randn(microbatches * 2, 3 + step, _WIDTHS[-1], generator=g)
        engine.step(x, y)
        opt.step()
        opt.zero_grad()
        reference_step(reference, ref_opt, x, y, loss_fn=F.mse_loss)
        for p, i in mine_index:
            worst = max(worst, (p - ref_params[i]).abs().max().item())
    assert len(ref_params) == offset
    return worst


@pytest.mark.parametrize("schedule,world,chunks,microbatches,optimizer", [
    ("gpipe", 2, 1, 4, "adamw"), ("1f1b", 2, 1, 4, "sgd"), ("interleaved_1f1b", 2, 2, 4, "adamw"),
    ("zbh1", 2, 1, 4, "sgd"),
    ("gpipe", 4, 1, 4, "sgd"), ("1f1b", 4, 1, 6, "adamw"), ("interleaved_1f1b", 4, 2, 8, "sgd"),
    ("zbh1", 4, 1, 4, "adamw"),
])
def test_every_schedule_on_uneven_stages(schedule, world, chunks, microbatches, optimizer):
    """Stages of 1, 2, 3, ... layers with a different width at every boundary, each schedule at P = 2 and
    4: parameters equal to one process on the whole batch after every step."""
    for rank, worst in enumerate(run_distributed(uneven_worker, world, args=(schedule, chunks, microbatches,
                                                                            optimizer), timeout=180)):
        assert worst <= 1e-5, f"rank {rank}: parameters differ from one process by {worst:.3g}"
