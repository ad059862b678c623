"""A parameter-server worker killed mid-run (issue 19, items 4 and 6).

Worker 1 SIGKILLs itself at step 5, before its pull of that step:

* async and ssp (s = 2): the other workers complete all their steps, the servers report the drop (worker
  1 at step 5), the final parameters are finite and the loss fell; every gradient it pushed was
  applied as it came (one update each) and under ssp the staleness bound still holds.
* sync: the servers and the surviving workers raise `WorkerLostError` naming worker 1 within seconds,
  not at the collective timeout.

The killed rank makes `run_distributed` fail (its process ends without reporting), so each surviving rank
writes what it saw to a file, and the test checks that the killed rank is the only failure.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed_training.ps import ParameterServer, WorkerLostError
from distributed_training.testing import DistributedTestError, read_records, run_distributed, write_record

STEPS = 20
VICTIM = 1  # worker index; its rank is num_servers + 1
KILL_AT = 5


def _data(seed: int, n: int = 16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, x @ torch.arange(1.0, 9.0).unsqueeze(1) / 8 + 0.5


def _loss(model) -> float:
    with torch.no_grad():
        x, y = _data(10_000, 256)
        return F.mse_loss(model(x), y).item()


class _Collect(logging.Handler):
    """The messages of WARNING and above logged on this rank."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _killed_job(rank, world, directory, consistency, staleness, num_servers):
    torch.manual_seed(0)
    model = nn.Linear(8, 1)  # two parameters: with two servers, one on each
    ps = ParameterServer(model, "sgd", lr=0.1, num_servers=num_servers, consistency=consistency,
                         staleness=staleness)
    if ps.role == "server":
        warnings = _Collect()
        logging.getLogger("distributed_training").addHandler(warnings)
        try:
            stats = ps.serve()
        except WorkerLostError as err:
            write_record(directory, rank, role="server", lost=err.worker, step=err.step, message=str(err), at=time.time(),
                         cause=repr(err.__cause__))
            return
        values = [v.tolist() for v in ps.server_values.values()]
        write_record(directory, rank, role="server", dropped=stats.dropped, updates=stats.updates, warnings=warnings.lines,
                staleness=stats.staleness, finite=all(math.isfinite(x) for v in ps.server_values.values()
                                                      for x in v.reshape(-1).tolist()), values=values)
        return
    w = ps.worker_index
    initial = _loss(model)
    done = 0
    try:
        for step in range(STEPS):
            if w == VICTIM and step == KILL_AT:
                with open(os.path.join(directory, "killed_at"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)
            ps.pull()
            x, y = _data(1000 * step + w)
            F.mse_loss(model(x), y).backward()
            if w != VICTIM and step < 8:
                # the survivors are slower early on: under ssp the victim runs ahead to the bound, so that it
                # dies while the others still take steps it was ahead of; under async it dies mid-run
                time.sleep(0.1 if consistency == "ssp" else 0.02)
            ps.step()
            model.zero_grad(set_to_none=True)
            done += 1
        ps.pull(final=True)
        ps.close()
    except WorkerLostError as err:
        write_record(directory, rank, role="worker", lost=err.worker, step=err.step, message=str(err), at=time.time(),
                done=done)
        ps.close()  # a no-op after the error: nothing waits for a server that has stopped
        return
    write_record(directory, rank, role="worker", done=done, initial=initial, final=_loss(model),
            params=[p.detach().reshape(-1).tolist() for p in model.parameters()])


def _run(tmp_path, consistency, staleness, num_servers):
    world = num_servers + 3
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_killed_job, world, args=(str(tmp_path), consistency, staleness, num_servers),
                        timeout=60, collective_timeout=100)
    return survivors_records(info.value, world, num_servers + VICTIM, tmp_path)


def survivors_records(error: DistributedTestError, world: int, victim_rank: int, directory) -> tuple[dict, float]:
    """Check that the killed rank is the job's only failure (the others ended normally); return the
    survivors' records and the time of the kill (the file ``killed_at`` the victim wrote)."""
    failed = {r for r in range(world) if f"--- rank {r} failed ---" in str(error)}
    assert failed == {victim_rank}, str(error)  # only the killed rank: the others ended normally
    assert "did not finish" not in str(error), str(error)
    records = read_records(directory)
    assert sorted(records) == [r for r in range(world) if r != victim_rank], records
    with open(os.path.join(directory, "killed_at")) as f:
        killed_at = float(f.read())
    return records, killed_at


@pytest.mark.timeout(120)
@pytest.mark.parametrize("consistency,staleness,num_servers", [("async", 0, 1), ("ssp", 2, 1), ("async", 0, 2)])
def test_a_killed_worker_is_dropped_and_the_others_finish(tmp_path, consistency, staleness, num_servers):
    records, _ = _run(tmp_path, consistency, staleness, num_servers)
    workers = [r for r in records.values() if r["role"] == "worker"]
    servers = [r for r in records.values() if r["role"] == "server"]
    assert len(workers) == 2 and len(servers) == num_servers
    for r in workers:
        assert r["done"] == STEPS  # every step of the survivors
        assert all(math.isfinite(x) for p in r["params"] for x in p)
        assert r["final"] < 0.5 * r["initial"], r  # the loss fell
    assert workers[0]["params"] == workers[1]["params"]  # both pulled the final parameters, after everyone
    for s in servers:
        assert s["dropped"] == [[VICTIM, KILL_AT]]  # worker 1, in its step 5
        # the drop said in our words (which worker, which step, what next), not with gloo's text
        (dropped,) = [line for line in s["warnings"] if "dropped" in line]
        assert f"worker {VICTIM} (rank {num_servers + VICTIM}) is lost at step {KILL_AT}" in dropped, dropped
        assert "go on without it" in dropped and "GLHF" not in dropped and "pair.cc" not in dropped, dropped
        assert s["finite"]
        victim = [step for worker, step, _ in s["staleness"] if worker == VICTIM]
        assert all(step < KILL_AT for step in victim)
        # one update per gradient, as it came: the victim's 5 and 2 x 20
        assert s["updates"] == 2 * STEPS + KILL_AT
        if consistency == "ssp":
            assert max(st for _, _, st in s["staleness"]) <= staleness
            assert sorted(victim) == list(range(KILL_AT))  # every step it pushed before it died
            survivors = {(worker, step) for worker, step, _ in s["staleness"] if worker != VICTIM}
            assert survivors == {(worker, step) for worker in (0, 2) for step in range(STEPS)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_servers", [1, 2])
def test_sync_a_killed_worker_is_an_error_naming_it(tmp_path, num_servers):
    records, killed_at = _run(tmp_path, "sync", 0, num_servers)
    assert len(records) == num_servers + 2
    for rank, r in records.items():
        assert r["lost"] == VICTIM and r["step"] == KILL_AT, r
        assert f"worker {VICTIM} (rank {num_servers + VICTIM})" in r["message"], r["message"]
        assert "GLHF" not in r["message"] and "pair.cc" not in r["message"], r["message"]  # gloo's text: the cause
        if r["role"] == "server":
            assert "Connection" in r["cause"], r["cause"]  # gloo's error, chained
        elapsed = r["at"] - killed_at
        print(f"rank {rank} ({r['role']}): WorkerLostError {elapsed:.2f}s after the SIGKILL")
        assert elapsed < 10, elapsed  # at once in practice; the collective timeout is 100 s
        if r["role"] == "worker":
            assert r["done"] <= KILL_AT + 1  # its last gradient (step 4) may have made step 4 complete


def _every_worker_killed_job(rank, world, directory, consistency):
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    ps = ParameterServer(model, "sgd", lr=0.1, num_servers=1, consistency=consistency,
                         staleness=1 if consistency == "ssp" else 0)
    if ps.role == "server":
        try:
            stats = ps.serve()
        except WorkerLostError as err:
            write_record(directory, rank, role="server", lost=err.worker, message=str(err))
            return
        write_record(directory, rank, role="server", dropped=stats.dropped)  # (the defect: a normal end)
        return
    for step in range(STEPS):
        if step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        ps.pull()
        x, y = _data(1000 * step + ps.worker_index)
        F.mse_loss(model(x), y).backward()
        ps.step()
        model.zero_grad(set_to_none=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("consistency", ["async", "ssp"])
def test_a_server_whose_every_worker_is_lost_raises(tmp_path, consistency):
    """ssp / async go on without a lost worker; with none left the training did not finish, so the server
    raises (its process fails) rather than return as after a completed run."""
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_every_worker_killed_job, 3, args=(str(tmp_path), consistency), timeout=60,
                        collective_timeout=100)
    failed = {r for r in range(3) if f"--- rank {r} failed ---" in str(info.value)}
    assert failed == {1, 2}, str(info.value)
    (server,) = read_records(tmp_path).values()
    assert "lost" in server, server
    assert "every worker is lost" in server["message"] and "worker 0 (rank 1) at step 2" in server["message"] \
        and "worker 1 (rank 2) at step 2" in server["message"], server["message"]
