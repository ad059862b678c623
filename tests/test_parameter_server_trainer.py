"""`DistributedTrainer(strategy="parameter_server")`: the parameter server behind the trainer and dtrain.

* sync, 1 server x 2 workers, `train_step` on each worker's half of the global batch: after every step
  the workers' model (and, at the end, the server's) equals one process training on the whole batch
  with torch's SGD (momentum) / Adam.
* `fit` with sync equals our DDP's `fit` at 2 ranks (the same shards of the same data); ssp and async
  `fit` run to the end, and every rank (servers included) ends with the same model and evaluation.
* The options' errors (before any rendezvous, and num_servers >= world at start-up), the optimizer
  settings the servers cannot run, and dtrain's fields; a dtrain run on digits at world 3.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed_training.testing import run_distributed

STEPS = 4
PER_WORKER = 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(step: int, n: int):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def _factory(kind: str):
    if kind == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    return lambda ps: torch.optim.Adam(ps, lr=0.01)


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p.detach() - q.detach()).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _step_parity_job(rank, world, kind, uneven=False):
    from distributed_training import DistributedTrainer

    trainer = DistributedTrainer(_model(), _factory(kind), strategy="parameter_server", num_servers=1,
                                 heartbeat_timeout=None)
    ref = _model()
    ref_opt = _factory(kind)(ref.parameters())
    workers = world - 1
    diffs = []
    if trainer.strategy.trains:
        assert (trainer.dp_rank, trainer.dp_world_size) == (rank - 1, workers)
        for step in range(STEPS):
            x, y = _uneven(*_batch(step, PER_WORKER * workers)) if uneven else _batch(step, PER_WORKER * workers)
            bounds = ([0, 5, 12] if uneven else [w * PER_WORKER for w in range(workers + 1)])
            mine = slice(bounds[trainer.dp_rank], bounds[trainer.dp_rank + 1])
            trainer.train_step((x[mine], y[mine]), F.cross_entropy)
            ref_opt.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            ref_opt.step()
            trainer.strategy.model_state_dict(trainer.model)  # pulls the update of this step
            diffs.append(_max_diff(trainer.module, ref))
        trainer.strategy.finish(trainer.model)
    else:
        stats = trainer.strategy.serve(trainer.model)
        assert stats.updates == STEPS and stats.max_staleness == 0
        for step in range(STEPS):
            x, y = _uneven(*_batch(step, PER_WORKER * workers)) if uneven else _batch(step, PER_WORKER * workers)
            ref_opt.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            ref_opt.step()
    final = _max_diff(trainer.module, ref)
    trainer.close()
    return diffs, final


def _uneven(x, y):
    """Worker 0 gets 5 rows, worker 1 7 with 3 ignored targets (``-100``, padding)."""
    y = y.clone()
    y[-3:] = -100
    return x, y


@pytest.mark.parametrize("kind, uneven", [("sgd", False), ("adam", False), ("sgd", True)])
def test_sync_equals_one_process_after_every_step(kind, uneven):
    """`uneven`: workers' batches of 5 and 7 rows, 3 targets of the second ignored. Servers weighed each
    worker's mean gradient equally (1.2e-2 off one process after 4 steps): now by its batch's count."""
    results = run_distributed(_step_parity_job, 3, (kind, uneven), timeout=120)
    for rank, (diffs, final) in enumerate(results):
        assert final < 1e-5, (rank, final)
        if rank:
            assert len(diffs) == STEPS and max(diffs) < 1e-5, (rank, diffs)


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 48) -> None:
        g = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _fit_job(rank, world, strategy, consistency, staleness, log_dir=None):
    from distributed_training import DistributedTrainer

    kwargs = {} if log_dir is None else {"log_dir": log_dir, "log_every": 2, "progress": False}
    if strategy == "parameter_server":
        kwargs.update(num_servers=1, consistency=consistency, staleness=staleness)
    trainer = DistributedTrainer(_model(), _factory("sgd"), strategy=strategy, heartbeat_timeout=None, **kwargs)
    before = trainer.evaluate(_Data(), F.cross_entropy, batch_size=8)["loss"]
    history = trainer.fit(_Data(), epochs=2, criterion=F.cross_entropy, batch_size=4, eval_dataset=_Data(16),
                          eval_every=3)
    metrics = trainer.evaluate(_Data(16), F.cross_entropy, batch_size=5)
    metrics["train_before"] = before
    metrics["train_after"] = trainer.evaluate(_Data(), F.cross_entropy, batch_size=8)["loss"]
    state = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    steps, trains = trainer.step, trainer.strategy.trains
    trainer.close()
    return {"history": history, "metrics": metrics, "state": state, "steps": steps, "trains": trains}


def _same_state(a, b, atol=1e-5):
    return all(torch.allclose(a[k], b[k], atol=atol) for k in a)


def _logged_ranks(log_dir) -> list[str]:
    """The rank directories of a monitored run that hold step records."""
    import os

    return sorted(d for d in os.listdir(log_dir) if d.startswith("rank_")
                  and os.path.getsize(os.path.join(log_dir, d, "metrics.jsonl")) > 0)


def test_fit_sync_equals_ddp(tmp_path):
    ps = run_distributed(_fit_job, 3, ("parameter_server", "sync", 0, str(tmp_path)), timeout=150)
    assert _logged_ranks(tmp_path) == ["rank_0", "rank_1"]  # the workers, by worker index; servers log nothing
    ddp = run_distributed(_fit_job, 2, ("ddp", None, 0), timeout=150)
    assert ps[0]["history"] == [] and not ps[0]["trains"]
    assert ps[1]["steps"] == ps[2]["steps"] == ddp[0]["steps"] == 12  # 48 samples / (2 x 4) x 2 epochs
    for r in ps:
        assert _same_state(r["state"], ddp[0]["state"]), "the parameter server's sync fit differs from DDP"
        assert abs(r["metrics"]["loss"] - ddp[0]["metrics"]["loss"]) < 1e-5
    assert ps[1]["history"][-1]["val_loss"] == pytest.approx(ddp[0]["history"][-1]["val_loss"], abs=1e-5)


def _monitor_job(rank, world, log_dir, consistency):
    from distributed_training import DistributedTrainer

    trainer = DistributedTrainer(_model(), _factory("sgd"), strategy="parameter_server", num_servers=1,
                                 consistency=consistency, heartbeat_timeout=None, log_dir=log_dir, progress=True)
    monitor = trainer.monitor
    seen = {"bar": getattr(monitor, "_bar", None) is not None, "member": getattr(monitor, "member", None),
            "main": trainer.context.is_main}
    trainer.close()
    return seen


@pytest.mark.parametrize("consistency", ["sync", "async"])
def test_one_progress_bar_and_workers_called_workers(tmp_path, consistency):
    """Under torchrun every worker shares the terminal: only the job's main rank (worker 0) draws the bar;
    the monitor calls its members workers (its rank is the worker index)."""
    seen = run_distributed(_monitor_job, 4, (str(tmp_path), consistency), timeout=150)
    assert [s["bar"] for s in seen] == [False, True, False, False], seen  # the server, then workers 0 .. 2
    assert [s["main"] for s in seen] == [False, True, False, False], seen
    assert [s["member"] for s in seen[1:]] == ["worker"] * 3, seen


@pytest.mark.parametrize("consistency,staleness", [("ssp", 2), ("async", 0)])
def test_fit_ssp_and_async_run_to_the_end(tmp_path, consistency, staleness):
    results = run_distributed(_fit_job, 3, ("parameter_server", consistency, staleness, str(tmp_path)), timeout=150)
    assert _logged_ranks(tmp_path) == ["rank_0", "rank_1"]  # each worker alone (no cluster all-gather)
    assert [r["steps"] for r in results[1:]] == [12, 12]
    first = results[0]["state"]
    for r in results:  # the final model, servers included
        assert _same_state(r["state"], first, atol=0)
        assert r["metrics"]["loss"] == pytest.approx(results[0]["metrics"]["loss"], abs=1e-5)
    assert results[1]["metrics"]["train_after"] < results[1]["metrics"]["train_before"] - 0.05  # it trained


def _two_servers_job(rank, world):
    from distributed_training import DistributedTrainer

    trainer = DistributedTrainer(_model(), lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.0),
                                 strategy="parameter_server", num_servers=2, heartbeat_timeout=None)
    trainer.fit(_Data(), epochs=1, criterion=F.cross_entropy, batch_size=4)
    state = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    full = trainer.full_state_dict()
    trainer.close()
    return state, bool(full)


def test_two_servers_every_rank_ends_with_the_same_model():
    results = run_distributed(_two_servers_job, 4, timeout=150)
    for state, _ in results:
        assert _same_state(state, results[0][0], atol=0)
    assert [has for _, has in results] == [False, False, True, False]  # worker 0 is the job's main rank


# ------------------------------------------------------------------ errors
def test_options_errors_before_any_rendezvous():
    from distributed_training import DistributedTrainer

    model = _model()
    with pytest.raises(ValueError, match="num_servers= applies with strategy 'parameter_server'"):
        DistributedTrainer(model, _factory("sgd"), strategy="ddp", num_servers=2)
    with pytest.raises(ValueError, match="consistency must be one of"):
        DistributedTrainer(model, _factory("sgd"), strategy="parameter_server", consistency="eventual")
    with pytest.raises(ValueError, match="staleness applies to consistency='ssp'"):
        DistributedTrainer(model, _factory("sgd"), strategy="parameter_server", staleness=2)
    with pytest.raises(ValueError, match="num_servers must be a positive integer"):
        DistributedTrainer(model, _factory("sgd"), strategy="parameter_server", num_servers=0)


def test_server_optimizer_settings():
    from distributed_training.strategies.parameter_server import server_optimizer

    ps = list(_model().parameters())
    assert server_optimizer(torch.optim.SGD(ps, lr=0.1, momentum=0.5)) == {"optimizer": "sgd", "lr": 0.1,
                                                                           "momentum": 0.5}
    assert server_optimizer(torch.optim.AdamW(ps, lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0)) == {
        "optimizer": "adam", "lr": 0.01, "betas": (0.8, 0.9), "eps": 1e-6}
    with pytest.raises(NotImplementedError, match=r"weight_decay=0.01"):
        server_optimizer(torch.optim.AdamW(ps, lr=0.01))
    with pytest.raises(NotImplementedError, match=r"nesterov=True"):
        server_optimizer(torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True))
    with pytest.raises(NotImplementedError, match="RMSprop"):
        server_optimizer(torch.optim.RMSprop(ps, lr=0.1))


def _step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, 1)


def _world_job(rank, world, num_servers, extra):
    from distributed_training import DistributedTrainer

    try:
        DistributedTrainer(_model(), _factory("sgd"), strategy="parameter_server", num_servers=num_servers,
                           heartbeat_timeout=None, **extra)
    except (ValueError, NotImplementedError) as err:
        return str(err)
    return None


def test_start_up_errors():
    results = run_distributed(_world_job, 2, (2, {}), timeout=60)
    assert all("num_servers=2 leaves no worker in a world of 2" in r for r in results)
    results = run_distributed(_world_job, 2, (1, {"gradient_clip_val": 1.0}), timeout=60)
    assert all("gradient_clip_val with strategy 'parameter_server' is not supported" in r for r in results)
    results = run_distributed(_world_job, 2, (1, {"lr_scheduler": _step_lr}), timeout=60)
    assert all("lr_scheduler with strategy 'parameter_server'" in r for r in results)


# ------------------------------------------------------------------ dtrain
def _dtrain_job(rank, world, output):
    from distributed_training import cli
    from distributed_training.config import load_config

    cfg = load_config({
        "model": {"preset": "classifier"}, "data": {"dataset": "digits"},
        "training": {"strategy": "parameter_server", "num_servers": 1, "epochs": 2, "batch_size": 32,
                     "lr": 0.05},
        "optimizer": {"name": "sgd"}, "logging": {"progress": False}, "output": output,
    })
    return cli.run_job(cfg)


def test_dtrain_parameter_server_on_digits(tmp_path):
    output = str(tmp_path / "final.pt")
    results = run_distributed(_dtrain_job, 3, (output,), timeout=240)
    assert results[0] == {} and results[2] == {}  # worker 0 (rank 1) is the job's main rank
    metrics = results[1]
    assert metrics["accuracy"] > 0.8, metrics  # digits: 10 classes
    state = torch.load(output)
    assert set(state) == {"0.weight", "0.bias", "3.weight", "3.bias"}


@pytest.mark.parametrize("fields,message", [
    ({"num_servers": 2}, "training.num_servers applies to training.strategy parameter_server, not 'ddp'"),
    ({"strategy": "parameter_server", "staleness": 2}, "training.staleness applies to training.consistency ssp"),
    ({"strategy": "parameter_server", "consistency": "eventual"}, "training.consistency"),
    ({"strategy": "parameter_server", "num_servers": 0}, "training.num_servers"),
    ({"strategy": "parameter_server", "gradient_clip_val": 0.5}, "training.gradient_clip_val with"),
    ({"strategy": "parameter_server", "weight_decay": 0.1}, "optimizer.weight_decay / training.weight_decay with"),
    ({"strategy": "parameter_server", "precision": "fp16"}, "training.precision fp16 with"),
])
def test_dtrain_config_errors(fields, message):
    from distributed_training.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_config({"model": {"preset": "classifier"}, "data": {"dataset": "digits"}, "training": fields})


def test_dtrain_config_parameter_server_fields():
    from distributed_training.config import ConfigError, load_config

    cfg = load_config({"model": {"preset": "classifier"}, "data": {"dataset": "digits"},
                       "training": {"strategy": "parameter_server", "num_servers": 2, "consistency": "ssp",
                                    "staleness": 3}})
    assert (cfg.training.num_servers, cfg.training.consistency, cfg.training.staleness) == (2, "ssp", 3)
    with pytest.raises(ConfigError, match="schedule.kind cosine with training.strategy parameter_server"):
        load_config({"model": {"preset": "classifier"}, "data": {"dataset": "digits"},
                     "training": {"strategy": "parameter_server"}, "schedule": {"kind": "cosine"}})


def test_dtrain_num_servers_at_least_the_world_is_an_error(monkeypatch):
    from distributed_training import cli
    from distributed_training.config import ConfigError, load_config

    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config({"model": {"preset": "classifier"}, "data": {"dataset": "digits"},
                       "training": {"strategy": "parameter_server", "num_servers": 2}})
    with pytest.raises(ConfigError, match="training.num_servers=2 leaves no worker in a world of 2"):
        cli.run_job(cfg)
