"""DistributedTrainer: accumulation, clipping, fit, evaluate and checkpoints against one process."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from distributed_training import DistributedTrainer, DDPStrategy
from distributed_training.data import ShardedSampler
from distributed_training.testing import run_distributed

from _models import MLP

TOL = 1e-5


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _dataset(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g))


def _max_param_diff(a, b) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


# --------------------------------------------------------- train_step parity
def train_step_worker(rank, world, accumulation, clip):
    torch.manual_seed(0)
    base = MLP()
    trainer = DistributedTrainer(copy.deepcopy(base), _sgd, gradient_accumulation_steps=accumulation,
                                 gradient_clip_val=clip)
    reference = copy.deepcopy(base)
    opt = _sgd(reference.parameters())
    per_rank = 6  # splits unevenly into 4 micro-batches, and into 6 (not 8) when 8 are asked for
    worst, norms = 0.0, []
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(per_rank * world, 16, generator=g), torch.randn(per_rank * world, 4, generator=g)
        sl = slice(rank * per_rank, (rank + 1) * per_rank)
        metrics = trainer.train_step((x[sl], y[sl]), F.mse_loss)
        F.mse_loss(reference(x), y).backward()
        if clip is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            norms.append((float(metrics["grad_norm"]), float(ref_norm)))
        opt.step()
        opt.zero_grad()
        worst = max(worst, _max_param_diff(trainer.module, reference))
    trainer.close()
    return worst, norms


@pytest.mark.parametrize("world, accumulation, clip", [(2, 1, None), (3, 4, 0.05), (1, 3, 0.05), (2, 8, None)])
def test_train_step_matches_single_process(world, accumulation, clip):
    for worst, norms in run_distributed(train_step_worker, world, args=(accumulation, clip), timeout=120):
        assert worst <= TOL, worst
        for ours, ref in norms:
            assert abs(ours - ref) <= 1e-5 * max(1.0, ref), norms
        if clip is not None:
            assert any(ref > clip for _, ref in norms), "the clip threshold must actually clip"


# ------------------------------------------------------------------ sampler
def test_sharded_sampler_distinct_and_reshuffled():
    data = range(23)
    world = 3
    samplers = [ShardedSampler(data, world, r, seed=7) for r in range(world)]
    epochs = []
    for epoch in range(2):
        shards = []
        for s in samplers:
            s.set_epoch(epoch)
            shards.append(list(s))
        assert len({len(x) for x in shards}) == 1, "every rank must run the same number of samples"
        flat = [i for shard in shards for i in shard]
        assert set(flat) == set(data), "every sample is seen"
        assert len(flat) - len(set(flat)) == (-len(data)) % world, "only the padding repeats"
        epochs.append(shards)
    assert epochs[0] != epochs[1], "each epoch reshuffles"
    exact = [list(ShardedSampler(data, world, r, shuffle=False, pad=False)) for r in range(world)]
    assert sorted(i for shard in exact for i in shard) == list(data)
    dropped = [list(ShardedSampler(data, world, r, drop_last=True)) for r in range(world)]
    assert sum(len(d) for d in dropped) == 21 and len({i for d in dropped for i in d}) == 21
    with pytest.raises(ValueError, match="rank"):
        ShardedSampler(data, 2, 2)


# ---------------------------------------------------------------- fit + evaluate
def fit_worker(rank, world):
    torch.manual_seed(0)
    base = MLP()
    dataset = _dataset(22)
    trainer = DistributedTrainer(copy.deepcopy(base), _sgd, seed=3)
    history = trainer.fit(dataset, epochs=2, criterion=F.mse_loss, batch_size=3)

    # The same steps in one process: at each step, the next 3 x W samples of the epoch's permutation (the
    # last step the 22 % (3 x W) left, which the replicas hold unevenly at W = 3: 2, 1 and 1).
    reference = copy.deepcopy(base)
    opt = _sgd(reference.parameters())
    for epoch in range(2):
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(3 + epoch))
        for start in range(0, len(order), 3 * world):
            x, y = dataset[order[start:start + 3 * world]]
            loss = F.mse_loss(reference(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    fit_diff = _max_param_diff(trainer.module, reference)

    eval_set = _dataset(31, seed=1)  # 31 does not divide by 2, 3 or 4: shards are uneven
    ours = trainer.evaluate(eval_set, F.mse_loss, batch_size=4, metrics={"mae": F.l1_loss})
    with torch.no_grad():
        x, y = eval_set.tensors
        out = reference(x)
        expected = {"loss": F.mse_loss(out, y).item(), "mae": F.l1_loss(out, y).item()}
    trainer.close()
    return fit_diff, history, ours, expected


@pytest.mark.parametrize("world", [2, 3])
def test_fit_and_evaluate_match_single_process(world):
    for fit_diff, history, ours, expected in run_distributed(fit_worker, world, timeout=120):
        assert fit_diff <= TOL, fit_diff
        assert [h["epoch"] for h in history] == [0, 1]
        assert history[0]["steps"] == -(-(-(-22 // world)) // 3)
        for key in ("loss", "mae"):
            assert abs(ours[key] - expected[key]) <= 1e-5, (ours, expected)


# ------------------------------------------------------------------ checkpoints
def checkpoint_worker(rank, world, path):
    torch.manual_seed(0)
    trainer = DistributedTrainer(MLP(), _sgd, strategy=DDPStrategy(bucket_cap_mb=0.001))
    batches = []
    for step in range(6):
        g = torch.Generator().manual_seed(100 * rank + step)
        batches.append((torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)))
    for b in batches[:3]:
        trainer.train_step(b, F.mse_loss)
    trainer.save_checkpoint(path)
    for b in batches[3:]:
        trainer.train_step(b, F.mse_loss)
    uninterrupted = [p.detach().clone() for p in trainer.module.parameters()]

    torch.manual_seed(1)  # a different initialisation: everything must come from the file
    resumed = DistributedTrainer(MLP(), _sgd)
    resumed.load_checkpoint(path)
    assert resumed.step == 3
    for b in batches[3:]:
        resumed.train_step(b, F.mse_loss)
    exact = all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed.module.parameters()))

    errors = {}
    try:
        resumed.load_checkpoint(path + ".missing")
    except FileNotFoundError as err:
        errors["missing"] = str(err)
    other = DistributedTrainer(torch.nn.Linear(16, 4), _sgd)
    try:
        other.load_checkpoint(path)
    except ValueError as err:
        errors["other_model"] = str(err)
    for t in (trainer, resumed, other):
        t.close()
    return exact, errors, sorted(os.listdir(path))


def test_checkpoint_resume_is_exact(tmp_path):
    path = str(tmp_path / "ckpt" / "last")
    for exact, errors, files in run_distributed(checkpoint_worker, 2, args=(path,), timeout=120):
        assert exact, "resumed training must equal uninterrupted training bit for bit"
        assert "last.missing" in errors["missing"]
        assert "fc1.weight" in errors["other_model"] and "last" in errors["other_model"]
        assert files == ["meta.pt", "meta.pt.sha256", "rank0.pt", "rank1.pt"], files  # no temporary file left behind


# ------------------------------------------------------------------ monitoring
def monitored_fit_worker(rank, world, log_dir):
    torch.manual_seed(0)
    trainer = DistributedTrainer(MLP(), _sgd, log_dir=log_dir, log_every=2, progress=False)
    trainer.fit(_dataset(24), epochs=2, criterion=F.mse_loss, batch_size=3)
    summary = trainer.get_performance_metrics()
    trainer.close()
    return summary


def test_fit_writes_per_rank_metrics(tmp_path):
    import json

    summaries = run_distributed(monitored_fit_worker, 2, args=(str(tmp_path),), timeout=120)
    for rank, summary in enumerate(summaries):
        lines = [json.loads(l) for l in (tmp_path / f"rank_{rank}" / "metrics.jsonl").read_text().splitlines()]
        assert [l["step"] for l in lines] == [2, 4, 6, 8], lines
        assert all("train/loss" in l and "perf/samples_per_s" in l and "perf/comm_time_s" in l for l in lines), lines[0]
        assert all(0 <= l["perf/comm_hidden_pct"] <= 100 and l["perf/comm_wire_ms"] > 0 for l in lines), lines[0]
        assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / f"rank_{rank}"))
        assert summary["steps"] == 8 and summary["samples_per_s_per_gpu"] > 0
        assert summary["communication_overhead_pct"] is not None
    assert any("cluster/step_time_max_s" in json.loads(l) for l in (tmp_path / "rank_0" / "metrics.jsonl").read_text().splitlines())


def evaluate_sharded_world_of_one_worker(rank, world, strategy):
    """evaluate() under a sharded strategy in a world of one: the parameters live in the wrapper's
    shards, so the bare module must not be called."""
    torch.manual_seed(0)
    model = MLP()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(24, 16, generator=g), torch.randint(0, 4, (24,), generator=g))
    trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), strategy=strategy)
    trainer.fit(data, epochs=1, criterion=F.cross_entropy, batch_size=8)
    got = trainer.evaluate(data, F.cross_entropy, batch_size=8)["loss"]
    reference = MLP()
    reference.load_state_dict(trainer.strategy.model_state_dict(trainer.model))
    with torch.no_grad():
        want = F.cross_entropy(reference(data.tensors[0]), data.tensors[1]).item()
    trainer.close()
    return got, want


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_evaluate_under_a_sharded_strategy_in_a_world_of_one(strategy):
    got, want = run_distributed(evaluate_sharded_world_of_one_worker, 1, args=(strategy,), timeout=120)[0]
    assert abs(got - want) < 1e-5, (got, want)


def old_format_checkpoint_worker(rank, world, path):
    from distributed_training.checkpoint import CheckpointMismatchError, read_meta, write_meta

    torch.manual_seed(0)
    trainer = DistributedTrainer(MLP(), lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="zero3")
    trainer.train_step((torch.randn(8, 16), torch.randint(0, 4, (8,))), F.cross_entropy)
    trainer.save_checkpoint(path)
    if rank == 0:  # what a checkpoint of an earlier version says of itself
        meta = read_meta(path)
        meta["checkpoint_format"] = "fsdp"
        write_meta(meta, path)
    trainer.context.barrier()
    try:
        trainer.load_checkpoint(path)
    except CheckpointMismatchError as err:
        return str(err)
    finally:
        trainer.close()
    return "loaded"


def test_a_checkpoint_of_an_earlier_format_is_refused_with_what_to_do(tmp_path):
    for msg in run_distributed(old_format_checkpoint_worker, 2, args=(str(tmp_path / "ck"),), timeout=120):
        assert "earlier version" in msg and "'fsdp'" in msg and "resume=False" in msg, msg


def string_criterion_worker(rank, world):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g))
    trainer = DistributedTrainer(MLP(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    errors = []
    for call in (lambda: trainer.fit(data, criterion="cross_entropy", batch_size=4),
                 lambda: trainer.train_step(data[:4], "cross_entropy"),
                 lambda: trainer.evaluate(data, "cross_entropy", batch_size=4)):
        try:
            call()
        except TypeError as err:
            errors.append(str(err))
    step = trainer.step
    trainer.close()
    return errors, step


def test_a_criterion_that_is_not_callable_is_named_before_any_step():
    """fit(criterion="cross_entropy") failed inside the first step with "'str' object is not callable" (and
    evaluate inside its first batch)."""
    errors, step = run_distributed(string_criterion_worker, 1, timeout=120)[0]
    assert len(errors) == 3 and step == 0, errors
    assert all("criterion must be a callable" in e and "'cross_entropy'" in e for e in errors), errors


def loader_batch_size_worker(rank, world):
    import warnings

    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g))
    trainer = DistributedTrainer(MLP(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(DataLoader(data, batch_size=16, shuffle=True), epochs=1, criterion=F.cross_entropy, batch_size=4)
        steps = trainer.step
        trainer.fit(DataLoader(data, batch_size=16, shuffle=True), epochs=2, criterion=F.cross_entropy, batch_size=16)
    trainer.close()
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)], steps


def test_a_batch_size_that_a_dataloader_overrides_is_said():
    """fit(DataLoader(data, batch_size=16), batch_size=4) trained batches of 16 without a word."""
    messages, steps = run_distributed(loader_batch_size_worker, 1, timeout=120)[0]
    assert steps == 2, steps  # 32 samples in batches of 16: the loader's size is what trains
    assert len(messages) == 1 and "fit(batch_size=4) is not used" in messages[0] and "(16)" in messages[0], messages


def checkpoint_path_worker(rank, world):
    trainer = DistributedTrainer(MLP(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    errors = []
    for call in (trainer.save_checkpoint, trainer.load_checkpoint):
        try:
            call(None)
        except TypeError as err:
            errors.append(str(err))
    trainer.close()
    return errors


def test_a_checkpoint_path_that_is_not_a_name_is_said():
    """save_checkpoint(None) raised "expected str, bytes or os.PathLike object, not NoneType" from inside."""
    errors = run_distributed(checkpoint_path_worker, 1, timeout=120)[0]
    assert len(errors) == 2, errors
    assert "save_checkpoint(path)" in errors[0] and "load_checkpoint(path)" in errors[1], errors
    assert all("got None" in e for e in errors), errors
