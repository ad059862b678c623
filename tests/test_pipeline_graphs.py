"""The pipeline engine's CUDA graphs (`pipeline/graphs.py`): what can be checked without a GPU (slots per
schedule, refusals), and on 2 GPUs with NCCL: the graphed engine equal to the eager one after every step,
with the shape changing between steps (an eager fallback) and back."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from distributed_training.pipeline import PipelineEngine, build_schedule
from distributed_training.pipeline.graphs import check_no_hooks, slots_per_chunk
from distributed_training.testing import run_distributed

from _models import tiny_gpt


@pytest.mark.parametrize("name,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zbh1", 1)])
def test_slots_are_the_microbatches_in_flight(name, chunks):
    P, M = 4, 8
    for rank, actions in enumerate(build_schedule(name, P, M, chunks=chunks)):
        got = slots_per_chunk(actions, chunks)
        if name == "gpipe":
            assert got == [M]  # every forward before the first backward
        elif name == "1f1b":
            assert got == [P - rank]  # the warm-up's forwards plus the steady state's one
        elif name == "zbh1":  # from F to W: the most forwards whose W has not run yet, counted here
            open_, most = set(), 0
            for a in actions:
                if a.kind == "F":
                    open_.add(a.microbatch)
                elif a.kind == "W":
                    open_.discard(a.microbatch)
                most = max(most, len(open_))
            assert got == [most] and most >= P - rank, (rank, got)
        else:
            assert all(1 <= n <= M for n in got) and got[0] >= got[1], got


def test_refused_on_cpu_and_with_module_hooks():
    stage = nn.Sequential(nn.Linear(3, 3))
    for schedule in ("1f1b", "zbh1"):
        with pytest.raises(ValueError, match="needs CUDA"):
            PipelineEngine([stage], ranks=[0], rank=0, schedule=schedule, microbatches=2, loss_fn=None, cuda_graphs=True)
    check_no_hooks([stage])
    stage[0].register_forward_pre_hook(lambda m, a: None)
    with pytest.raises(ValueError, match=r"chunk 0 has module hooks \(on \['0'\]\)"):
        check_no_hooks([stage])


def graphs_worker(rank: int, world: int, schedule: str, autocast: bool) -> tuple[float, int, int, bool]:
    import torch.distributed as dist

    from distributed_training import init_distributed
    from distributed_training.models import GPTConfig
    from distributed_training.pipeline import GPTStages, lm_loss, sync_tied_grads

    ctx = init_distributed()
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
    maker = GPTStages(cfg, seed=1)
    chunks = 2 if schedule == "interleaved_1f1b" else 1
    tied = maker.tied_groups(world * chunks)
    ranks = list(range(world))
    engines, opts, stages = [], [], []
    for graphs in (False, True):
        mine = [maker.build(c * world + rank, world * chunks, ctx.device) for c in range(chunks)]
        up, down, headers = dist.new_group(ranks), dist.new_group(ranks), dist.new_group(ranks, backend="gloo")
        engines.append(PipelineEngine(mine, ranks=ranks, rank=rank, up_group=up, down_group=down,
                                      header_group=headers, schedule=schedule, microbatches=4, loss_fn=lm_loss,
                                      device=ctx.device, cuda_graphs=graphs,
                                      after_backward=lambda m=mine: [sync_tied_grads(s, tied, None) for s in m]))
        opts.append(torch.optim.AdamW([p for m in mine for p in m.parameters()], lr=1e-3))
        stages.append(nn.ModuleList(mine))
    worst = 0.0
    stolen = False
    for step, length in enumerate([32, 32, 32, 48, 32, 32]):  # captured after step 0; 48: eager; back to 32
        g = torch.Generator(device=ctx.device).manual_seed(step)
        idx = torch.randint(0, 512, (8, length), device=ctx.device, generator=g)
        targets = torch.roll(idx, -1, 1)
        losses = []
        for engine, opt in zip(engines, opts):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                losses.append(engine.step(idx, targets))
            if engine.graphs is not None:  # the accumulators were added into .grad, never handed over
                statics = {t.data_ptr() for accumulators in engine.graphs.accumulators for t in accumulators.values()}
                stolen |= any(p.grad.data_ptr() in statics for c in engine.chunks for p in c.parameters())
                # and left at zero for the next step
                stolen |= any(bool(t.any()) for accumulators in engine.graphs.accumulators
                              for t in accumulators.values())
            opt.step()
            opt.zero_grad(set_to_none=True)
        worst = max(worst, abs(losses[0].item() - losses[1].item()))
        for a, b in zip(stages[0].parameters(), stages[1].parameters()):
            worst = max(worst, (a - b).abs().max().item())
    graphs = engines[1].graphs
    return worst, graphs.replayed, graphs.eager, stolen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("schedule,autocast", [("1f1b", False), ("1f1b", True), ("gpipe", True),
                                             ("interleaved_1f1b", True), ("zbh1", False), ("zbh1", True)])
def test_graphed_engine_equals_the_eager_one_on_nccl(schedule, autocast):
    chunks = 2 if schedule == "interleaved_1f1b" else 1
    for worst, replayed, eager, stolen in run_distributed(graphs_worker, 2, args=(schedule, autocast),
                                                         backend="nccl", timeout=240):
        assert worst <= 1e-6, worst
        # steps 1, 2, 4, 5 replayed; 0 and 3 not (4 microbatches through each chunk)
        assert (replayed, eager) == (4 * 4 * chunks, 2 * 4 * chunks), (replayed, eager)
        assert not stolen


def _split_models(kind: str, device) -> tuple[nn.Module, Any]:
    """One stage (the whole model) and a batch maker: our GPT with its tied head (the head's weight is
    the embedding's: not deferred), or an MLP with an in-place ReLU after a linear layer (not deferred)
    and a frozen bias (deferred weight, no bias gradient)."""
    from distributed_training.models import GPTConfig
    from distributed_training.pipeline import GPTStages, lm_loss

    if kind == "gpt":
        cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.0)
        stage = GPTStages(cfg, seed=1).build(0, 1, device)

        def batch(step: int, length: int):
            g = torch.Generator(device=device).manual_seed(step)
            idx = torch.randint(0, 256, (16, length), device=device, generator=g)
            return idx, torch.roll(idx, -1, 1)
        return stage, batch, lm_loss
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(8, 32), nn.ReLU(inplace=True), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)).to(device)
    stage[2].bias.requires_grad_(False)

    def batch(step: int, length: int):
        g = torch.Generator(device=device).manual_seed(step)
        return (torch.randn(length // 2, 8, device=device, generator=g),
                torch.randn(length // 2, 4, device=device, generator=g))
    return stage, batch, torch.nn.functional.mse_loss


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind,autocast", [("gpt", False), ("gpt", True), ("mlp", False)])
def test_graphed_split_backward_equals_the_eager_one_on_one_gpu(kind, autocast):
    """ZB-H1's I and W as graphs, on one stage (no messages: one GPU), in the order of rank 2 of a
    4-stage ZB-H1 (four slots in flight, forwards and I passes of others between an I and its W): the
    parameters after every step equal the eager split backward's (the same kernels), and a plain
    backward's within rounding; a length change runs eagerly, and the graphs replay again after it."""
    import copy

    device = torch.device("cuda", 0)
    torch.backends.cuda.matmul.allow_tf32 = False
    base, batch, loss_fn = _split_models(kind, device)
    order = build_schedule("zbh1", 4, 8)[2]
    stages, engines, opts = [], [], []
    for schedule, graphs in (("zbh1", False), ("zbh1", True), ("1f1b", False), ("1f1b", True)):
        stage = copy.deepcopy(base)
        engine = PipelineEngine([stage], ranks=[0], rank=0, schedule=schedule, microbatches=8, loss_fn=loss_fn,
                                device=device, cuda_graphs=graphs)
        if schedule == "zbh1":  # one stage, run as rank 2 of four would
            engine.actions = order
            if graphs:
                engine.graphs.slots = slots_per_chunk(order, 1)
        stages.append(stage)
        engines.append(engine)
        opts.append(torch.optim.AdamW([p for p in stage.parameters() if p.requires_grad], lr=1e-3))
    same = near = same_1f1b = 0.0
    for step, length in enumerate([32, 32, 32, 48, 32, 32]):
        x, y = batch(step, length)
        for engine, opt in zip(engines, opts):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                engine.step(x, y)
            opt.step()
            opt.zero_grad(set_to_none=True)
        for a, b, c, d in zip(*(s.parameters() for s in stages)):
            same = max(same, (a - b).abs().max().item())
            near = max(near, (a - c).abs().max().item())
            same_1f1b = max(same_1f1b, (c - d).abs().max().item())
    graphs = engines[1].graphs
    # (GPT: eagerly, the tied head's weight gradient is deferred to W through the split's Function and added
    # to the embedding's there; the graphs compute it in I, summed with the embedding's by autograd)
    assert same <= (1e-5 if kind == "gpt" else 1e-6), same
    assert near <= (1e-3 if autocast else 1e-5), near
    assert same_1f1b <= 1e-6, same_1f1b  # the graphed 1F1B at one stage (the weight-cast cache under autocast)
    for g in (graphs, engines[3].graphs):
        assert (g.replayed, g.eager) == (4 * 8, 2 * 8), (g.replayed, g.eager)
    assert bool(graphs.casts[0]) == autocast
    assert all(not t.any() for t in graphs.accumulators[0].values())
    deferred = [len(s.deferred) for s in graphs.captured[0][1]]
    expected = 2 * 4 if kind == "gpt" else 3  # GPT: 4 linear layers a block, the head tied; MLP: not the first
    assert deferred == [expected] * len(deferred), deferred
    # clear() (the trainer's close) hands the graphs' private memory pools back to the allocator.
    import gc

    before = torch.cuda.memory_allocated()
    engines[3].graphs.clear()
    gc.collect()
    assert torch.cuda.memory_allocated() < before
    # A schedule that leaves a graphed microbatch without its W is an error, as an eager one is.
    engines[1].actions = [a for a in order if (a.kind, a.microbatch) != ("W", 5)]
    x, y = batch(9, 32)
    with pytest.raises(RuntimeError, match=r"left weight gradients of \[\(5, 0\)\] \(microbatch, chunk\) without a W"):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            engines[1].step(x, y)


def batchnorm_worker(rank: int, world: int) -> tuple[float, float, int]:
    """Two stages with BatchNorm: the running statistics after each step equal the eager engine's (the
    capture's warm-up runs forwards too: it must leave them as they were)."""
    import torch.distributed as dist

    from distributed_training import init_distributed

    ctx = init_distributed()
    torch.backends.cuda.matmul.allow_tf32 = False
    ranks = list(range(world))
    engines, opts, stages = [], [], []
    for graphs in (False, True):
        torch.manual_seed(0)
        parts = [nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU()),
                 nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))]
        stage = parts[rank].to(ctx.device)
        up, down, headers = dist.new_group(ranks), dist.new_group(ranks), dist.new_group(ranks, backend="gloo")
        engines.append(PipelineEngine([stage], ranks=ranks, rank=rank, up_group=up, down_group=down,
                                      header_group=headers, schedule="1f1b", microbatches=4,
                                      loss_fn=torch.nn.functional.mse_loss, device=ctx.device, cuda_graphs=graphs))
        opts.append(torch.optim.SGD(stage.parameters(), lr=0.05, momentum=0.9))
        stages.append(stage)
    worst_p = worst_b = 0.0
    for step in range(5):
        g = torch.Generator(device=ctx.device).manual_seed(step)
        x = torch.randn(16, 8, device=ctx.device, generator=g)
        y = torch.randn(16, 4, device=ctx.device, generator=g)
        for engine, opt in zip(engines, opts):
            engine.step(x, y)
            opt.step()
            opt.zero_grad(set_to_none=True)
        worst_p = max([worst_p] + [(a - b).abs().max().item()
                                   for a, b in zip(stages[0].parameters(), stages[1].parameters())])
        worst_b = max([worst_b] + [(a.double() - b.double()).abs().max().item()
                                   for a, b in zip(stages[0].buffers(), stages[1].buffers())])
    return worst_p, worst_b, engines[1].graphs.replayed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_graphs_leave_batchnorm_statistics_as_the_eager_engine_does():
    for worst_p, worst_b, replayed in run_distributed(batchnorm_worker, 2, backend="nccl", timeout=240):
        assert worst_p <= 1e-5 and worst_b <= 1e-5, (worst_p, worst_b)
        assert replayed == 4 * 4, replayed


# ------------------------------------------------------------------ through the trainer
def hooks_worker(rank: int, world: int) -> dict[str, str | None]:
    """Which inner strategies leave the stages without module hooks (what a replay would skip)."""
    from distributed_training import DistributedTrainer

    found = {}
    for strategy in ("ddp", "zero2", "zero1", "zero3"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
        trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), strategy=strategy,
                                     pipeline_parallel_size=2, microbatches=2, progress=False)
        try:
            check_no_hooks(trainer.strategy.engine.chunks)
            found[strategy] = None
        except ValueError as err:
            found[strategy] = str(err)
        trainer.close()
    return found


def test_the_strategies_graphs_refuse_are_those_with_module_hooks():
    for found in run_distributed(hooks_worker, 4, timeout=120):
        assert found["ddp"] is None, found
        assert all("module hooks" in found[s] for s in ("zero1", "zero2", "zero3")), found


def trainer_graphs_worker(rank: int, world: int, variants=(False, True), schedule: str = "1f1b") -> tuple[float, int]:
    from distributed_training import DistributedTrainer

    trainers = []
    for graphs in variants:
        torch.manual_seed(0)
        trainers.append(DistributedTrainer(tiny_gpt(), lambda ps: torch.optim.AdamW(ps, lr=1e-3), strategy="ddp",
                                           mixed_precision="bf16", pipeline_parallel_size=2, microbatches=4,
                                           pipeline_schedule=schedule, pipeline_cuda_graphs=graphs, progress=False))
    worst = 0.0
    for step, length in enumerate([12, 12, 12, 16, 12]):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 64, (16, length + 1), generator=g)
        for trainer in trainers:
            trainer.train_step((tokens[:, :-1], tokens[:, 1:]))
        for a, b in zip(*(t.strategy.engine.chunks[0].parameters() for t in trainers)):
            worst = max(worst, (a - b).abs().max().item())
    graphs = trainers[1].strategy.engine.graphs
    replayed = graphs.replayed if graphs is not None else 0
    for trainer in trainers:
        trainer.close()
    return worst, replayed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs")
@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_trainer_with_graphs_equals_without_at_p2_x_dp2_on_nccl(schedule):
    """P = 2 x DP = 2 with our DDP inside the stages (its gradient hooks fire from the replayed backward)."""
    for worst, replayed in run_distributed(trainer_graphs_worker, 4, args=((False, True), schedule), backend="nccl",
                                           timeout=240):
        assert worst <= 1e-6, worst
        assert replayed == 3 * 4, replayed  # steps 1, 2 and 4 (step 3's length runs eagerly)
