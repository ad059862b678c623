"""ZeRO stages 1/2/3 through the trainer: equal to DDP, 1/W memory, re-shardable checkpoints."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed_training import FSDP, DistributedTrainer, FSDPStrategy
from distributed_training.comm.sharded import shard_size
from distributed_training.testing import run_distributed

from _models import tiny_gpt

TOL = 1e-5


def _full_params(trainer) -> dict[str, torch.Tensor]:
    """Every rank's view of the full model state (FSDP gathers; the others are replicated)."""
    model = trainer.model
    if isinstance(model, FSDP):
        return model.full_state_dict(rank0_only=False)
    return {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}


def _batches(rank, world, steps, dtype=torch.float32):
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(7 + step)
        idx = torch.randint(0, 64, (4 * world, 16), generator=g)
        sl = slice(4 * rank, 4 * (rank + 1))
        out.append((idx[sl], torch.roll(idx, -1, 1)[sl]))
    return out


def _opt(kind):
    if kind == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)
    return lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)


def stages_worker(rank, world, optim):
    torch.manual_seed(0)
    base = tiny_gpt().double() if optim == "adamw" else tiny_gpt()
    trainers = {name: DistributedTrainer(copy.deepcopy(base), _opt(optim), strategy=name)
                for name in ("ddp", "zero1", "zero2", "zero3")}
    worst = {name: 0.0 for name in trainers}
    for batch in _batches(rank, world, 4):
        for trainer in trainers.values():
            trainer.train_step(batch)  # GPT returns the loss itself
        reference = _full_params(trainers["ddp"])
        for name, trainer in trainers.items():
            mine = _full_params(trainer)
            worst[name] = max(worst[name], max((mine[k] - reference[k]).abs().max().item() for k in reference))
    for t in trainers.values():
        t.close()
    return worst


@pytest.mark.parametrize("world, optim", [(3, "sgd"), (2, "adamw"), (1, "sgd")])
def test_every_zero_stage_equals_ddp(world, optim):
    for worst in run_distributed(stages_worker, world, args=(optim,), timeout=180):
        assert max(worst.values()) <= TOL, worst


# ------------------------------------------------------------------ memory per rank
def memory_worker(rank, world, stage):
    torch.manual_seed(0)
    model = tiny_gpt()
    total = sum(p.numel() for p in model.parameters())
    trainer = DistributedTrainer(model, _opt("adamw"), strategy=stage)
    batch = _batches(rank, world, 1)[0]
    trainer.model.train()
    loss = trainer._loss(batch, None)
    loss.backward()
    params = list(trainer.model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    trainer.optimizer.step()
    state_bytes = sum(v.numel() * v.element_size() for s in trainer.optimizer.state.values()
                      for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    if isinstance(trainer.model, FSDP):
        expected = sum(shard_size(u.numel, world) for u in trainer.model._units) * 4
    else:
        expected = sum(shard_size(g.numel, world) for g in trainer.strategy.groups) * 4
    trainer.close()
    return total, param_bytes, grad_bytes, state_bytes, expected


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_bytes_per_rank_are_one_over_world(stage):
    world = 4
    for total, param_bytes, grad_bytes, state_bytes, expected in run_distributed(memory_worker, world, args=(stage,)):
        full = total * 4
        # Adam keeps two moments per parameter: sharded, each is this rank's slice.
        assert state_bytes == 2 * expected, (state_bytes, expected)
        assert abs(expected - full / world) <= 4 * world * 8, (expected, full / world)  # padding only
        if stage == "zero1":
            assert param_bytes == full and grad_bytes == full  # replicated by design
        else:
            assert param_bytes == expected and grad_bytes == expected


# ------------------------------------------------------------------ checkpoints
def save_worker(rank, world, directory, stage):
    torch.manual_seed(0)
    trainer = DistributedTrainer(tiny_gpt(), _opt("sgd"), strategy=stage)
    for batch in _batches(rank, world, 3):
        trainer.train_step(batch)
    trainer.save_checkpoint(os.path.join(directory, "ckpt"))
    full = _full_params(trainer)
    if rank == 0:
        torch.save(full, os.path.join(directory, "full.pt"))
    trainer.close()
    return sorted(os.listdir(os.path.join(directory, "ckpt")))


def load_worker(rank, world, directory, stage):
    torch.manual_seed(123)  # a different initialisation: everything must come from the checkpoint
    trainer = DistributedTrainer(tiny_gpt(), _opt("sgd"), strategy=stage)
    trainer.load_checkpoint(os.path.join(directory, "ckpt"))
    step_after_load = trainer.step
    saved = torch.load(os.path.join(directory, "full.pt"))
    loaded = _full_params(trainer)
    identical = list(saved) == list(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved)
    # Training continues: the same global batches give the same parameters whatever the world size.
    for batch in _batches(rank, world, 2):
        trainer.train_step(batch)
    after = _full_params(trainer)
    errors = {}
    other = DistributedTrainer(nn.Sequential(nn.Linear(4, 4)), _opt("sgd"), strategy=stage)
    try:
        other.load_checkpoint(os.path.join(directory, "ckpt"))
    except (ValueError, RuntimeError) as err:
        errors["other"] = str(err)
    trainer.close()
    other.close()
    return identical, step_after_load, after, errors


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero3", "zero1"])
def test_checkpoint_saved_at_2_loads_at_3_and_1(tmp_path, stage):
    files = run_distributed(save_worker, 2, args=(str(tmp_path), stage))[0]
    assert files == ["meta.pt", "meta.pt.sha256", "rank0.pt", "rank1.pt"], files
    results = {}
    for world in (3, 1):
        identical, step, after, errors = run_distributed(load_worker, world, args=(str(tmp_path), stage), timeout=120)[0]
        assert identical, f"world {world}: the loaded state differs from the saved one"
        assert step == 3
        assert "ckpt" in errors["other"] and ("0.weight" in errors["other"] or "blocks" in errors["other"]), errors
        results[world] = after
    # Continuing at world 3 (global batch 12) and at world 1 (global batch 4) are different runs, but
    # each must be a real continuation: parameters moved away from the checkpoint.
    saved = torch.load(tmp_path / "full.pt")
    for world, after in results.items():
        assert any(not torch.equal(after[k], saved[k]) for k in saved), world


def continue_worker(rank, world, directory):
    """World 3 continues from a world-2 checkpoint; one process continues from the same full state
    and the same momentum: the two must agree step for step."""
    torch.manual_seed(5)
    trainer = DistributedTrainer(tiny_gpt(), _opt("sgd"), strategy="zero3")
    trainer.load_checkpoint(os.path.join(directory, "ckpt"))
    reference = tiny_gpt()
    reference.load_state_dict(torch.load(os.path.join(directory, "full.pt")))
    ref_opt = _opt("sgd")(reference.parameters())
    # Rebuild the full momentum from the loaded shards: gather each unit's momentum.
    fsdp = trainer.model
    momentum = {}
    for unit, shard in zip([u for u in fsdp._units if u.padded], fsdp.shards):
        buf = trainer.optimizer.state[shard]["momentum_buffer"]
        full = torch.empty(unit.padded)
        torch.distributed.all_gather_into_tensor(full, buf.contiguous())
        for info in unit.infos:
            momentum[info.fqns[0]] = full[info.offset:info.offset + info.numel].view(info.shape)
    named = dict(reference.named_parameters())
    for name, p in named.items():
        ref_opt.state[p]["momentum_buffer"] = momentum[name].clone()
    worst = 0.0
    for step in range(2):
        g = torch.Generator().manual_seed(50 + step)
        idx = torch.randint(0, 64, (4 * world, 16), generator=g)
        tgt = torch.roll(idx, -1, 1)
        trainer.train_step((idx[4 * rank:4 * rank + 4], tgt[4 * rank:4 * rank + 4]))
        reference(idx, tgt).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mine = _full_params(trainer)
        worst = max(worst, max((mine[k] - v).abs().max().item() for k, v in reference.state_dict().items()))
    trainer.close()
    return worst


@pytest.mark.slow
def test_resharded_training_continues_exactly(tmp_path):
    run_distributed(save_worker, 2, args=(str(tmp_path), "zero3"))
    assert max(run_distributed(continue_worker, 3, args=(str(tmp_path),), timeout=120)) <= TOL


# ------------------------------------------------------------------ bad input
class SharedAcrossUnits(nn.Module):
    """Block 0's and block 2's first layers are one module: the weight is used in two units."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Sequential(shared if i % 2 == 0 else nn.Linear(8, 8), nn.Tanh())
                                    for i in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def shared_worker(rank, world):
    torch.manual_seed(0)
    base = SharedAcrossUnits()
    reference = copy.deepcopy(base)
    fsdp = FSDP(copy.deepcopy(base))
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    worst = 0.0
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(2 * world, 8, generator=g), torch.randn(2 * world, 2, generator=g)
        F.mse_loss(fsdp(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]).backward()
        F.mse_loss(reference(x), y).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        full = fsdp.full_state_dict()
        if rank == 0:
            worst = max(worst, max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items()))
    return worst, fsdp.unit_names()


def test_parameters_shared_across_units_are_owned_by_their_common_parent():
    worst, units = run_distributed(shared_worker, 2)[0]
    assert worst <= TOL
    # Block 0's only parameters are the shared layer's: the root owns them and block 0 is no unit.
    assert "blocks.1" in units and "blocks.0" not in units and "blocks.2" not in units, units


def optimizer_object_worker(rank, world):
    model = tiny_gpt()
    try:
        DistributedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="zero3")
    except TypeError as err:
        return str(err)
    return None


def test_sharded_strategies_need_an_optimizer_factory():
    msg = run_distributed(optimizer_object_worker, 1)[0]
    assert msg is not None and "callable" in msg


def test_fsdp_strategy_object_accepts_options():
    strategy = FSDPStrategy(reshard_after_forward=False, auto_wrap_policy={nn.Linear})
    assert strategy.fsdp_kwargs["reshard_after_forward"] is False


def fsdp_evaluate_worker(rank, world, samples):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(samples, 8, generator=g),
                                          torch.randint(0, 3, (samples,), generator=g))
    trainer = DistributedTrainer(model, _opt("sgd"), strategy="zero3")
    # 31 samples: shards of 11/10/10, 3, 2 and 2 batches; 2 samples: the third rank's shard is empty
    ours = trainer.evaluate(data, F.cross_entropy, batch_size=5, metrics={"hits": _hits})
    trainer.close()
    x, y = data.tensors
    with torch.no_grad():
        out = reference(x)
        return ours["loss"], ours["hits"], F.cross_entropy(out, y).item(), _hits(out, y).item()


def _hits(out, y):
    return (out.argmax(-1) == y).float().mean()


@pytest.mark.parametrize("samples", [31, 2])
def test_sharded_evaluate_with_uneven_shards_is_exact(samples):
    """Every rank runs as many forwards (they gather parameters): a rank whose shard is done repeats a
    batch that counts 0; one whose shard was empty borrowed the set's first sample and counted it."""
    for ours, hits, expected, expected_hits in run_distributed(fsdp_evaluate_worker, 3, args=(samples,), timeout=60):
        assert abs(ours - expected) <= 1e-6 and abs(hits - expected_hits) <= 1e-6, (ours, expected, hits, expected_hits)


def test_default_units_include_repeated_blocks_in_a_sequential_but_not_bare_layers():
    """timm keeps ViT blocks and ResNet bottlenecks in `nn.Sequential`s: each is a unit by default, as a
    ModuleList's blocks are; a Sequential of bare layers (an MLP) stays in its parent's unit."""
    from distributed_training.planner import model_sizes
    from distributed_training.strategies.fsdp_units import unit_roots

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.fc = nn.LayerNorm(4), nn.Linear(4, 4)

    model = nn.Module()
    model.stem = nn.Linear(4, 4)
    model.blocks = nn.Sequential(Block(), Block(), Block())
    model.mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    model.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    assert unit_roots(model, None) == ["", "blocks.0", "blocks.1", "blocks.2", "layers.0", "layers.1"]
    assert model_sizes(model)[1] == 4 * 4 + 4 + 2 * 4  # the planner's largest block is one of them
