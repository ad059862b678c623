"""The parameter server's servers checkpoint their shards in the one checkpoint format.

* resume: servers that save after K steps and a new parameter server (another initial model) that
  loads the checkpoint continue exactly like an unbroken run: the workers' parameters after every
  later pull, and the servers' parameters and optimizer state at the end, bit for bit (SGD with
  momentum, Adam; 2 servers, the embedding table split by rows over them).
* the format: the servers' checkpoint loads into one process (DDP's layout: whole tensors, torch's
  optimizer) through the index, equal to one process trained on the whole batch (parameters and
  optimizer state); and into 1 server where 2 wrote it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed_training.checkpoint import load_file, read_meta
from distributed_training.checkpoint_shards import Sources, StateLayout, unpack_optimizer, unpack_params, \
    whole_tensors
from distributed_training.ps import ParameterServer
from distributed_training.testing import run_distributed

K, M = 3, 3
PER_WORKER = 4
ROWS, DIM, IDS = 40, 8, 5


class EmbMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM)
        self.fc1 = nn.Linear(DIM, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, ids):
        return self.fc2(torch.relu(self.fc1(self.emb(ids).mean(1))))


def _model(seed: int = 0) -> EmbMLP:
    torch.manual_seed(seed)
    return EmbMLP()


def _batch(step: int, workers: int):
    g = torch.Generator().manual_seed(100 + step)
    n = PER_WORKER * workers
    return torch.randint(0, ROWS, (n, IDS), generator=g), torch.randn(n, 4, generator=g)


def _settings(optimizer: str) -> dict:
    return {"lr": 0.05, "momentum": 0.9} if optimizer == "sgd" else {"lr": 0.01}


def _phase(optimizer, num_servers, steps, *, start=0, seed=0, load=None, save=None, sparse=False,
           consistency="sync", staleness=0):
    """One parameter server's life: optionally load, train `steps` steps from step `start`, optionally save.
    Returns a server's values and optimizer state, or a worker's parameters at each pull."""
    model = _model(seed)
    ps = ParameterServer(model, optimizer, num_servers=num_servers, sparse=["emb.weight"] if sparse else [],
                         consistency=consistency, staleness=staleness, **_settings(optimizer))
    loaded = ps.load_state(load) if load else None
    if ps.role == "server":
        stats = ps.serve()
        out = {"role": "server", "updates": stats.updates, "loaded": loaded, "staleness": stats.staleness,
               "values": {k: v.clone() for k, v in ps._server.values.items()},
               "optim": {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in s.items()}
                         for k, s in ps._server.optim.piece_state().items()},
               "plan": [[(p.name, p.start, p.stride) for p in pieces] for pieces in ps.plan.pieces]}
    else:
        w, snapshots = ps.worker_index, []
        for step in range(start, start + steps):
            x, y = _batch(step, ps.num_workers)
            mine = slice(w * PER_WORKER, (w + 1) * PER_WORKER)
            ps.pull(rows={"emb.weight": x[mine]} if sparse else None)
            snapshots.append([p.detach().clone() for p in model.parameters()])
            F.mse_loss(model(x[mine]), y[mine]).backward()
            ps.step()
            model.zero_grad(set_to_none=True)
        ps.pull(final=True)
        snapshots.append([p.detach().clone() for p in model.parameters()])
        ps.close()
        out = {"role": "worker", "snapshots": snapshots, "loaded": loaded}
    if save:
        ps.save_state(save)
    return out


def _resume_job(rank, world, optimizer, directory):
    unbroken = _phase(optimizer, 2, K + M)
    _phase(optimizer, 2, K, save=f"{directory}/k")
    resumed = _phase(optimizer, 2, M, start=K, seed=1, load=f"{directory}/k")
    fresh = _phase(optimizer, 2, M, start=K, seed=1)  # the same without the checkpoint: must differ
    one_server = _phase(optimizer, 1, 0, seed=2, load=f"{directory}/k")
    return {"unbroken": unbroken, "resumed": resumed, "fresh": fresh, "one_server": one_server}


def _ssp_resume_job(rank, world, directory):
    _phase("sgd", 1, K, save=f"{directory}/k", consistency="ssp", staleness=1)
    return _phase("sgd", 1, M, start=K, load=f"{directory}/k", consistency="ssp", staleness=1)


def test_ssp_resumes_with_its_gate_where_the_workers_stood(tmp_path):
    # ssp's gate counts the workers' steps: a server loaded from a checkpoint must know them, or the
    # workers' first pulls (step K, more than the bound ahead of step 0) wait for ever (the test's timeout)
    server, *workers = run_distributed(_ssp_resume_job, 3, args=(str(tmp_path),), timeout=90)
    assert server["loaded"] == K and all(w["loaded"] == K for w in workers)
    assert server["updates"] == 2 * K + 2 * M  # one update per gradient, on from the saved version
    assert sorted(s for _, s, _ in server["staleness"]) == sorted(list(range(K, K + M)) * 2)
    assert max(st for _, _, st in server["staleness"]) <= 1


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _one_process(optimizer: str, steps: int, workers: int):
    model = _model()
    opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if optimizer == "sgd"
           else torch.optim.Adam(model.parameters(), lr=0.01))
    for step in range(steps):
        x, y = _batch(step, workers)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_servers_resume_like_an_unbroken_run_and_the_checkpoint_is_the_one_format(optimizer, tmp_path):
    results = run_distributed(_resume_job, 4, args=(optimizer, str(tmp_path)), timeout=120)
    for rank, r in enumerate(results):
        unbroken, resumed, fresh = r["unbroken"], r["resumed"], r["fresh"]
        if rank < 2:
            assert unbroken["plan"][rank][0] == ("emb.weight", rank, 2)  # the table split by rows
            assert resumed["updates"] == K + M and resumed["loaded"] == K
            assert _same(resumed["values"], unbroken["values"])
            assert _same(resumed["optim"], unbroken["optim"])
            assert not _same(fresh["values"], unbroken["values"])
        else:
            assert resumed["loaded"] == K
            assert _same(resumed["snapshots"], unbroken["snapshots"][K:])
            assert not _same(fresh["snapshots"], unbroken["snapshots"][K:])

    # The format: rank files of the 2 servers only, read into one process through the index.
    path = str(tmp_path / "k")
    meta = read_meta(path)
    assert meta["strategy"] == "parameter_server" and meta["ps"]["version"] == K and meta["step"] == K
    assert sorted(meta["checksums"]) == ["rank0.pt", "rank1.pt"]
    ref, ref_opt = _one_process(optimizer, K, workers=2)
    model = _model(seed=3)
    opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if optimizer == "sgd"
           else torch.optim.Adam(model.parameters(), lr=0.01))
    layout = StateLayout({k: tuple(p.shape) for k, p in model.named_parameters()},
                         whole_tensors(list(model.named_parameters()), True),
                         whole_tensors(list(model.named_parameters()), True))
    sources = Sources(lambda k: load_file(f"{path}/rank{k}.pt", meta["checksums"][f"rank{k}.pt"]), 0)
    unpack_params(layout, meta["index"], sources)
    unpack_optimizer(layout, opt, meta["index"], sources)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-5), name
        mine, theirs = opt.state[p], ref_opt.state[q]
        assert set(mine) == set(theirs), name
        for key in theirs:
            assert torch.allclose(torch.as_tensor(mine[key]).float(), torch.as_tensor(theirs[key]).float(),
                                  atol=1e-5), (name, key)

    # 1 server (another plan) reads what 2 wrote: every parameter whole, its optimizer state with it.
    one = results[0]["one_server"]
    assert one["loaded"] == K
    for name, p in model.named_parameters():
        assert torch.equal(one["values"][name], p.detach()), name
        for key, value in one["optim"][name].items():
            assert torch.equal(torch.as_tensor(value).float(), torch.as_tensor(opt.state[p][key]).float()), \
                (name, key)


def _sparse_resume_job(rank, world, optimizer, directory):
    unbroken = _phase(optimizer, 2, K + M, sparse=True)
    _phase(optimizer, 2, K, save=f"{directory}/k", sparse=True)
    resumed = _phase(optimizer, 2, M, start=K, seed=1, load=f"{directory}/k", sparse=True)
    return unbroken, resumed


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_sparse_tables_resume_with_their_lazy_state(optimizer, tmp_path):
    """A sparse table's lazy state (momentum of touched rows; SparseAdam's moments and step) comes back."""
    results = run_distributed(_sparse_resume_job, 4, args=(optimizer, str(tmp_path)), timeout=120)
    for rank, (unbroken, resumed) in enumerate(results):
        if rank < 2:
            assert "emb.weight" in unbroken["optim"]
            assert _same(resumed["values"], unbroken["values"])
            assert _same(resumed["optim"], unbroken["optim"])
        else:  # a step pulls only its rows of the table (the others are the worker's own); the final pull all
            assert _same([snap[1:] for snap in resumed["snapshots"]], [snap[1:] for snap in unbroken["snapshots"][K:]])
            assert _same(resumed["snapshots"][-1], unbroken["snapshots"][-1])


# ------------------------------------------------------------------ through DistributedTrainer
class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 40) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids, self.y = torch.randint(0, ROWS, (n, IDS), generator=g), torch.randn(n, 4, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.ids[i], self.y[i]


class _Dropped(EmbMLP):
    """A model that draws random numbers in training (the workers' RNG states are checkpointed)."""

    def forward(self, ids):
        return self.fc2(F.dropout(torch.relu(self.fc1(self.emb(ids).mean(1))), 0.2, self.training))


def _fit_job(rank, world, optimizer, directory, every, max_steps):
    from distributed_training import DistributedTrainer

    torch.manual_seed(0)
    model = _Dropped()
    factory = (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)) if optimizer == "sgd" else \
        (lambda ps: torch.optim.Adam(ps, lr=0.01))
    options = {"checkpoint_dir": directory, "checkpoint_every": every} if directory is not None else {}
    trainer = DistributedTrainer(model, factory, strategy="parameter_server", num_servers=1, heartbeat_timeout=None,
                                 seed=3, **options)
    after = {}  # step -> a worker's parameters after that step's update

    def record(step, _metrics):
        state = trainer.strategy.model_state_dict(trainer.model)  # pulls this step's update
        after[step] = {k: v.detach().clone() for k, v in state.items()}

    trainer.fit(_Data(), epochs=3, criterion=F.mse_loss, batch_size=4, max_steps=max_steps, on_step=record,
                log_every=1)
    final = {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}
    trainer.close()
    return after, final


def _fit(optimizer, directory=None, every=None, max_steps=8):
    return run_distributed(_fit_job, 3, (optimizer, directory, every, max_steps), timeout=150)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_trainer_checkpoints_resume_like_an_unbroken_run(optimizer, tmp_path):
    unbroken = _fit(optimizer)
    steps = sorted(unbroken[1][0])
    assert steps == list(range(1, 9))  # 40 samples / (2 workers x 4) = 5 steps an epoch: 8 crosses an epoch
    saving = _fit(optimizer, str(tmp_path / "a"), 2)
    first = _fit(optimizer, str(tmp_path / "b"), 2, max_steps=4)
    assert (tmp_path / "b" / "step_000000004").is_dir()
    meta = read_meta(str(tmp_path / "b" / "step_000000004"))
    assert (meta["step"], meta["epoch"], meta["batch_in_epoch"]) == (4, 0, 4)
    assert meta["ps"]["worker_steps"] == [4, 4] and meta["ps"]["version"] == 4
    assert {"rank0.pt", "worker0.pt", "worker1.pt"} <= set(meta["checksums"])
    resumed = _fit(optimizer, str(tmp_path / "b"), 2, max_steps=8)
    for worker in (1, 2):
        for step in steps:  # checkpoints do not change training: bit for bit
            assert _same(saving[worker][0][step], unbroken[worker][0][step]), f"checkpoint_every=2, step {step}"
        for step in range(1, 5):
            assert _same(first[worker][0][step], unbroken[worker][0][step]), f"before the stop, step {step}"
        assert sorted(resumed[worker][0]) == list(range(5, 9))
        for step in range(5, 9):
            assert _same(resumed[worker][0][step], unbroken[worker][0][step]), f"resumed, step {step}"
    for rank in range(3):  # every rank, the server included, ends with the unbroken run's model
        assert _same(resumed[rank][1], unbroken[rank][1])
        assert _same(saving[rank][1], unbroken[rank][1])


def test_trainer_checkpoint_options_refused_before_any_rendezvous(tmp_path):
    import torch.distributed as dist

    from distributed_training import DistributedTrainer

    try:
        for kwargs, name in (({"consistency": "ssp", "staleness": 1}, "checkpoint_dir"),
                             ({"consistency": "async"}, "checkpoint_dir"),
                             ({"checkpoint_async": True}, "checkpoint_async"),
                             ({"checkpoint_shared": False}, "checkpoint_shared")):
            with pytest.raises(NotImplementedError, match=f"{name} with strategy 'parameter_server'"):
                DistributedTrainer(EmbMLP(), lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="parameter_server",
                                   checkpoint_dir=str(tmp_path), **kwargs)
    finally:
        # The refusal comes after the trainer's world of one was initialised, and leaves its group behind
        # in this pytest process: a later test file on the same worker would find it (test_tensor_plan does).
        if dist.is_initialized():
            dist.destroy_process_group()


def _ssp_other_workers_job(rank, world, directory):
    """2 servers x 2 workers save after K steps; 1 server x 3 workers (ssp, s = 1) load and train M steps
    each from where they stand."""
    _phase("sgd", 2, K, save=f"{directory}/k", consistency="ssp", staleness=1)
    model = _model(1)
    ps = ParameterServer(model, "sgd", num_servers=1, consistency="ssp", staleness=1, **_settings("sgd"))
    loaded = ps.load_state(f"{directory}/k")
    if ps.role == "server":
        return {"role": "server", "loaded": loaded, "staleness": _serve_or_train(ps, model, 0, 0)}
    start = ps.worker_step
    _serve_or_train(ps, model, start, M)
    return {"role": "worker", "loaded": loaded, "start": start}


def test_ssp_loads_a_checkpoint_of_another_number_of_workers(tmp_path):
    # The checkpoint holds the steps of 2 workers; the 3 that load it start at its step (the workers'
    # least: worker 2 has none of its own), and the servers' gate must count from there too. It counted
    # from step 0 (the workers' steps were taken only when the checkpoint had one per worker), so every
    # first pull, K > s steps ahead of that, waited for ever: the test's timeout.
    server, *workers = run_distributed(_ssp_other_workers_job, 4, args=(str(tmp_path),), timeout=60)
    assert server["loaded"] == K and [w["start"] for w in workers] == [K, K, K]
    assert sorted(s for _, s, _ in server["staleness"]) == sorted(list(range(K, K + M)) * 3)
    assert max(st for _, _, st in server["staleness"]) <= 1


def _ssp_then_sync_job(rank, world, directory):
    _phase("sgd", 1, K, save=f"{directory}/k", consistency="ssp", staleness=1)
    return _phase("sgd", 1, M, start=K, load=f"{directory}/k")


def test_an_ssp_checkpoint_resumes_under_sync(tmp_path):
    # ssp (s >= 1) applies one update a gradient, so its version (2 K) is no step: a sync server took it
    # as the next step to apply and refused the workers' first push ("worker 0 pushed step K twice").
    # Step-aggregated servers continue from the workers' step.
    server, *workers = run_distributed(_ssp_then_sync_job, 3, args=(str(tmp_path),), timeout=90)
    assert server["loaded"] == K and all(w["loaded"] == K for w in workers)
    assert sorted(s for _, s, _ in server["staleness"]) == sorted(list(range(K, K + M)) * 2)
    assert all(st == 0 for _, _, st in server["staleness"])
    assert all(torch.equal(a, b) for a, b in zip(workers[0]["snapshots"][-1], workers[1]["snapshots"][-1]))


def _serve_or_train(ps, model, start, steps):
    if ps.role == "server":
        return ps.serve().staleness
    w = ps.worker_index
    for step in range(start, start + steps):
        x, y = _batch(step, ps.num_workers)
        mine = slice(w * PER_WORKER, (w + 1) * PER_WORKER)
        ps.pull()
        F.mse_loss(model(x[mine]), y[mine]).backward()
        ps.step()
        model.zero_grad(set_to_none=True)
    ps.pull(final=True)
    ps.close()
    return [p.detach().clone() for p in model.parameters()]


def _ssp_then_sync_in_memory_job(rank, world):
    model = _model()
    first = ParameterServer(model, "sgd", num_servers=1, consistency="ssp", staleness=1, **_settings("sgd"))
    _serve_or_train(first, model, 0, K)
    second = ParameterServer(model, "sgd", num_servers=1, **_settings("sgd"))
    second.continue_from(first)
    return _serve_or_train(second, model, K, M)


def test_an_ssp_run_continues_in_memory_under_sync():
    # continue_from, as load_state: the sync server continues from the workers' step, not from ssp's
    # version (one update a gradient), which made the workers' first push a "pushed step K twice" error
    staleness, *finals = run_distributed(_ssp_then_sync_in_memory_job, 3, timeout=90)
    assert sorted(s for _, s, _ in staleness) == sorted(list(range(K, K + M)) * 2)
    assert all(st == 0 for _, _, st in staleness)
    assert all(torch.equal(a, b) for a, b in zip(*finals))
