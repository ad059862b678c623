"""A parameter-server worker killed mid-run comes back in a new process and trains to the end (issue 19,
item 4: "it rejoins on restart").

1 server x 3 workers. Worker 1 starts a fresh Python process (its restart, a process outside the job's
process group), then SIGKILLs itself at step 5. The server drops it; the new process calls
`distributed_training.ps.rejoin` with the job's store, continues from the step the servers give it and
trains to the end with the others; the survivors wait at step 15 until it is back, so that the rejoin
happens while they train. Checked: the servers' records (dropped, then rejoined at that step), which
gradients were applied (every one of the rejoined worker's steps from its start; under ssp the staleness
bound), and that the survivors and the rejoined worker end with the same final parameters.
"""

from __future__ import annotations

import math
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distributed_training.ps import ParameterServer, rejoin
from distributed_training.ps.parameter_server import join_store
from distributed_training.testing import DistributedTestError, read_records, run_distributed, write_record

STEPS = 20
VICTIM = 1
KILL_AT = 5
WAIT_AT = 15  # the survivors wait here until the victim is back


def _data(seed: int, n: int = 16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, x @ torch.arange(1.0, 9.0).unsqueeze(1) / 8 + 0.5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(8, 1)


def _train(ps, model, w, start, directory, survivor, times=None):
    """Train from `start` to the end; `times` (given): step -> (pull answered, push leaving), one clock
    for every process."""
    done = 0
    for step in range(start, STEPS):
        if survivor and step == WAIT_AT:
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(directory, "rejoined")):
                assert time.monotonic() < deadline, "the victim did not come back"
                time.sleep(0.05)
        ps.pull()
        pulled = time.monotonic()
        x, y = _data(1000 * step + w)
        F.mse_loss(model(x), y).backward()
        if times is not None:
            times[step] = (pulled, time.monotonic())
        ps.step()
        model.zero_grad(set_to_none=True)
        done += 1
    ps.pull(final=True)
    ps.close()
    return done


def _restarted(directory: str, store_path: str, delay: float = 0.0) -> None:
    """The victim's restart: a new process, not in the job's process group; it takes `delay` seconds
    between its rejoin and its first pull (loading its data, say)."""
    torch.set_num_threads(1)
    model = _model()
    ps = rejoin(model, VICTIM, dist.FileStore(store_path, -1), timeout=60)
    start = ps.worker_step
    open(os.path.join(directory, "rejoined"), "w").close()
    time.sleep(delay)
    times = {}
    done = _train(ps, model, VICTIM, start, directory, survivor=False, times=times)
    write_record(directory, 100, role="rejoined", start=start, done=done, times=times,
                 params=[p.detach().reshape(-1).tolist() for p in model.parameters()])


def _job(rank, world, directory, consistency, staleness, num_servers, delay=0.0):
    model = _model()
    ps = ParameterServer(model, "sgd", lr=0.05, num_servers=num_servers, consistency=consistency,
                         staleness=staleness)
    if ps.role == "server":
        stats = ps.serve()
        write_record(directory, rank, role="server", dropped=stats.dropped, rejoined=stats.rejoined,
                     updates=stats.updates, staleness=stats.staleness,
                     finite=all(math.isfinite(x) for v in ps.server_values.values() for x in v.reshape(-1).tolist()))
        return
    w = ps.worker_index
    if w == VICTIM:
        for step in range(KILL_AT):
            ps.pull()
            x, y = _data(1000 * step + w)
            F.mse_loss(model(x), y).backward()
            ps.step()
            model.zero_grad(set_to_none=True)
        store = dist.distributed_c10d._get_default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('ps_rejoin_test', "
                f"{__file__!r}); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
                f"m._restarted({directory!r}, {store.path!r}, {delay!r})")
        with open(os.path.join(directory, "restart.log"), "wb") as log:
            subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    times = {}
    done = _train(ps, model, w, 0, directory, survivor=True, times=times)
    write_record(directory, rank, role="worker", done=done, times=times,
                 params=[p.detach().reshape(-1).tolist() for p in model.parameters()])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("consistency,staleness,num_servers", [("async", 0, 1), ("ssp", 2, 1), ("ssp", 2, 2)])
def test_a_killed_worker_rejoins_from_a_new_process(tmp_path, consistency, staleness, num_servers):
    world, victim_rank = num_servers + 3, num_servers + VICTIM
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_job, world, args=(str(tmp_path), consistency, staleness, num_servers), timeout=90,
                        collective_timeout=100, grace=60)
    failed = {r for r in range(world) if f"--- rank {r} failed ---" in str(info.value)}
    log = (tmp_path / "restart.log").read_text() if (tmp_path / "restart.log").exists() else ""
    assert failed == {victim_rank}, str(info.value) + log  # only the killed rank
    records = read_records(tmp_path)
    survivors = [num_servers, num_servers + 2]  # workers 0 and 2
    assert sorted(records) == [*range(num_servers), *survivors, 100], (records, log)
    back = records[100]
    start = back["start"]
    assert back["done"] == STEPS - start
    for r in survivors:
        assert records[r]["done"] == STEPS
        assert records[r]["params"] == back["params"]  # everyone pulled the same final parameters
    for server in (records[r] for r in range(num_servers)):  # with 2 servers: weight on one, bias on the other
        _check_server(server, consistency, staleness, start)


def _check_server(server, consistency, staleness, start):
    assert server["dropped"] == [[VICTIM, KILL_AT]]
    assert server["rejoined"] == [[VICTIM, start]]
    assert server["finite"]
    applied = [(w, s) for w, s, _ in server["staleness"]]
    victim = sorted(s for w, s in applied if w == VICTIM)
    if consistency == "async":
        assert start == KILL_AT  # where it stopped: the steps it had pushed
        assert victim == list(range(STEPS))  # one gradient per step, before and after the restart
        assert server["updates"] == 3 * STEPS
    else:
        # it does not hold the others back: it starts at the slowest survivor's step at least
        assert KILL_AT <= start <= WAIT_AT
        assert victim == list(range(KILL_AT)) + list(range(start, STEPS))  # each gradient applied as it came
        assert server["updates"] == 2 * STEPS + KILL_AT + STEPS - start
        assert max(s for _, _, s in server["staleness"]) <= staleness
        survivors = {(w, s) for w, s in applied if w != VICTIM}
        assert survivors == {(w, s) for w in (0, 2) for s in range(STEPS)}


@pytest.mark.timeout(150)
def test_ssp_survivors_wait_for_a_rejoined_worker_that_starts_late(tmp_path):
    # The restarted worker is given its start at JOIN, then takes 3 s before its first pull. ssp (s = 2)
    # holds the survivors' pull of step c until it has pushed step c - 3 (from its start on), as for any
    # worker. The servers counted it only from its first request, so the survivors ran the 5 steps left
    # to the end while it waited: their pulls of steps start + 3 .. 19 were answered seconds before it
    # pushed anything (a gap of up to 5 steps where the bound is 2).
    staleness, delay = 2, 3.0
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_job, 4, args=(str(tmp_path), "ssp", staleness, 1, delay), timeout=90,
                        collective_timeout=100, grace=60)
    log = (tmp_path / "restart.log").read_text() if (tmp_path / "restart.log").exists() else ""
    assert f"--- rank {1 + VICTIM} failed ---" in str(info.value), str(info.value) + log
    records = read_records(tmp_path)
    assert sorted(records) == [0, 1, 3, 100], (records, log)
    back = records[100]
    start = back["start"]
    assert KILL_AT <= start <= WAIT_AT and back["done"] == STEPS - start
    pushing = {int(step): t[1] for step, t in back["times"].items()}
    late = [(r, c) for r in (1, 3) for c, (pulled, _) in records[r]["times"].items()
            if int(c) - staleness - 1 >= start and pulled < pushing[int(c) - staleness - 1]]
    assert not late, (start, late)  # (survivor rank, step) answered before the rejoined worker's push
    assert records[1]["params"] == back["params"] == records[3]["params"]
    _check_server(records[0], "ssp", staleness, start)


def test_rejoin_refuses_sync_a_bad_index_another_model_and_times_out(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), -1)
    settings = {"num_servers": 1, "num_workers": 2, "consistency": "sync", "staleness": 0, "sparse": []}
    join_store(store).set("settings", pickle.dumps(settings))  # what server 0 publishes
    with pytest.raises(ValueError, match="consistency='sync', which does not take a worker back"):
        rejoin(nn.Linear(2, 1), 0, store, timeout=1)
    join_store(store).set("settings", pickle.dumps({**settings, "consistency": "async"}))
    with pytest.raises(ValueError, match=r"worker must be an index in \[0, 1\]"):
        rejoin(nn.Linear(2, 1), 2, store, timeout=1)
    with pytest.raises(TimeoutError, match="did not take worker 1 back"):
        rejoin(nn.Linear(2, 1), 1, store, timeout=0.5)
    # the attempt is withdrawn: a server that finds worker 1 lost later skips it (`Server._watch_joins`)
    assert join_store(store).check(["join/1/1/withdrawn"])
    shapes = {"weight": (1, 2), "bias": (1,)}
    join_store(store).set("settings", pickle.dumps({**settings, "consistency": "async", "shapes": shapes}))
    with pytest.raises(ValueError, match=r"trained parameter 'weight' is \(1, 3\), the job's is \(1, 2\)"):
        rejoin(nn.Linear(3, 1), 1, store, timeout=0.5)
