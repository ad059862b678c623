"""Session 39's findings, each test failing on the code before its fix."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from distributed_training.testing import run_distributed


def _record(trainer, ref, diffs) -> None:
    """The largest difference between the trainer's full weights and one process's (`ref`), into `diffs`
    (on the rank that holds them)."""
    state = trainer.full_state_dict()
    if state:
        diffs.append(max((state[k].cpu() - v).abs().max().item() for k, v in ref.state_dict().items()))


class _Adapted(torch.nn.Module):
    """A frozen base with a trainable adapter that can be switched off (as PEFT's LoRA)."""

    def __init__(self) -> None:
        super().__init__()
        self.base, self.adapter = torch.nn.Linear(6, 4), torch.nn.Linear(6, 4)
        self.base.requires_grad_(False)
        self.adapter_on = True

    def forward(self, x):
        return self.base(x) + (self.adapter(x) if self.adapter_on else 0)


def _reference_pass_steps(model, net, optimizer, xs, rank, world):
    """Steps of a DPO-like loop: a reference forward with the adapter switched off (PEFT's
    ``disable_adapter()``, which sets its flags to False and back) under no_grad, then a training one."""
    n = xs[0].shape[0] // world
    for x in xs:
        mine = x[rank * n:(rank + 1) * n]
        with torch.no_grad():
            net.adapter_on = False
            net.adapter.requires_grad_(False)
            reference = model(mine)
            net.adapter.requires_grad_(True)
            net.adapter_on = True
        (model(mine) - reference - 1).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        yield


def reference_pass_worker(rank, world, strategy):
    from distributed_training import DistributedTrainer

    torch.manual_seed(0)
    net, ref = _Adapted(), _Adapted()
    ref.load_state_dict(net.state_dict())
    trainer = DistributedTrainer(net, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), strategy=strategy,
                                 progress=False)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 6, generator=g) for _ in range(3)]
    ref_steps = _reference_pass_steps(ref, ref, torch.optim.SGD(ref.adapter.parameters(), lr=0.1, momentum=0.9),
                                      xs, 0, 1)
    diffs = []
    for _ in _reference_pass_steps(trainer.model, net, trainer.optimizer, xs, rank, world):
        next(ref_steps)
        _record(trainer, ref, diffs)
    trainer.close()
    return diffs


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_a_reference_pass_with_an_adapter_switched_off_under_no_grad(strategy):
    # DDP's flag check ran on forwards under no_grad too ("parameter 'adapter.weight' was frozen after DDP
    # wrapped the model"); ZeRO-2/3's requires_grad_ raised at the call itself.
    diffs = run_distributed(reference_pass_worker, 2, args=(strategy,), timeout=90)[0]
    assert len(diffs) == 3 and max(diffs) < 1e-6, diffs


class _Tagged(torch.nn.Linear):
    """A model whose inputs carry the file they came from (dict inputs: ``model(x=..., path=...)``)."""

    def forward(self, x, path=None):
        return super().forward(x)


def node_local_samples_worker(rank, world, kind):
    """One dataset on every rank, its samples carrying what may differ between nodes without the data
    differing: a path of the node's own, or the last bits of a standardisation computed another way."""
    import warnings

    import torch.nn.functional as F

    from distributed_training import DistributedTrainer

    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    if kind == "noise":  # (another thread count or instruction set: the last bits differ)
        x = x * (1 + 1e-7 * rank)
    elif kind == "different":
        x = torch.randn(32, 4, generator=torch.Generator().manual_seed(rank))

    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            return {"x": x[i], "path": f"/mnt/node{rank}/data/{i:05d}.pt"}, i % 2

    torch.manual_seed(0)
    trainer = DistributedTrainer(_Tagged(4, 2), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Samples(), 1, F.cross_entropy, batch_size=4)
    trainer.close()
    return [str(w.message) for w in caught if "differs across ranks" in str(w.message)]


@pytest.mark.parametrize("kind", ["paths", "noise", "different"])
def test_the_first_sample_check_ignores_node_paths_and_last_bit_noise(kind):
    # Both warned "each rank trains on 1/2 of its own": strings were hashed, floats compared bit for bit.
    said = run_distributed(node_local_samples_worker, 2, args=(kind,), timeout=90)
    for messages in said:
        assert bool(messages) == (kind == "different"), (kind, messages)


def test_the_first_sample_fingerprint_copies_no_whole_permuted_volume():
    # reshape(-1) before the slice copied the whole tensor, twice: 2.9-9.7 s and +518 MiB at 512^3.
    from distributed_training.sample_fingerprint import HEAD_BYTES, _head, first_sample_fingerprint

    volume = torch.randn(64, 64, 128).permute(2, 1, 0)  # 2 MiB, not contiguous
    head = _head(volume, HEAD_BYTES // 4)
    assert head.numel() == HEAD_BYTES // 4 and head.untyped_storage().data_ptr() == volume.untyped_storage().data_ptr()
    assert torch.equal(head, volume[:64])
    same, other = first_sample_fingerprint([(volume, 0)]), first_sample_fingerprint([(volume.flip(0), 0)])
    assert same is not None and other is not None and not same.matches(other)


class _OwnStepSize(torch.optim.SGD):
    """Keeps a value of its own in its param groups, from the shard it steps (as Prodigy's `d`), and an
    unset setting as NaN."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        for group in self.param_groups:
            group["clip"], group["d"] = float("nan"), 1.0

    def step(self, closure=None):
        for group in self.param_groups:
            group["d"] = 1.0 + sum(float(p.detach().abs().sum()) for p in group["params"])
        return super().step(closure)


def optimizer_values_worker(rank, world, strategy):
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from distributed_training import DistributedTrainer

    torch.manual_seed(0)
    trainer = DistributedTrainer(torch.nn.Linear(4, 2), lambda ps: _OwnStepSize(ps, lr=0.01), strategy=strategy,
                                 progress=False)
    data = TensorDataset(torch.randn(32, 4, generator=torch.Generator().manual_seed(0)), torch.arange(32) % 2)
    try:
        for _ in range(2):  # a second fit, after the shards' own values differ
            trainer.fit(data, 1, F.cross_entropy, batch_size=4)
        return "trained"
    except ValueError as err:
        return str(err)
    finally:
        trainer.close()


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_optimizer_values_of_its_own_and_nan_settings_are_not_refused(strategy):
    # "the optimizer's clip differs across ranks: rank 0 has nan, rank 0 has nan"; and a second fit refused
    # the values a Prodigy-like optimizer keeps per shard.
    assert run_distributed(optimizer_values_worker, 2, args=(strategy,), timeout=90) == ["trained"] * 2


@pytest.mark.parametrize("rank,local,speaks", [(0, 0, True), (2, 0, True), (3, 1, False), (1, None, False)])
def test_a_config_error_is_said_on_every_node(monkeypatch, rank, local, speaks):
    # Only rank 0 said it: the other node's log showed only its launcher's lost rendezvous.
    from distributed_training import cli

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("RANK", str(rank))
    if local is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", str(local))
    said = []
    monkeypatch.setattr(cli.log, "error", said.append)
    cli._report_once("dtrain: invalid config: training.lr differs across ranks")
    assert said == (["dtrain: invalid config: training.lr differs across ranks"] if speaks else []), said


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor


class _DataclassHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 4)

    def forward(self, x):
        return _Out(self.proj(x))


def _dataclass_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), _DataclassHead())


def _on_logits(out, y):
    import torch.nn.functional as F

    return F.cross_entropy(out.logits, y)


def dataclass_unit_worker(rank, world, pipeline):
    import copy

    from distributed_training import DistributedTrainer
    from distributed_training.strategies.fsdp_strategy import FSDPStrategy

    base = _dataclass_model()
    ref = copy.deepcopy(base)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    if pipeline:  # (the pipeline makes every layer of the chain a unit)
        trainer = DistributedTrainer(copy.deepcopy(base), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                     strategy="zero3", pipeline_parallel_size=2, microbatches=2, progress=False)
    else:
        strategy = FSDPStrategy(auto_wrap_policy=lambda m, *a, **k: isinstance(m, _DataclassHead))
        trainer = DistributedTrainer(copy.deepcopy(base), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                     strategy=strategy, progress=False)
    g = torch.Generator().manual_seed(1)
    diffs = []
    for _ in range(3):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        mine = slice(None) if pipeline else slice(4 * rank, 4 * rank + 4)
        trainer.train_step((x[mine], y[mine]), _on_logits)
        _on_logits(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        _record(trainer, ref, diffs)
    trainer.close()
    return diffs


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_unit_returning_a_dataclass_is_gathered_again_for_its_backward(pipeline):
    # "setStorage: ... out of bounds for storage of size 0": the unit's output hook did not open the dataclass,
    # so its weights, freed after the forward, were not gathered for its backward.
    diffs = run_distributed(dataclass_unit_worker, 2, args=(pipeline,), timeout=120)[0]
    assert len(diffs) == 3 and max(diffs) < 1e-6, diffs


class _HalfwayFailure(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
        self.fail = False

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.out(_BoomInBackward.apply(h) if self.fail else h)  # the head's gradient comes first


def failed_train_step_worker(rank, world, strategy):
    import torch.nn.functional as F

    from distributed_training import DistributedTrainer

    torch.manual_seed(0)
    net, ref = _HalfwayFailure(), _HalfwayFailure()
    ref.load_state_dict(net.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    trainer = DistributedTrainer(net, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), strategy=strategy,
                                 progress=False)
    g = torch.Generator().manual_seed(2)
    diffs = []
    for step in range(3):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        net.fail = step == 1
        try:
            trainer.train_step((x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]), F.mse_loss)
        except ValueError:
            pass  # the batch skipped
        if step != 1:
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        _record(trainer, ref, diffs)
    trainer.close()
    return diffs


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero3"])
def test_a_train_step_that_raised_leaves_no_gradient_behind(strategy):
    # DDP and ZeRO-1 added the failed backward's head gradients to the next step's (1.7e-2 off one process).
    diffs = run_distributed(failed_train_step_worker, 2, args=(strategy,), timeout=120)[0]
    assert len(diffs) == 3 and max(diffs) < 1e-6, diffs


def evaluate_names_worker(rank, world):
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from distributed_training import DistributedTrainer

    torch.manual_seed(0)
    trainer = DistributedTrainer(torch.nn.Linear(4, 3), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False)
    data = TensorDataset(torch.randn(12, 4, generator=torch.Generator().manual_seed(0)), torch.arange(12) % 3)
    results = [trainer.evaluate(data, F.cross_entropy, batch_size=4, metrics=m) for m in ("auto", ["accuracy"])]
    trainer.close()
    return results


def test_evaluate_takes_metric_names_and_auto_as_fit_does():
    # AttributeError: 'str' object has no attribute 'values' (fit's eval_metrics took them).
    auto, named = run_distributed(evaluate_names_worker, 2, timeout=90)[0]
    assert set(auto) == {"loss", "accuracy", "top5"} and auto["top5"] == 1.0, auto
    assert set(named) == {"loss", "accuracy"} and named["accuracy"] == auto["accuracy"], named


class _ReentrantBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return x + checkpoint(self.inner, x, use_reentrant=True)


def _zb_model(variant):
    from torch import nn

    torch.manual_seed(0)
    if variant == "reentrant":
        return nn.Sequential(nn.Linear(8, 16), _ReentrantBlock(), _ReentrantBlock(), nn.Linear(16, 4))
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    if variant == "patched":  # an instance forward of the user's own (a logging wrapper, say)
        layer = model[2]
        model[2].forward = lambda x: torch.nn.Linear.forward(layer, x)
    return model


def zbh1_variant_worker(rank, world, strategy, variant):
    import torch.nn.functional as F

    from distributed_training import DistributedTrainer

    base = _zb_model(variant)
    ref = _zb_model(variant)
    ref.load_state_dict(base.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    chosen = {"checkpointed": ("2", "6")}.get(variant, ())
    trainer = DistributedTrainer(base, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), strategy=strategy,
                                 pipeline_parallel_size=2, pipeline_schedule="zbh1", microbatches=2, progress=False,
                                 activation_checkpointing=(lambda m, name: name in chosen) if chosen else None)
    g = torch.Generator().manual_seed(1)
    diffs = []
    for _ in range(3):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        trainer.train_step((x, y), F.mse_loss)
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        _record(trainer, ref, diffs)
    trainer.close()
    return diffs


@pytest.mark.parametrize("strategy,variant", [("ddp", "checkpointed"), ("zero1", "checkpointed"), ("ddp", "patched"),
                                              ("ddp", "reentrant"), ("zero1", "reentrant")])
def test_zbh1_trains_layers_with_forwards_of_their_own_as_one_process(strategy, variant):
    # Linear layers given an instance forward (the trainer's activation checkpointing of some of them, a
    # user's patch) were planned as captured but never recorded: their gradients were lost (2e-3 to 9e-3
    # off, the weights never moved). A reentrant checkpoint in a stage failed the step ("incompatible with
    # .grad() or passing an inputs parameter").
    diffs = run_distributed(zbh1_variant_worker, 2, args=(strategy, variant), timeout=120)[0]
    assert len(diffs) == 3 and max(diffs) < 1e-6, diffs


class _BoomInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("a failure in a stage's backward")


class _Bomb(torch.nn.Module):
    """Raises in its forward or backward of the second microbatch of an armed step."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.armed, self.where, self.calls = False, "forward", 0

    def forward(self, x):
        x = self.lin(x)
        if self.armed:
            self.calls += 1
            if self.calls == 2:
                if self.where == "forward":
                    raise ValueError("a failure in a stage's forward")
                x = _BoomInBackward.apply(x)
        return x


def _bomb_model():
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), _Bomb(), nn.Tanh(),
                         nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def pipeline_retry_worker(rank, world, pipeline, schedule, where, strategy="ddp", failed_step=1):
    """`pipeline` 1: no pipeline, the batch in two micro-batches (gradient accumulation)."""
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from distributed_training import DistributedTrainer

    net, ref = _bomb_model(), _bomb_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    shape = (dict(pipeline_parallel_size=pipeline, pipeline_schedule=schedule, microbatches=4) if pipeline > 1
             else dict(gradient_accumulation_steps=2))
    trainer = DistributedTrainer(net, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), progress=False,
                                 strategy=strategy, **shape)
    dp, replica = trainer.dp_world_size, trainer.dp_rank
    g = torch.Generator().manual_seed(3)
    said, diffs = [], []
    for step in range(4):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
        bomb = net[5]
        bomb.armed, bomb.where, bomb.calls = step == failed_step, where, 0
        n = 16 // dp
        try:
            trainer.train_step((x[replica * n:(replica + 1) * n], y[replica * n:(replica + 1) * n]), F.mse_loss)
        except Exception as err:  # noqa: BLE001 - every rank skips the batch
            said.append(type(err).__name__)
        if step != failed_step:
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        _record(trainer, ref, diffs)
    data = TensorDataset(torch.randn(12, 8, generator=g), torch.randn(12, 2, generator=g))
    evaluated = trainer.evaluate(data, F.mse_loss, batch_size=4)["loss"]
    trainer.close()
    return said, diffs, abs(evaluated - sum(F.mse_loss(ref(data.tensors[0][i:i + 4]), data.tensors[1][i:i + 4]).item()
                                           for i in range(0, 12, 4)) / 3)


@pytest.mark.parametrize("world,pipeline,schedule,where,strategy", [
    (2, 2, "1f1b", "forward", "ddp"), (2, 2, "zbh1", "backward", "ddp"), (4, 4, "gpipe", "backward", "ddp"),
    (4, 2, "1f1b", "backward", "ddp"), (4, 2, "interleaved_1f1b", "forward", "ddp"),
    (2, 2, "1f1b", "forward", "zero3"), (4, 2, "1f1b", "backward", "zero3"), (2, 2, "gpipe", "backward", "zero2")])
def test_a_pipeline_trains_on_after_a_failed_step_every_rank_caught(world, pipeline, schedule, where, strategy):
    # Every later step raised PipelineAborted (the failed step's stop messages were read as new ones) and
    # full_state_dict() ended in PeerFailureError: the next step now receives what the failed one left in
    # flight first, and a stop heard from a peer is not adopted as that peer's failure on the retry. Under
    # ZeRO-2/3 the stages' full gradients of the failed step were reduced into the next one (a review).
    results = run_distributed(pipeline_retry_worker, world, args=(pipeline, schedule, where, strategy), timeout=150)
    for said, diffs, evaluated in results:
        assert len(said) == 1 and evaluated < 1e-6, (said, evaluated)
    said, diffs, _ = results[0]
    assert len(diffs) == 4 and max(diffs) < 1e-6, diffs


class _Unused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.extra = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)  # `extra`: never used

    def forward(self, x):
        return self.lin(x)


def _unused_model():
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), _Unused(), nn.Tanh(), nn.Linear(8, 2))


def unused_in_stage_worker(rank, world, strategy):
    import torch.nn.functional as F

    from distributed_training import DistributedTrainer
    from distributed_training.strategies.ddp_strategy import DDPStrategy

    net, ref = _unused_model(), _unused_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    chosen = DDPStrategy(find_unused_parameters=True) if strategy == "ddp_find_unused" else strategy
    trainer = DistributedTrainer(net, lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1), strategy=chosen,
                                 pipeline_parallel_size=2, microbatches=2, progress=False)
    dp, replica = trainer.dp_world_size, trainer.dp_rank
    g = torch.Generator().manual_seed(4)
    diffs = []
    try:
        for _ in range(3):
            x, y = torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g)
            n = 8 // dp
            trainer.train_step((x[replica * n:(replica + 1) * n], y[replica * n:(replica + 1) * n]), F.mse_loss)
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            _record(trainer, ref, diffs)
    except RuntimeError as err:
        return str(err)
    finally:
        trainer.close()
    return diffs


@pytest.mark.parametrize("world,strategy", [(2, "zero1"), (4, "ddp"), (4, "ddp_find_unused")])
def test_a_parameter_no_rank_uses_in_a_stage_is_named_or_left_alone(world, strategy):
    # DDP / ZeRO-1 inside the stages averaged zeros into it at a data-parallel size above one (AdamW's weight
    # decay moved it, 5.3e-6), silently, where P = 1 raised and one process leaves it alone.
    results = run_distributed(unused_in_stage_worker, world, args=(strategy,), timeout=150)
    if strategy == "ddp_find_unused":
        assert len(results[0]) == 3 and max(results[0]) < 1e-6, results[0]
    else:
        said = next(r for r in results if isinstance(r, str) and "no gradient" in r)
        assert "received no gradient on any rank of the data-parallel group" in said and "extra.weight" in said, said


def pipeline_freeze_worker(rank, world):
    import torch.nn.functional as F

    from distributed_training import DistributedTrainer

    net = _bomb_model()
    trainer = DistributedTrainer(net, lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="zero3",
                                 pipeline_parallel_size=2, microbatches=2, progress=False)
    net[0].requires_grad_(False)  # stage 0's first layer, and the head on the last stage
    net[9].requires_grad_(False)
    try:
        trainer.train_step((torch.randn(8, 8), torch.randn(8, 2)), F.mse_loss)
        return "trained"
    except RuntimeError as err:
        return str(err)
    finally:
        trainer.close(barrier=False)


def test_requires_grad_under_sharded_pipeline_stages_is_refused_at_the_step():
    # Recorded, not applied, the call was checked only in the wrapper's forward, which stages never run:
    # the "frozen" layers trained on, silently (a review).
    for said in run_distributed(pipeline_freeze_worker, 2, timeout=90):
        assert "requires_grad_(False) was called after FSDP wrapped the model" in said, said
