"""Session 50's trial findings, each test failing on the code before its fix."""

from __future__ import annotations

import collections
import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed_training.testing import run_distributed


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh())  # noqa: E731
    return nn.Sequential(nn.Linear(6, 8), block(), block(), nn.Linear(8, 3))


# ------------------------------------------------------------------ FSDP: gathered weights after a step
def _forward_without_backward(rank, world, reshard_after_forward):
    """Own loop: backward, then a forward in grad mode whose output is never backpropagated (a validation
    loss without no_grad), then the step. The parameters after every step against one process."""
    from distributed_training import FSDP

    model = _mlp()
    reference = copy.deepcopy(model)
    fsdp = FSDP(model, reshard_after_forward=reshard_after_forward)  # units: the two blocks, and the root
    assert len(fsdp._units) == 3, len(fsdp._units)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    worst = []
    for step in range(4):
        g = torch.Generator().manual_seed(100 + step)
        x, x2, y = torch.randn(4 * world, 6, generator=g), torch.randn(4 * world, 6, generator=g), \
            torch.randint(0, 3, (4 * world,), generator=g)
        mine = slice(4 * rank, 4 * rank + 4)
        opt.zero_grad()
        F.cross_entropy(fsdp(x[mine]), y[mine]).backward()
        fsdp.eval()
        F.cross_entropy(fsdp(x2[mine]), y[mine])  # logged, never backpropagated
        fsdp.train()
        opt.step()
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        full = fsdp.full_state_dict(rank0_only=False)
        worst.append(max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items()))
    return worst


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["zero3", "zero2"])
def test_fsdp_forward_without_backward_then_step_uses_the_stepped_weights(reshard_after_forward):
    """The root unit (every unit under ZeRO-2) stayed gathered after a grad-mode forward without a backward,
    and the next forward, after the optimizer's step, computed with the weights of before it: 2.3e-3 off
    one process at the second step, 5.4e-3 at the fourth (ZeRO-2: 3.0e-3, 7.0e-3)."""
    for worst in run_distributed(_forward_without_backward, 2, args=(reshard_after_forward,), timeout=120):
        assert max(worst) < 1e-6, worst


# ------------------------------------------------------------------ batches: dataclasses, namedtuples, plain objects
@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


XY = collections.namedtuple("XY", ["x", "y"])


class OwnLoss(nn.Module):
    """A model computing its loss from a batch object's fields (a dataclass), or from the two arguments a
    namedtuple's fields are unpacked into, as a tuple's are."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 2)

    def forward(self, batch, y=None):
        x, y = (batch.x, batch.y) if y is None else (batch, y)
        return F.cross_entropy(self.net(x), y)


def _batch_kinds(rank, world):
    from distributed_training import DistributedTrainer

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
    mine = slice(4 * rank, 4 * rank + 4)
    reference = OwnLoss()
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    F.cross_entropy(reference.net(x), y).backward()
    opt.step()
    out = {}
    for kind, make, accumulation in (("dataclass", Pair, 2), ("namedtuple", XY, 2)):
        trainer = DistributedTrainer(OwnLoss(), lambda ps: torch.optim.SGD(ps, lr=0.5), progress=False,
                                     gradient_accumulation_steps=accumulation)
        trainer.train_step(make(x[mine], y[mine]))
        out[kind] = max((a - b).abs().max().item() for a, b in zip(trainer.module.parameters(),
                                                                   reference.parameters()))
        trainer.close()

    class Loose:  # tensors as attributes of a plain object: nothing the trainer can find
        def __init__(self, x, y):
            self.x, self.y = x, y

    trainer = DistributedTrainer(OwnLoss(), lambda ps: torch.optim.SGD(ps, lr=0.5), progress=False)
    try:
        trainer.train_step(Loose(x[mine], y[mine]))
        out["plain object"] = "trained"
    except TypeError as err:
        out["plain object"] = str(err)
    trainer.close()
    return out


def test_dataclass_and_namedtuple_batches_train_and_a_plain_object_is_refused():
    """A dataclass batch counted as no rows, so its loss weighed nothing: 0.0 and no update at 2 ranks
    (one process moved the weights by 0.23); a namedtuple one raised "missing 1 required positional
    argument" from the trainer's own rebuild of it. Now both train as one process; an object holding its
    tensors as attributes is refused by name."""
    for out in run_distributed(_batch_kinds, 2, timeout=120):
        assert out["dataclass"] < 1e-6 and out["namedtuple"] < 1e-6, out
        assert "batch of type Loose" in out["plain object"], out["plain object"]


# ------------------------------------------------------------------ the monitor's data time
def _data_time(rank, world, log_dir):
    import time

    from torch.utils.data import TensorDataset

    from distributed_training import DistributedTrainer

    data = TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))
    trainer = DistributedTrainer(OwnLoss().net, lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False,
                                 log_dir=log_dir, log_every=1)
    trainer.fit(data, 1, F.cross_entropy, batch_size=4, log_every=1, on_step=lambda step, metrics: time.sleep(0.05))
    figures = trainer.get_performance_metrics()
    trainer.close()
    return figures["mean_data_time_s"], figures["mean_step_time_s"]


def test_data_time_is_the_fetch_not_the_steps_own_logging_and_callbacks(tmp_path):
    """`perf/data_time_s` was the time from the last step's end to the next batch: the monitor's own
    logging, the global loss's all-reduce, on_step, saves and the stop agreement counted as data loading
    (34-40% of a small step at log_every=1). A 50 ms on_step made a 50 ms "data time" here."""
    data, step = run_distributed(_data_time, 1, args=(str(tmp_path),), timeout=120)[0]
    assert step > 0.04 and data < 0.02, (data, step)  # (the sleep is the step's time, not its data's)


# ------------------------------------------------------------------ 0-dim and zero-size parameters in checkpoints
class Temperature(nn.Module):
    """A learned 0-dim temperature (CLIP's logit_scale) beside a layer, and a zero-size parameter."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.empty = nn.Parameter(torch.empty(0, 4))

    def forward(self, x):
        return self.lin(x) * self.scale.exp() + self.empty.sum()


def _adam(ps):
    return torch.optim.Adam(ps, lr=0.05)


def _odd_parameters(rank, world, directory):
    from distributed_training import FSDP, DistributedTrainer

    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(4 * world, 4, generator=g), torch.randn(4 * world, 3, generator=g)) for _ in range(3)]
    mine = slice(4 * rank, 4 * rank + 4)
    reference = Temperature()
    ref_opt = _adam(reference.parameters())
    for x, y in batches:
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
    out = {}
    for saved, loaded in (("ddp", "zero3"), ("ddp", "ddp"), ("zero3", "zero1")):
        trainer = DistributedTrainer(Temperature(), _adam, strategy=saved, progress=False)
        for x, y in batches[:2]:
            trainer.train_step((x[mine], y[mine]), F.mse_loss)
        path = f"{directory}/{saved}_{loaded}"
        trainer.save_checkpoint(path)
        trainer.close()
        trainer = DistributedTrainer(Temperature(), _adam, strategy=loaded, progress=False)
        try:
            trainer.load_checkpoint(path)
            x, y = batches[2]
            trainer.train_step((x[mine], y[mine]), F.mse_loss)
            state = trainer.full_state_dict()
            out[f"{saved} -> {loaded}"] = max((state[k] - v).abs().max().item() if v.numel() else 0.0
                                              for k, v in reference.state_dict().items()) if state else 0.0
        except Exception as err:  # (every rank fails alike here)
            out[f"{saved} -> {loaded}"] = f"{type(err).__name__}: {err}"[:300]
        trainer.close()
    # FSDP with the zero-size parameter alone in its unit: its key in full_state_dict, which loads back.
    fsdp = FSDP(Temperature(), auto_wrap_policy={nn.Linear})
    full = fsdp.full_state_dict(rank0_only=False)
    out["full_state_dict keys"] = sorted(full)
    fsdp.load_full_state_dict(full)
    return out


def test_zero_dim_and_zero_size_parameters_in_checkpoints_and_full_state_dict(tmp_path):
    """A 0-dim parameter's Adam state was saved by ddp as scalars (its shape is a step count's): ddp -> zero3
    said "no optimizer state for 'scale'" (a model of it alone: a shape error in Adam's step). A zero-size
    parameter failed every load into ddp / zero1 (ZeroDivisionError), and FSDP's full_state_dict() left it
    out where it had a unit to itself ("Missing key(s): 'empty'" at a load)."""
    out = run_distributed(_odd_parameters, 2, args=(str(tmp_path),), timeout=180)[0]
    keys = out.pop("full_state_dict keys")
    assert keys == sorted(Temperature().state_dict()), keys
    for case, worst in out.items():
        assert isinstance(worst, float) and worst < 1e-5, (case, worst)


# ------------------------------------------------------------------ a GAN's discriminator frozen for the generator's step
def _gan(rank, world, kind):
    from distributed_training import DDP, FSDP

    def nets():
        torch.manual_seed(1)
        return nn.Linear(3, 6), _mlp()[:3].append(nn.Linear(8, 1))  # generator, discriminator

    ref_g, ref_d = nets()
    gen, disc = nets()
    gen = DDP(gen)
    disc = DDP(disc) if kind == "ddp" else FSDP(disc)
    pairs = [(gen, ref_g), (disc, ref_d)]
    opts = [[torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in pair] for pair in zip(*pairs)]
    worst = 0.0
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        real, z = torch.randn(4 * world, 6, generator=g), torch.randn(4 * world, 3, generator=g)
        mine = slice(4 * rank, 4 * rank + 4)
        for (G, D, opt_g, opt_d), (r, zz) in (((gen, disc, opts[0][0], opts[0][1]), (real[mine], z[mine])),
                                             ((ref_g, ref_d, opts[1][0], opts[1][1]), (real, z))):
            opt_d.zero_grad()
            (D(G(zz).detach()).mean() - D(r).mean()).backward()
            opt_d.step()
            for p in D.parameters():  # (FSDP: its shards)
                p.requires_grad_(False)
            held = [p.grad.clone() for p in D.parameters()]
            opt_g.zero_grad()
            (-D(G(zz)).mean()).backward()
            opt_g.step()
            assert all(torch.equal(a, p.grad) for a, p in zip(held, D.parameters())), "a frozen one got a gradient"
            for p in D.parameters():
                p.requires_grad_(True)
        full = disc.full_state_dict(rank0_only=False) if kind == "fsdp" else disc.module.state_dict()
        worst = max([worst] + [(full[k] - v).abs().max().item() for k, v in ref_d.state_dict().items()]
                    + [(a - b).abs().max().item() for a, b in zip(gen.module.parameters(), ref_g.parameters())])
    return worst


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_gan_freezing_its_discriminator_for_the_generators_step_trains_as_one_process(kind):
    """`for p in D.parameters(): p.requires_grad_(False)` around the generator's step: DDP refused it at D's
    forward ("parameter '0.weight' was frozen after DDP wrapped the model"), where torch's DDP trains it;
    FSDP's shards frozen that way went on getting gradients, and so training (a shard frozen for good moved
    by up to 0.048 in 3 steps). Every parameter frozen is a pass that trains none of them now, and a frozen
    shard gets no gradient."""
    for worst in run_distributed(_gan, 2, args=(kind,), timeout=120):
        assert worst < 1e-6, worst


# ------------------------------------------------------------------ stragglers slow on a pattern
class SlowOnEvenSteps(nn.Module):
    def __init__(self, slow: bool):
        super().__init__()
        torch.manual_seed(0)
        self.net, self.slow, self.calls = nn.Linear(6, 3), slow, 0

    def forward(self, x):
        import time

        self.calls += 1
        if self.slow and self.calls % 2 == 0:
            time.sleep(0.04)
        return self.net(x)


def _periodic_straggler(rank, world, log_dir):
    import json
    from pathlib import Path

    from torch.utils.data import TensorDataset

    from distributed_training import DistributedTrainer

    data = TensorDataset(torch.randn(4 * world * 40, 6), torch.randint(0, 3, (4 * world * 40,)))
    trainer = DistributedTrainer(SlowOnEvenSteps(rank == 1), lambda ps: torch.optim.SGD(ps, lr=0.01),
                                 progress=False, log_dir=log_dir, log_every=4)
    trainer.fit(data, 1, F.cross_entropy, batch_size=4, shuffle=False)
    events = trainer.get_performance_metrics()["straggler_events"]
    trainer.close()
    lines = [json.loads(line) for line in next(Path(log_dir).glob("rank_0*/metrics.jsonl")).read_text().splitlines()]
    named = [int(j["cluster/slowest_rank"]) for j in lines if j.get("cluster/straggler")]
    return events, named


def test_a_rank_slow_on_every_other_step_is_found(tmp_path):
    """The straggler check measured the first step of each log window only: a rank sleeping 30 ms on every
    even step, with windows of 4, was never measured slow (0 of 15 windows flagged), and the cluster view
    named the healthy rank as the slowest. The measured step is drawn in each window now."""
    events, named = run_distributed(_periodic_straggler, 2, args=(str(tmp_path),), timeout=120)[0]
    # (about half the windows draw an even step; a loaded machine's noise may flag another once)
    assert events >= 2 and named.count(1) >= 2 and named.count(1) > named.count(0), (events, named)


# ------------------------------------------------------------------ warnings recorded by the caller
def _recorded_warnings(rank, world):
    import warnings

    from distributed_training import DistributedTrainer

    def batches():
        g = torch.Generator().manual_seed(0)
        return ((torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3))

    said = []
    for _ in range(2):  # the first trainer of the process built inside the block, then another
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = DistributedTrainer(nn.Linear(6, 3), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False)
            trainer.fit(batches(), 2, F.cross_entropy)  # a generator is used up after one epoch: warned
            trainer.close()
        said.append([str(w.message) for w in caught if "used up" in str(w.message)])
    return said


def test_package_warnings_reach_a_catch_warnings_block_the_first_trainer_was_built_in():
    """The package routes its warnings to its logger by replacing warnings.showwarning; installed inside
    a `catch_warnings(record=True)` block (the process's first trainer built there), it took the block's
    warnings from it: the first block recorded nothing, the second (a trainer existed) the warning."""
    first, second = run_distributed(_recorded_warnings, 1, timeout=120)[0]
    assert len(first) == 1 and len(second) == 1, (first, second)


class SlowLinear(nn.Linear):
    def forward(self, x):
        import time

        time.sleep(0.02)
        return super().forward(x)


def _slow_stage(rank, world, log_dir):
    import json
    from pathlib import Path

    from torch.utils.data import TensorDataset

    from distributed_training import DistributedTrainer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), SlowLinear(32, 4))
    data = TensorDataset(torch.randn(8 * 15, 16), torch.randn(8 * 15, 4))
    trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.05), pipeline_parallel_size=2,
                                 microbatches=2, log_dir=log_dir, log_every=3, progress=False)
    trainer.fit(data, 1, F.mse_loss, batch_size=8, shuffle=False)
    trainer.close()
    lines = [json.loads(line) for line in next(Path(log_dir).glob("rank_0*/metrics.jsonl")).read_text().splitlines()]
    return [int(j["cluster/slowest_rank"]) for j in lines if "cluster/slowest_rank" in j]


def test_under_a_pipeline_a_stages_own_work_is_its_compute(tmp_path):
    """A pipeline step reports no communication, so its waits for the other stage counted as own work, alike
    on both ranks: a stage sleeping 30 ms a micro-batch was never named (ratio 1.00-1.03), and the cluster
    view called the other rank the slowest in 4 of 10 windows."""
    slowest = run_distributed(_slow_stage, 2, args=(str(tmp_path),), timeout=120)[0]
    assert len(slowest) >= 3 and set(slowest) == {1}, slowest


# ------------------------------------------------------------------ accumulation beside an empty replica
class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net, self.rows = nn.Linear(4, 2), []

    def forward(self, x):
        self.rows.append(x.shape[0])
        return self.net(x)


def _beside_an_empty_replica(rank, world):
    from distributed_training import DistributedTrainer

    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
    reference = Counting()
    opt = torch.optim.SGD(reference.net.parameters(), lr=0.5)
    F.mse_loss(reference(x), y).backward()
    opt.step()
    model = Counting()
    trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.5), strategy="zero3", progress=False,
                                 gradient_accumulation_steps=2)
    mine = slice(0, 4) if rank == 0 else slice(0, 0)  # rank 1 has no rows this step
    trainer.train_step((x[mine], y[mine]), F.mse_loss)
    state = trainer.full_state_dict()
    trainer.close()
    worst = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items()) if state else 0.0
    return model.rows, worst


def test_accumulation_beside_an_empty_replica_keeps_its_micro_batches():
    """Under ZeRO-2/3 (a gather in every forward) the replicas agree on how many micro-batches to run; one
    with no rows made every replica run its whole batch in one forward, the memory accumulation bounds."""
    (rows0, worst), (rows1, _) = run_distributed(_beside_an_empty_replica, 2, timeout=120)
    assert rows0 == [2, 2] and rows1 == [0, 0] and worst < 1e-6, (rows0, rows1, worst)


# ------------------------------------------------------------------ optimizers that are not per element
class RowScaled(torch.optim.Optimizer):
    """An optimizer of one's own: a row-wise second moment for matrices, one for a whole vector."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    v = p.grad.pow(2).mean(dim=-1, keepdim=True) if p.dim() > 1 else p.grad.pow(2).mean()
                    p.add_(p.grad / (v.sqrt() + 1e-8), alpha=-group["lr"])


def _optimizer_kinds(rank, world):
    import warnings

    from distributed_training import DistributedTrainer

    said = {}
    for strategy, make in (("zero3", RowScaled), ("ddp", RowScaled), ("zero1", lambda ps: torch.optim.AdamW(ps)),
                           ("zero3", lambda ps: torch.optim.LBFGS(ps))):
        key = f"{strategy} {make.__name__ if isinstance(make, type) else 'adamw' if strategy == 'zero1' else 'lbfgs'}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                DistributedTrainer(_mlp(), make, strategy=strategy, progress=False).close()
                said[key] = [str(w.message) for w in caught if "shape or whole norm" in str(w.message)]
            except ValueError as err:
                said[key] = f"refused: {err}"
    return said


def test_an_optimizer_that_is_not_per_element_is_found_by_what_it_does():
    """A row-wise optimizer of one's own ran another algorithm under ZeRO (7e-2 off one process in 5 steps)
    without a word: only names (adafactor, lamb, ...) were warned of. It is tried on two tensors against their
    concatenation now. LBFGS, whose step needs a closure the trainer never passes, is refused at the start."""
    said = run_distributed(_optimizer_kinds, 2, timeout=120)[0]
    assert len(said["zero3 RowScaled"]) == 1 and "RowScaled" in said["zero3 RowScaled"][0], said
    assert said["ddp RowScaled"] == [] and said["zero1 adamw"] == [], said
    assert said["zero3 lbfgs"].startswith("refused: optimizer LBFGS's step needs a closure"), said


# ------------------------------------------------------------------ an optimizer over part of the model, with clipping
def _partial_optimizer(rank, world):
    from distributed_training import DistributedTrainer

    model, reference = _mlp(), _mlp()
    trainer = DistributedTrainer(model, torch.optim.SGD(model[0].parameters(), lr=0.1), gradient_clip_val=0.5,
                                 progress=False)
    ref_opt = torch.optim.SGD(reference[0].parameters(), lr=0.1)
    worst = []
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * world, 6, generator=g), torch.randint(0, 3, (4 * world,), generator=g)
        metrics = trainer.train_step((x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]), F.cross_entropy)
        reference.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        worst.append((abs(float(metrics["grad_norm"]) - norm.item()),
                      max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))))
    trainer.close()
    return worst


def test_an_optimizer_over_part_of_the_model_with_clipping_matches_one_process():
    """An optimizer object over the first layer alone ("frozen by leaving out"): its zero_grad reached only
    its own parameters, so the others' gradients grew step after step and the clipping norm counted them
    (0.64 for a step whose gradients' norm was 0.46): the trained layer went 4.4e-3 off one process."""
    for worst in run_distributed(_partial_optimizer, 2, timeout=120):
        assert max(n for n, _ in worst) < 1e-5 and max(p for _, p in worst) < 1e-6, worst


# ------------------------------------------------------------------ compile= with activation checkpointing
class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.bn, self.head = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


def _compiled_and_checkpointed(rank, world):
    from distributed_training import DistributedTrainer

    out = {}
    for name, make, shape, checkpointed in (("mlp", _mlp, (6,), {nn.Linear}), ("cnn", SmallCNN, (3, 8, 8), {nn.BatchNorm2d})):
        runs = []
        for compile in (False, {"backend": "aot_eager"}):
            torch._dynamo.reset()
            trainer = DistributedTrainer(make(), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), progress=False,
                                         activation_checkpointing=checkpointed, compile=compile)
            for step in range(2):
                g = torch.Generator().manual_seed(step)
                x, y = torch.randn(4 * world, *shape, generator=g), torch.randint(0, 3, (4 * world,), generator=g)
                trainer.train_step((x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]), F.cross_entropy)
            runs.append({k: v.clone() for k, v in trainer.module.state_dict().items()})
            trainer.close()
        out[name] = max((runs[0][k].float() - runs[1][k].float()).abs().max().item() for k in runs[0])
    return out


def test_compile_with_activation_checkpointing_trains_as_eager():
    """`compile=` with `activation_checkpointing=` failed at the first step under every strategy ("checkpoint
    not implemented for ... context_fn"): the checkpoint's context that puts BatchNorm's running statistics
    back is passed only where there are some, and such a module runs eagerly between the compiled graphs."""
    for out in run_distributed(_compiled_and_checkpointed, 2, timeout=180):
        assert out["mlp"] < 1e-6 and out["cnn"] < 1e-6, out
