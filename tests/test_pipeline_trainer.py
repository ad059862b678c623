"""DistributedTrainer(pipeline_parallel_size=...) against one process on the whole batch: the gathered
parameters equal the single-process model's after every step (P=2, and P=2 x DP=2 under DDP)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed_training import DistributedTrainer
from distributed_training.pipeline.training import PipelineOptions
from distributed_training.testing import run_distributed

from _models import tiny_gpt
from _pipeline import step_against_reference, train_against_reference

TOL = 1e-5
STEPS = 3


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return tiny_gpt()


def _batch(kind: str, step: int, rows: int):
    g = torch.Generator().manual_seed(100 + step)
    if kind == "mlp":
        return torch.randn(rows, 16, generator=g), torch.randn(rows, 4, generator=g)
    length = 8 + step  # the sequence length changes from step to step
    tokens = torch.randint(0, 64, (rows, length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def parity_worker(rank, world, kind, pipe, schedule, microbatches, clip):
    base = _mlp() if kind == "mlp" else _gpt()
    reference = copy.deepcopy(base)
    ref_opt = _sgd(reference.parameters())
    trainer = DistributedTrainer(copy.deepcopy(base), _sgd, gradient_clip_val=clip, pipeline_parallel_size=pipe,
                                 pipeline_schedule=schedule, microbatches=microbatches)
    worst, losses, norms = train_against_reference(trainer, reference, ref_opt, _batch, kind, clip, rank,
                                                   2 * microbatches, STEPS)
    trainer.close()
    return max(worst, default=0.0), losses, norms


@pytest.mark.parametrize("world, kind, schedule, microbatches, clip", [
    (2, "mlp", "gpipe", 4, None),
    (2, "mlp", "1f1b", 3, 0.05),
    (2, "gpt", "1f1b", 2, None),
    (2, "gpt", "interleaved_1f1b", 4, 0.5),
    (4, "mlp", "1f1b", 2, 0.05),
    (4, "gpt", "gpipe", 4, None),
    (2, "gpt", "gpipe", 4, None),
    (4, "gpt", "1f1b", 2, 0.5),
])
def test_pipeline_trainer_matches_one_process(world, kind, schedule, microbatches, clip):
    results = run_distributed(parity_worker, world, args=(kind, 2, schedule, microbatches, clip), timeout=120)
    worst = results[0][0]
    assert worst <= TOL, f"parameters differ from one process by {worst:.3g}"
    for rank, (_, losses, norms) in enumerate(results):
        for got, want in losses:  # every rank of a pipeline reports its replica's whole-batch loss
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (rank, losses)
        for got, want in norms:
            assert abs(got - want) <= 1e-5 * max(1.0, want), (rank, norms)
        if clip is not None:
            assert any(want > clip for _, want in norms), "the clip threshold must actually clip"


def test_pipeline_ddp_p2_dp2_matches_one_process():
    """P=2 x DP=2 under DDP: the stage gradients are averaged across replicas once per step."""
    results = run_distributed(parity_worker, 4, args=("mlp", 2, "gpipe", 2, None), timeout=120)
    assert results[0][0] <= TOL, results[0][0]


def mixed_precision_worker(rank, world, mode):
    model = _gpt()
    x, y = _batch("gpt", 0, 4)
    with torch.no_grad():
        fp32_loss = model(x, y).item()
    trainer = DistributedTrainer(model, _sgd, mixed_precision=mode, pipeline_parallel_size=2, microbatches=2)
    losses = [float(trainer.train_step((x, y))["loss"]) for _ in range(2)]
    trainer.close()
    return fp32_loss, losses


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_pipeline_mixed_precision_runs_and_learns(mode):
    """bf16 autocast, and fp16 with the loss scaler: the reported loss is unscaled (near fp32's)."""
    for fp32_loss, (first, second) in run_distributed(mixed_precision_worker, 2, args=(mode,), timeout=120):
        assert abs(first - fp32_loss) < 0.05 * fp32_loss, (first, fp32_loss)
        assert second < first


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("kwargs, field", [
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size"),
    (dict(pipeline_parallel_size=2, microbatches=0), "microbatches"),
    (dict(pipeline_parallel_size=4, microbatches=2, pipeline_schedule="1f1b"), "microbatches"),
    (dict(pipeline_parallel_size=2, microbatches=3, pipeline_schedule="interleaved_1f1b"), "microbatches"),
    (dict(pipeline_parallel_size=2, pipeline_schedule="pipedream"), "pipeline_schedule"),
    (dict(pipeline_parallel_size=2, pipeline_chunks=2), "pipeline_chunks"),
    (dict(pipeline_parallel_size=2, pipeline_split_points=["2", "4"]), "pipeline_split_points"),
    (dict(pipeline_parallel_size=2, pipeline_balance="flops"), "pipeline_balance"),
    (dict(pipeline_parallel_size=2, pipeline_sample_input=torch.zeros(2, 16)), "pipeline_sample_input"),
])
def test_pipeline_options_errors_name_the_field(kwargs, field):
    names = {"pipeline_parallel_size": "size", "pipeline_schedule": "schedule", "microbatches": "microbatches",
             "pipeline_split_points": "split_points", "pipeline_chunks": "chunks", "pipeline_balance": "balance",
             "pipeline_sample_input": "sample_input"}
    with pytest.raises(ValueError, match=field):
        PipelineOptions(**{names[k]: v for k, v in kwargs.items()})


def test_half_blocks_must_be_a_bool():
    with pytest.raises(TypeError, match="pipeline_half_blocks"):
        PipelineOptions(size=2, half_blocks="yes")


def test_gpipe_allows_fewer_microbatches_than_stages():
    assert PipelineOptions(size=4, schedule="gpipe", microbatches=2).microbatches == 2


def errors_worker(rank, world):
    found = {}
    cases = {
        "divide": dict(pipeline_parallel_size=2),  # world 3
        "layers": dict(pipeline_parallel_size=3, model=nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))),
        "split": dict(pipeline_parallel_size=3, pipeline_split_points=["2", "nope"]),
        "strategy": dict(pipeline_parallel_size=3, strategy="auto"),
        "optimizer": dict(pipeline_parallel_size=3, optimizer="built"),
        "accumulation": dict(pipeline_parallel_size=3, gradient_accumulation_steps=2),
        "balance": dict(pipeline_parallel_size=3, pipeline_balance="compute"),  # an MLP: no compute model
        "sample": dict(pipeline_parallel_size=3, pipeline_balance="time"),  # an MLP: no default sample
        "half": dict(pipeline_parallel_size=3, pipeline_half_blocks=True),  # an MLP: no blocks to halve
        "graphs_zb": dict(pipeline_parallel_size=3, pipeline_schedule="zbh1", pipeline_cuda_graphs=True),
        "graphs_ckpt": dict(pipeline_parallel_size=3, pipeline_cuda_graphs=True, activation_checkpointing=[nn.Linear]),
        "graphs_cpu": dict(pipeline_parallel_size=3, pipeline_cuda_graphs=True),
        "graphs_zero": dict(pipeline_parallel_size=3, pipeline_cuda_graphs=True, strategy="zero2"),
        "graphs_p1": dict(pipeline_cuda_graphs=True),
    }
    for name, kwargs in cases.items():
        kwargs = dict(kwargs)
        model = kwargs.pop("model", None) or _mlp()
        optimizer = _sgd(model.parameters()) if kwargs.pop("optimizer", None) == "built" else _sgd
        try:
            DistributedTrainer(model, optimizer, **kwargs).close()
            found[name] = None
        except (ValueError, NotImplementedError, TypeError) as err:
            found[name] = f"{type(err).__name__}: {err}"
    trainer = DistributedTrainer(_mlp(), _sgd, pipeline_parallel_size=3, microbatches=3)
    try:
        trainer.train_step((torch.randn(6, 16), torch.randn(6, 4)))  # no criterion, not a GPT
    except ValueError as err:
        found["criterion"] = f"{type(err).__name__}: {err}"
    trainer.close()
    return found


def test_pipeline_errors_name_the_field():
    found = run_distributed(errors_worker, 3, timeout=120)[0]
    expected = {"divide": "world size 3 cannot keep pipeline_parallel_size=2", "layers": "only 2 layers",
                "split": "pipeline_split_points", "strategy": "'auto' with pipeline_parallel_size=3",
                "optimizer": "pass a callable", "accumulation": "gradient_accumulation_steps",
                "criterion": "needs a criterion", "balance": "pipeline_balance='compute' knows the compute of our GPT",
                "sample": "pass pipeline_sample_input", "half": "pipeline_half_blocks=True cuts our GPT's blocks",
                "graphs_zb": "cuda_graphs (the trainer's pipeline_cuda_graphs) needs CUDA devices",  # zbh1 is fine
                "graphs_ckpt": "pipeline_cuda_graphs=True does not combine with activation_checkpointing",
                "graphs_cpu": "cuda_graphs (the trainer's pipeline_cuda_graphs) needs CUDA devices",
                "graphs_zero": "pipeline_cuda_graphs=True needs strategy='ddp' inside the stages, got strategy='zero2'",
                "graphs_p1": "pipeline_cuda_graphs=True replays pipeline stages: it needs pipeline_parallel_size > 1"}
    for case, text in expected.items():
        assert found[case] is not None and text in found[case], (case, found[case])


# ------------------------------------------------------------------ fit
def fit_worker(rank, world):
    from torch.utils.data import TensorDataset

    from distributed_training.data import ShardedSampler

    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g))
    base = _mlp()
    reference = copy.deepcopy(base)
    ref_opt = _sgd(reference.parameters())
    trainer = DistributedTrainer(copy.deepcopy(base), _sgd, pipeline_parallel_size=2, microbatches=2, seed=5)
    trainer.fit(data, epochs=1, criterion=F.mse_loss, batch_size=4, log_every=1)
    # The same steps in one process: the replicas' batches side by side (equal sizes: the mean of
    # their means is the mean over their union).
    shards = []
    for d in range(trainer.dp_world_size):
        sampler = ShardedSampler(data, trainer.dp_world_size, d, seed=5)
        sampler.set_epoch(0)
        shards.append(list(sampler))
    for step in range(len(shards[0]) // 4):
        rows = [i for shard in shards for i in shard[4 * step:4 * step + 4]]
        F.mse_loss(reference(data.tensors[0][rows]), data.tensors[1][rows]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    state = trainer.full_state_dict()
    trainer.close()
    if rank:
        return 0.0, trainer.step
    return max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items()), trainer.step


def test_fit_p2_dp2_matches_one_process():
    """`fit` feeds both pipeline ranks of a replica the same batches, and the replicas different ones."""
    results = run_distributed(fit_worker, 4, timeout=120)
    assert [steps for _, steps in results] == [2] * 4
    assert results[0][0] <= TOL, results[0][0]


# ------------------------------------------------------------------ DDP.sync_gradients
def ddp_sync_worker(rank, world):
    from distributed_training import DDP

    model = _mlp()
    ddp = DDP(copy.deepcopy(model), bucket_cap_mb=0.001)  # several buckets
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(4 * world, 16, generator=g), torch.randn(4 * world, 4, generator=g)
    with ddp.no_sync():
        for part in range(2):  # two accumulated backwards, then one reduction
            sl = slice(rank * 4 + 2 * part, rank * 4 + 2 * part + 2)
            (F.mse_loss(ddp(x[sl]), y[sl]) / 2).backward()
        ddp.sync_gradients()
    F.mse_loss(model(x), y).backward()
    return max((p.grad - q.grad).abs().max().item() for p, q in zip(ddp.module.parameters(), model.parameters()))


def test_ddp_sync_gradients_averages_what_no_sync_accumulated():
    for worst in run_distributed(ddp_sync_worker, 2, timeout=60):
        assert worst <= 1e-6, worst


def batchnorm_worker(rank, world):
    import torch.nn.functional as F
    from torch import nn

    from distributed_training import DistributedTrainer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.BatchNorm1d(8),
                          nn.Linear(8, 3))
    trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="ddp",
                                 pipeline_parallel_size=2, microbatches=2, progress=False)
    snapshots = []
    broadcast = trainer.model.before_forward

    def spy():  # the statistics right after the step's buffer broadcast
        broadcast()
        snapshots.append({k: v.clone() for k, v in trainer.strategy.buffers(trainer.model).items() if "running" in k})

    trainer.model.before_forward = spy
    g = torch.Generator().manual_seed(10 + trainer.dp_rank)  # each replica sees other data
    for _ in range(3):
        trainer.train_step((torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)), F.cross_entropy)
    trainer.close()
    return trainer.dp_rank, snapshots


def test_batchnorm_statistics_follow_replica_zero_in_every_stage():
    """As DDP's forward does, every step starts with data-parallel replica 0's buffers on every replica of
    a stage (before, replicas fed different data kept running statistics that drifted apart)."""
    results = run_distributed(batchnorm_worker, 4, timeout=120)
    for dp_rank, snapshots in results:
        assert len(snapshots) == 3, "one buffer broadcast per step"
    # Ranks 0, 1 hold the first stage (replicas 0, 1); ranks 2, 3 the second.
    for a, b in ((0, 1), (2, 3)):
        for step, (mine, theirs) in enumerate(zip(results[a][1], results[b][1])):
            assert mine and mine.keys() == theirs.keys()
            for key in mine:
                assert torch.equal(mine[key], theirs[key]), (step, key)
        # and the statistics do move from step to step (the check above is not vacuous)
        assert not torch.equal(results[a][1][0][next(iter(results[a][1][0]))],
                               results[a][1][-1][next(iter(results[a][1][0]))])


def balance_worker(rank, world):
    from distributed_training.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=512, block_size=16, n_layer=6, n_head=2, n_embd=16, dropout=0.0)
    held = {}
    for balance, compiled in (("parameters", False), ("compute", False), ("compute", True)):
        with torch.device("meta"):
            model = GPT(cfg)
        trainer = DistributedTrainer(model, _sgd, pipeline_parallel_size=2, pipeline_balance=balance,
                                     pipeline_compile_loss=compiled, progress=False)
        held[balance + (" compiled" if compiled else "")] = list(trainer.strategy.engine.chunks[0].names)
        if compiled:  # the step's loss goes through CompiledLoss (on CPU: the loss as it is)
            tokens = torch.randint(0, 512, (4, 9), generator=torch.Generator().manual_seed(0))
            held["loss"] = trainer.train_step((tokens[:, :-1], tokens[:, 1:]))["loss"]
            held["loss_fn"] = repr(trainer.strategy._loss_fn)

            class Graphs:  # stands in for the engine's StageGraphs (CUDA only): close() must clear them
                cleared = False

                def clear(self):
                    self.cleared = True

            graphs = trainer.strategy.engine.graphs = Graphs()
        trainer.close()
        if compiled:
            held["graphs_cleared"] = graphs.cleared and trainer.strategy.engine.graphs is None
    return held


def test_pipeline_balance_by_compute_moves_blocks_off_the_head_stage():
    """A GPT whose vocabulary outweighs its blocks: by parameters the embedding (counted like the head)
    takes a stage's share of blocks; by compute (a lookup costs next to nothing, the head its matmul)
    the first stage takes more blocks."""
    first, last = run_distributed(balance_worker, 2, timeout=120)
    assert first["parameters"] != first["compute"], first
    assert len(first["compute"]) > len(first["parameters"]), first  # blocks move to the embedding's stage
    assert first["compute"][-1] not in last["compute"] and "head" in last["compute"][-1], (first, last)
    # With pipeline_compile_loss on CPU the loss runs as it is (compiled on CUDA only), so the cut still
    # counts it (on CUDA the head carries none: `split_step(loss=False)`, tests/test_compiled_loss.py).
    assert last["compute compiled"] == last["compute"], (first, last)
    assert first["loss_fn"] == last["loss_fn"] == "CompiledLoss(lm_loss, devices=('cuda',))", last
    assert first["loss"] == last["loss"] > 0
    assert first["graphs_cleared"] and last["graphs_cleared"]  # close() hands the graphs' memory back


def checkpointing_worker(rank, world, schedule):
    from distributed_training.models.gpt import Block

    base = _gpt()
    reference = copy.deepcopy(base)
    ref_opt = _sgd(reference.parameters())
    trainer = DistributedTrainer(copy.deepcopy(base), _sgd, pipeline_parallel_size=2, pipeline_schedule=schedule,
                                 microbatches=2, activation_checkpointing=Block, progress=False)
    worst = 0.0
    for step in range(STEPS):
        x, y = _batch("gpt", step, 4)
        diff, _, _ = step_against_reference(trainer, reference, ref_opt, x, y, slice(0, 4), "gpt", None, rank)
        worst = max(worst, diff or 0.0)
    trainer.close()
    return worst


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_activation_checkpointing_inside_stages_matches_one_process(schedule):
    """Blocks recomputed in backward (ZB-H1: in its I pass) give one process's parameters."""
    assert run_distributed(checkpointing_worker, 2, args=(schedule,), timeout=120)[0] <= TOL


def half_blocks_worker(rank, world, schedule, split, checkpointing):
    from distributed_training.models.gpt import Block

    base = _gpt()
    reference = copy.deepcopy(base)
    ref_opt = _sgd(reference.parameters())
    trainer = DistributedTrainer(copy.deepcopy(base), _sgd, pipeline_parallel_size=2, pipeline_schedule=schedule,
                                 microbatches=2, pipeline_half_blocks=True, pipeline_balance="compute",
                                 pipeline_split_points=split, progress=False,
                                 activation_checkpointing=Block if checkpointing else None)
    stage = trainer.strategy.engine.chunks[0]
    names = list(stage.names)
    checkpointed = [name for name, layer in zip(stage.names, stage._chain)
                    if getattr(layer, "_dt_checkpointed", False)]
    worst = 0.0
    for step in range(STEPS):
        x, y = _batch("gpt", step, 4)
        diff, _, _ = step_against_reference(trainer, reference, ref_opt, x, y, slice(0, 4), "gpt", None, rank)
        worst = max(worst, diff or 0.0)
    keys = sorted(trainer.full_state_dict())
    trainer.close()
    return worst, names, checkpointed, keys == sorted(reference.state_dict())


@pytest.mark.parametrize("schedule, split, checkpointing", [
    ("1f1b", ["block.0.m"], False),  # a stage boundary inside block 0
    ("zbh1", None, True),            # balanced by compute over half blocks; blocks checkpointed by halves
])
def test_half_blocks_cut_inside_a_block_and_match_one_process(schedule, split, checkpointing):
    """pipeline_half_blocks: the GPT's chain cut at half blocks (block.i.a attention, block.i.m MLP); the
    parameters equal one process's after every step, the checkpoint keys are the model's, and a block
    chosen for activation checkpointing is checkpointed in both halves."""
    (worst, first, ckpt0, keys0), (_, second, ckpt1, _) = run_distributed(
        half_blocks_worker, 2, args=(schedule, split, checkpointing), timeout=120)
    assert worst <= TOL, worst
    assert keys0, "full_state_dict() keys differ from the model's"
    layers = first + second
    assert layers[0] == "embed" and layers[-1] == "head" and "block.0.a" in layers and "block.1.m" in layers
    if split is not None:
        assert first == ["embed", "block.0.a"] and second[0] == "block.0.m", (first, second)
    if checkpointing:
        assert ckpt0 + ckpt1 == [name for name in layers if name.startswith("block.")], (ckpt0, ckpt1)
    else:
        assert ckpt0 == ckpt1 == []


def short_tail_worker(rank, world):
    from torch.utils.data import TensorDataset

    data = TensorDataset(torch.randn(17, 16), torch.randn(17, 4))  # batches of 8: the last has 1 sample
    steps = []
    for drop_last in (False, True):
        trainer = DistributedTrainer(_mlp(), _sgd, pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b",
                                     microbatches=4, progress=False)
        history = trainer.fit(data, criterion=F.mse_loss, batch_size=8, drop_last=drop_last)
        trainer.close()
        steps.append(history[0]["steps"])
    return steps


def test_fit_pads_a_last_batch_interleaved_cannot_run():
    """Interleaved 1F1B needs a sample per pipeline rank: a last batch of 1 was refused at fit's start
    (pass drop_last=True) until session 46; fit now pads it to 2 (one sample twice), or drops it."""
    assert run_distributed(short_tail_worker, 2, timeout=120) == [[3, 2]] * 2
