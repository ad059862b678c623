"""A restarted worker takes its old place in a running parameter server (``ssp`` and ``async``).

The servers drop a worker whose process died and go on (docs/parameter_server.md, Faults). A new process
for that worker cannot enter the job's process group (its world is fixed), so it meets the servers in the
job's rendezvous store instead: it asks under ``dt_ps/join/<worker>`` (a counter: each attempt has a number
of its own), each server's watcher counts itself in once it knows the worker is lost, and the servers and
the new process build a gloo group of their own (servers at ranks ``0 .. S - 1``, the worker at ``S``),
on which that worker's messages travel from then on. Its first message (`JOIN`) tells it where to continue:
the steps it had pushed before it died, and under ``ssp`` at least the step of the slowest worker still
training (with a bound of 0: the servers' newest version).

A script that may be such a restart::

    from distributed_training.ps import ParameterServer, job_store, rejoin

    if restarted:                                   # the scheduler says so (an attempt count, say)
        ps = rejoin(model, worker=rank - num_servers, store=job_store())
    else:
        dist.init_process_group("gloo")
        ps = ParameterServer(model, "sgd", lr=0.1, num_servers=num_servers, consistency="async")
    for step in range(ps.worker_step, steps):       # a rejoined worker starts at its step
        ...

The rejoined worker trains, pulls the final parameters and closes as any other; collectives over the whole
job (`save_state`, `load_state`) are not open to it (it is not in the job's group).
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from datetime import timedelta

import torch.distributed as dist
from torch import nn

from .parameter_server import ParameterServer, _plan, join_store
from .worker import Worker

__all__ = ["rejoin", "job_store"]


def job_store(timeout: float = 300.0) -> dist.Store:
    """A client of the job's rendezvous store from ``MASTER_ADDR`` / ``MASTER_PORT`` (what torchrun and
    ``init_process_group("gloo")`` with ``env://`` use)."""
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise RuntimeError(f"job_store: {', '.join(missing)} not set: give rejoin(store=...) the job's store")
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:  # (TCPStore's own connect retries a refused port for the whole timeout: a trial waited 300 s)
        socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
                                 timeout=min(timeout, 10.0)).close()
    except OSError as err:
        raise RuntimeError(f"job_store: the job's rendezvous store at {address} cannot be reached ({err}): the job "
                           "has ended (its store goes with the process that hosts it), or the address is wrong") \
            from None
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=timeout))
    except dist.DistNetworkError as err:
        raise RuntimeError(f"job_store: the job's rendezvous store at {address} cannot be reached ({err}): the job "
                           "has ended (its store goes with the process that hosts it), or the address is wrong") \
            from None


def _check_model(model: nn.Module, shapes: dict[str, tuple] | None) -> None:
    """Refuse a model whose trained parameters are not the job's (names and shapes), naming the first
    difference: its messages would not fit the servers' pieces."""
    if shapes is None:
        return
    mine = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    for name in sorted(set(mine) | set(shapes)):
        if mine.get(name) != shapes.get(name):
            raise ValueError(f"rejoin: the model's trained parameter {name!r} is {mine.get(name, 'missing')}, the "
                             f"job's is {shapes.get(name, 'missing')}: build the same model (and freeze the same "
                             "parameters) as the job's workers")


def rejoin(model: nn.Module, worker: int, store: dist.Store, *, timeout: float = 300.0) -> ParameterServer:
    """(A restarted worker's process; no process group needed) take worker `worker`'s place in the running
    parameter server whose job's rendezvous store is `store` (`job_store()`, or the job's `FileStore`).

    `model`: the same architecture as the job's (its values come from the servers at the first pull).
    Returns a worker's `ParameterServer` whose ``worker_step`` is where the worker continues.

    Raises:
        ValueError: `worker` is not a worker index of the job, `model`'s trained parameters differ from
            the job's (names, shapes), or its consistency is ``"sync"`` (every worker's gradient of every
            step: a lost worker ended that training).
        TimeoutError: the servers did not take the worker back within `timeout` seconds: they do not
            know it as lost (its old process still runs), or the training has ended. The attempt is
            withdrawn: a later one is not held up by it.
        RuntimeError: the store cannot be reached (under env:// the job's rank 0 hosts it: the job has
            ended, after a sync job's lost worker too).

    Start the new process once the old one is gone (a frozen process still holds its connections, so the
    servers do not know it as lost).
    """
    try:
        return _rejoin(model, worker, store, timeout)
    except dist.DistNetworkError as err:
        raise RuntimeError(f"rejoin: the job's rendezvous store cannot be reached ({err}): the job has ended (its "
                           "store goes with the process that hosts it, rank 0 under env://), or this is not its "
                           "address") from None


def _rejoin(model: nn.Module, worker: int, store: dist.Store, timeout: float) -> ParameterServer:
    joins = join_store(store)
    deadline = time.monotonic() + timeout
    while not joins.check(["settings"]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rejoin: no parameter server's settings in the store within {timeout:.0f} s "
                               "(is it the job's store, and has a parameter server started?)")
        time.sleep(0.1)
    settings = pickle.loads(joins.get("settings"))
    num_servers, num_workers, consistency = settings["num_servers"], settings["num_workers"], settings["consistency"]
    if consistency == "sync":
        raise ValueError("rejoin: the parameter server runs consistency='sync', which does not take a worker back "
                         "(a lost worker ends the training); ssp and async do")
    if not isinstance(worker, int) or isinstance(worker, bool) or not 0 <= worker < num_workers:
        raise ValueError(f"rejoin: worker must be an index in [0, {num_workers - 1}], got {worker!r}")
    _check_model(model, settings.get("shapes"))
    attempt = joins.add(f"join/{worker}", 1)
    prefix = f"join/{worker}/{attempt}"
    while joins.add(prefix + "/accepted", 0) < num_servers:
        if time.monotonic() > deadline:
            joins.set(prefix + "/withdrawn", "1")  # a server that finds the worker lost later skips it
            raise TimeoutError(f"rejoin: the servers did not take worker {worker} back within {timeout:.0f} s: "
                               "they do not know it as lost (is its old process still running?), or the "
                               "training has ended")
        time.sleep(0.1)
    pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, joins), num_servers, num_servers + 1,
                               timedelta(seconds=timeout))
    params, plan = _plan(model, num_servers, settings["sparse"])
    ps = ParameterServer._rejoined(model, plan, settings)
    ps._worker = Worker(params, plan, worker, pg)
    ps._worker.join(consistency)
    return ps
