"""On 2+ GPUs with NCCL: our DDP equals torch's DDP step for step (skipped without them)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from distributed_training.testing import run_distributed

from _models import reference_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)]


def nccl_parity_worker(rank: int, world: int) -> float:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from distributed_training import DDP, init_distributed
    from distributed_training.models import GPT, GPTConfig

    ctx = init_distributed()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=3, n_head=4, n_embd=128)).to(ctx.device)
    ours = DDP(copy.deepcopy(base), bucket_cap_mb=0.5)
    ref = TorchDDP(copy.deepcopy(base), device_ids=[ctx.device.index], bucket_cap_mb=0.5)
    opt_o = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    worst = 0.0
    g = torch.Generator(device=ctx.device).manual_seed(rank)
    for _ in range(6):
        idx = torch.randint(0, 512, (4, 64), device=ctx.device, generator=g)
        for model, opt in ((ours, opt_o), (ref, opt_r)):
            model(idx, torch.roll(idx, -1, 1)).backward()
            opt.step()
            opt.zero_grad()
        for a, b in zip(ours.module.parameters(), ref.module.parameters()):
            worst = max(worst, (a - b).abs().max().item())
    return worst


def test_nccl_parity_with_torch_ddp():
    worst = run_distributed(nccl_parity_worker, 2, backend="nccl", timeout=300)
    assert max(worst) <= 1e-5, worst


def trainer_cross_load_worker(rank: int, world: int, directory: str) -> list[str]:
    """Every strategy trains on NCCL in bf16 and fp16, saves, and the next strategy loads the checkpoint
    into a differently seeded model: its full state must equal the saved one exactly."""
    import os

    from distributed_training import DistributedTrainer, init_distributed
    from distributed_training.models import GPT, GPTConfig

    ctx = init_distributed()
    problems = []
    order = ["ddp", "zero1", "zero2", "zero3", "ddp"]
    for i, (saver, loader) in enumerate(zip(order, order[1:])):
        precision = "bf16" if i % 2 == 0 else "fp16"
        path = os.path.join(directory, f"{saver}_{i}")
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=3, n_head=4, n_embd=128))
        trainer = DistributedTrainer(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), strategy=saver,
                                     context=ctx, mixed_precision=precision, gradient_clip_val=1.0, progress=False)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            idx = torch.randint(0, 512, (4, 65), generator=g)
            trainer.train_step((idx[:, :-1], idx[:, 1:]))
        trainer.save_checkpoint(path)
        saved = trainer.full_state_dict()
        trainer.close()
        torch.manual_seed(1)
        model = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=3, n_head=4, n_embd=128))
        other = DistributedTrainer(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), strategy=loader,
                                   context=ctx, mixed_precision=precision, progress=False)
        other.load_checkpoint(path)
        loaded = other.full_state_dict()
        idx = torch.randint(0, 512, (4, 65), generator=g)
        loss = other.train_step((idx[:, :-1], idx[:, 1:]))["loss"]
        other.close()
        if not torch.isfinite(loss):
            problems.append(f"{loader} after loading {saver}: loss {loss}")
        for key, value in saved.items():
            if not torch.equal(loaded[key], value):
                problems.append(f"{saver} -> {loader} ({precision}): {key} differs by "
                                f"{(loaded[key].float() - value.float()).abs().max().item()}")
    ctx.shutdown()
    return problems


def test_trainer_on_nccl_every_strategy_saves_and_the_next_loads_exactly(tmp_path):
    problems = run_distributed(trainer_cross_load_worker, 2, args=(str(tmp_path),), backend="nccl", timeout=300)
    assert problems == [[], []], problems


def nccl_pipeline_worker(rank: int, world: int, schedule: str) -> tuple[float, float]:
    import torch.distributed as dist

    from distributed_training import init_distributed
    from distributed_training.models import GPTConfig
    from distributed_training.pipeline import GPTStages, PipelineEngine, lm_loss, sync_tied_grads

    ctx = init_distributed()
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
    maker = GPTStages(cfg, seed=1)
    stage = maker.build(rank, world, ctx.device)
    reference = maker.model(ctx.device)
    tied = maker.tied_groups(world)
    ranks = list(range(world))
    # What NCCL needs (p2p.py): one NCCL group per direction and a gloo group for the headers.
    up, down, headers = dist.new_group(ranks), dist.new_group(ranks), dist.new_group(ranks, backend="gloo")
    engine = PipelineEngine([stage], ranks=ranks, rank=rank, group=None, up_group=up, down_group=down,
                            header_group=headers, schedule=schedule, microbatches=4, loss_fn=lm_loss,
                            device=ctx.device, after_backward=lambda: sync_tied_grads(stage, tied, None))
    opt = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    whole = dict(reference.named_parameters(remove_duplicate=False))
    worst_p, worst_l = 0.0, 0.0
    from distributed_training.pipeline import gpt_key

    for step in range(5):
        g = torch.Generator(device=ctx.device).manual_seed(step)
        # Lengths 32, 40, 48, 40, 48: new shapes (every message by its header), then known ones (received
        # by the shape they had, headers checked at the step's end).
        idx = torch.randint(0, 512, (8, 32 + 8 * min(step, 2 - step % 2)), device=ctx.device, generator=g)
        targets = torch.roll(idx, -1, 1)
        loss = engine.step(idx, targets)
        opt.step()
        opt.zero_grad()
        ref_loss = reference_step(reference, ref_opt, idx, targets)
        worst_l = max(worst_l, abs(loss.item() - ref_loss.item()))
        for key, p in stage.named_parameters():
            worst_p = max(worst_p, (p - whole[gpt_key(key)]).abs().max().item())
    assert engine.link.received_by_known_shape == 2 * 4, engine.link.received_by_known_shape  # steps 4 and 5
    return worst_p, worst_l


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_on_nccl_equals_one_process(schedule):
    """Two stages over NCCL (payloads on two one-direction groups, headers on gloo): no deadlock in 1F1B's
    steady state, and the same parameters as one GPU on the whole batch (lengths change each step)."""
    for worst_p, worst_l in run_distributed(nccl_pipeline_worker, 2, args=(schedule,), backend="nccl", timeout=180):
        assert worst_p <= 1e-4 and worst_l <= 1e-4, (worst_p, worst_l)


def nccl_known_shape_failure_worker(rank: int, world: int, directory: str):
    """The last stage raises in the middle of a step whose shapes are known (no header awaited): the
    first stage still raises, promptly, instead of waiting for a gradient that never comes.

    Each rank writes what it raised to a file and leaves at once: NCCL sends and receives already
    posted toward the stopped peer stay pending on the GPU, and `destroy_process_group` would wait for
    them until NCCL's watchdog ends them (the collective timeout)."""
    import json
    import time

    import torch.distributed as dist
    from torch import nn

    from distributed_training import init_distributed
    from distributed_training.pipeline import PipelineEngine

    ctx = init_distributed()
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64) for _ in range(2)]
    calls = {"n": 0}

    def forward_hook(_module, _args, out):
        calls["n"] += 1
        if rank == 1 and calls["n"] == 4 * 2 + 3:  # the third microbatch of the third step
            raise ValueError("boom on the last stage")
        return out

    stage = layers[rank].to(ctx.device)
    stage.register_forward_hook(forward_hook)
    ranks = list(range(world))
    up, down, headers = dist.new_group(ranks), dist.new_group(ranks), dist.new_group(ranks, backend="gloo")
    engine = PipelineEngine([stage], ranks=ranks, rank=rank, up_group=up, down_group=down, header_group=headers,
                            schedule="1f1b", microbatches=4, loss_fn=torch.nn.functional.mse_loss, device=ctx.device)
    x, y = torch.randn(8, 16, 64, device=ctx.device), torch.randn(8, 16, 64, device=ctx.device)
    for _ in range(2):
        engine.step(x, y)
    started = time.monotonic()
    try:
        engine.step(x, y)
    except RuntimeError as err:
        outcome = [type(err).__name__, str(err)[:300], time.monotonic() - started, engine.link.received_by_known_shape]
    else:
        outcome = None
    with open(os.path.join(directory, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)
    if rank == 1:  # the failing stage: its notice to rank 0 in flight must arrive before its process ends
        time.sleep(2.0)  # (ended at once, rank 0 saw the connection reset first: "went away", session 35)
    os._exit(3)  # the harness counts a silent exit with a code other than 0 as done (failed) at once


def test_pipeline_failure_with_known_shapes_on_nccl(tmp_path):
    import json

    from distributed_training.testing import DistributedTestError

    with pytest.raises(DistributedTestError):  # the ranks leave without a result (see the worker)
        run_distributed(nccl_known_shape_failure_worker, 2, args=(str(tmp_path),), backend="nccl", timeout=90)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[1] is not None and "boom on the last stage" in results[1][1], results[1]
    kind, message, elapsed, known = results[0]
    assert kind == "PipelineAborted" and "global rank 1 failed" in message, results[0]
    assert known > 0 and elapsed < 30, results[0]


def nccl_pipeline_checkpoint_worker(rank: int, world: int, directory: str) -> list[str]:
    """The trainer at P=2 on NCCL saves and evaluates; DDP without a pipeline loads it exactly and
    evaluates the same; a P=2 trainer loads DDP's checkpoint back exactly."""
    import os

    from torch.utils.data import TensorDataset

    from distributed_training import DistributedTrainer, init_distributed
    from distributed_training.models import GPT, GPTConfig

    ctx = init_distributed()
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=3, n_head=4, n_embd=128)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 512, (10, 65), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    problems = []

    def make(seed, pipe):
        torch.manual_seed(seed)
        kwargs = dict(pipeline_parallel_size=pipe, microbatches=2) if pipe > 1 else {}
        return DistributedTrainer(GPT(cfg), adamw, context=ctx, progress=False, **kwargs)

    def compare(got, want, what):
        if ctx.rank == 0:
            for key, value in want.items():
                if not torch.equal(got[key], value):
                    problems.append(f"{what}: {key} differs by {(got[key] - value).abs().max().item()}")

    piped = make(0, 2)
    for _ in range(2):
        idx = torch.randint(0, 512, (4, 65), generator=g)
        piped.train_step((idx[:, :-1], idx[:, 1:]))
    piped.save_checkpoint(os.path.join(directory, "p2"))
    saved = piped.full_state_dict()
    piped_eval = piped.evaluate(data, batch_size=4)["loss"]
    piped.close()

    plain = make(1, 1)
    plain.load_checkpoint(os.path.join(directory, "p2"))
    compare(plain.full_state_dict(), saved, "P2 -> ddp")
    plain_eval = plain.evaluate(data, batch_size=4)["loss"]
    if abs(piped_eval - plain_eval) > 1e-4 * abs(plain_eval):
        problems.append(f"evaluate: {piped_eval} at P2, {plain_eval} under ddp")
    plain.save_checkpoint(os.path.join(directory, "ddp"))
    plain.close()

    back = make(2, 2)
    back.load_checkpoint(os.path.join(directory, "ddp"))
    compare(back.full_state_dict(), saved, "ddp -> P2")
    back.close()
    ctx.shutdown()
    return problems


def test_pipeline_checkpoints_and_evaluate_on_nccl(tmp_path):
    problems = run_distributed(nccl_pipeline_checkpoint_worker, 2, args=(str(tmp_path),), backend="nccl", timeout=300)
    assert problems == [[], []], problems


def nccl_pipeline_zero_worker(rank: int, world: int, strategy: str, schedule: str):
    from distributed_training import init_distributed

    from test_pipeline_zero import parity_worker

    ctx = init_distributed()
    torch.backends.cuda.matmul.allow_tf32 = False
    return parity_worker(rank, world, "gpt", strategy, schedule, 2, 0.5, "sgd", context=ctx)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs (P=2 x DP=2)")
@pytest.mark.parametrize("strategy, schedule", [("zero3", "1f1b"), ("zero1", "zbh1"), ("zero2", "gpipe")])
def test_pipeline_with_zero_inside_stages_on_nccl_equals_one_process(strategy, schedule):
    """P=2 x DP=2 on NCCL, ZeRO inside the stages: the tied GPT's parameters after every step, the loss and
    the clipped norm equal one process's on the whole batch (CPU, fp32)."""
    results = run_distributed(nccl_pipeline_zero_worker, 4, args=(strategy, schedule), backend="nccl", timeout=300)
    assert max(results[0][0]) <= 1e-4, results[0][0]
    for _, losses, norms, _ in results:
        assert all(abs(got - want) <= 1e-4 * max(1.0, abs(want)) for got, want in losses + norms), (losses, norms)


def nccl_tensor_worker(rank: int, world: int, tp: int, strategy: str, sequence_parallel: bool, pipeline):
    from distributed_training import init_distributed

    from test_tensor_trainer import parity_worker

    ctx = init_distributed()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return parity_worker(rank, world, "gpt", tp, strategy, sequence_parallel, 0.5, "sgd", pipeline, context=ctx)


@pytest.mark.parametrize("world, tp, strategy, sequence_parallel, pipeline", [
    (2, 2, "ddp", True, None), (4, 4, "ddp", True, None), (4, 2, "zero3", True, None), (4, 2, "ddp", True, "1f1b"),
])
def test_tensor_parallel_on_nccl_equals_one_process(world, tp, strategy, sequence_parallel, pipeline):
    """Tensor parallelism on NCCL (the flat all-gather / reduce-scatter paths), with sequence
    parallelism, alone, x ZeRO-3 and x a pipeline: parameters after every step, the loss and the clipped
    norm equal one process's on the whole batch (CPU, fp32)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    results = run_distributed(nccl_tensor_worker, world, args=(tp, strategy, sequence_parallel, pipeline),
                              backend="nccl", timeout=300)
    assert max(results[0][0]) <= 1e-4, results[0][0]
    for _, losses, norms in results:
        assert all(abs(got - want) <= 1e-4 * max(1.0, abs(want)) for got, want in losses + norms), (losses, norms)


def nccl_dropout_worker(rank: int, world: int) -> bool:
    import torch.nn.functional as F
    from torch import nn

    from distributed_training import init_distributed
    from distributed_training.tensor import SequenceParallelDropout

    ctx = init_distributed()
    full = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(0)).to(ctx.device)  # alike on every rank
    torch.cuda.manual_seed(7)
    want = F.dropout(full, 0.3, training=True)
    layer = SequenceParallelDropout.from_module(nn.Dropout(0.3), None)
    torch.cuda.manual_seed(7)
    got = layer(full.chunk(world, dim=1)[rank].contiguous())
    return torch.equal(got, want.chunk(world, dim=1)[rank])


def test_sequence_parallel_dropout_on_cuda_draws_tp1s_mask():
    assert all(run_distributed(nccl_dropout_worker, 2, backend="nccl", timeout=120))


def ring_lanes_worker(rank: int, world: int) -> list[str]:
    """The ring on NCCL spreads a large tensor's segments over lanes (extra communicators over the
    world) and still equals NCCL's all-reduce; on a subgroup it runs on one communicator."""
    import torch.distributed as dist

    from distributed_training import init_distributed
    from distributed_training.comm.patterns import ring_all_reduce, ring_lanes

    ctx = init_distributed()
    failures = []
    members = [0, 1] if world < 4 else [3, 1, 0]
    sub = dist.new_group(members)
    for group, where in ((None, "world"), (sub, "subgroup")):
        if group is not None and rank not in members:
            continue
        n = dist.get_world_size(group)
        g = torch.Generator(device=ctx.device).manual_seed(rank)
        x = torch.randn(n * 64 * 1024 * 1024 + 3, device=ctx.device, generator=g)  # 256 MiB chunks: on lanes
        expected = x.clone()
        dist.all_reduce(expected, group=group)
        got = ring_all_reduce(x.clone(), group)
        lanes = len(ring_lanes(group))
        # A subgroup's ring runs on one communicator; at world 2 the "subgroup" of both ranks is the world.
        if lanes != (3 if group is None or len(members) == world else 0):
            failures.append(f"{where}: {lanes} lanes")
        if not torch.allclose(got, expected, rtol=1e-5, atol=1e-4):
            failures.append(f"{where}: max diff {(got - expected).abs().max().item()}")
    dist.barrier()
    return failures


def test_ring_over_lanes_on_nccl_equals_all_reduce():
    world = min(torch.cuda.device_count(), 4)
    for failures in run_distributed(ring_lanes_worker, world, backend="nccl", timeout=300):
        assert not failures, failures
