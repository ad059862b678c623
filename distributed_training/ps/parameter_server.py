"""`ParameterServer`: one object, built on every rank, that is a server or a worker by rank."""

from __future__ import annotations

import os
import pickle
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import CheckpointMismatchError, load_file, read_meta, save_file, write_meta
from ..checkpoint_shards import FORMAT, Sources, summary
from .protocol import gloo_group, process_group
from .server import Server, ServerStats
from .sharding import ShardPlan, plan_shards
from .state import ServerState, meta_of, rank_path, worker_step
from .worker import Worker

__all__ = ["ParameterServer"]

CONSISTENCIES = ("sync", "ssp", "async")
OPTIMIZERS = ("sgd", "adam")


def check_consistency(consistency: str, staleness: int) -> None:
    """Raise for a `consistency` / `staleness` pair the parameter server does not run, naming it."""
    if consistency not in CONSISTENCIES:
        raise ValueError(f"consistency must be one of {CONSISTENCIES}, got {consistency!r}")
    if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
        raise ValueError(f"staleness must be an integer >= 0, got {staleness!r}")
    if staleness and consistency != "ssp":
        raise ValueError(f"staleness applies to consistency='ssp' only (consistency={consistency!r})")


def _plan(model: nn.Module, num_servers: int, sparse: Sequence[str]) -> tuple[dict, ShardPlan]:
    """The trained parameters of `model` by name, and their shard plan over `num_servers` servers
    (embedding tables found, `sparse` ones and those built with ``sparse=True`` as sparse tables)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    tables, sparse_tables = [], []
    for module_name, module in model.named_modules():
        name = f"{module_name}.weight" if module_name else "weight"
        if isinstance(module, nn.Embedding) and name in params:
            tables.append(name)
            if module.sparse or name in sparse:
                sparse_tables.append(name)
    for name in sparse:
        if name not in tables:
            raise ValueError(f"sparse: {name!r} is not the weight of an nn.Embedding that is trained "
                             f"(tables: {tables})")
    plan = plan_shards([(n, p.shape) for n, p in params.items()], num_servers, tables=tables, sparse=sparse_tables)
    return params, plan


def join_store(store: dist.Store | None = None) -> dist.Store | None:
    """The keys of rejoins: under ``dt_ps/`` in `store` (default: the job's rendezvous store, found under
    the default group's prefixes; None when there is none)."""
    if store is None:
        try:
            store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, ValueError):
            return None
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
    return dist.PrefixStore("dt_ps", store)


class ParameterServer:
    """Train `model` with its parameters (and optimizer) on `num_servers` server ranks.

    Ranks ``0 .. num_servers - 1`` are servers: they call `serve` and nothing else. The other ranks are
    workers (worker index ``rank - num_servers``); a worker's loop is::

        for batch in batches:
            ps.pull(rows={"emb.weight": batch_ids})   # parameters (only these rows of a sparse table)
            loss = loss_fn(model(batch), ...)
            loss.backward()
            ps.step()                                  # push the gradients; next step
            model.zero_grad()
        ps.pull(final=True)                            # optional: the final parameters, after everyone
        ps.close()

    A worker whose process dies (its connection closes) is dropped under ``"ssp"`` and ``"async"``: the
    others go on to the end and the servers' `ServerStats.dropped` records it. Under ``"sync"`` the
    servers and the other workers raise `WorkerLostError` naming it (see docs/parameter_server.md).

    Args:
        model: the same model (same initial values) on every rank; the servers start from their copy.
            Parameters that do not require a gradient stay on each rank and are not trained.
        optimizer: ``"sgd"`` (with `momentum`) or ``"adam"`` (`betas`, `eps`), run by the servers.
        lr: learning rate.
        momentum: SGD's momentum.
        betas, eps: Adam's.
        num_servers: server ranks (at least one worker must remain).
        consistency: ``"sync"`` (every step's gradients before the next step: data parallel), ``"ssp"``
            (a worker runs at most `staleness` steps ahead of the slowest), or ``"async"`` (each gradient
            applied on arrival, scaled by ``1 / num_workers``).
        staleness: the bound of ``"ssp"`` (0 is ``"sync"``).
        sparse: names of `nn.Embedding` weights to treat as sparse tables, besides those built with
            ``sparse=True``: their pushes and pulls move only the rows a step touches.
        group: a gloo process group over all ranks (default: the default group when it is gloo, else a
            new gloo group: building the object is then collective).
        store: where a restarted worker asks to rejoin (`distributed_training.ps.rejoin`; ssp and async):
            default the job's rendezvous store (the one under the default group's prefixes); False: no
            rejoins.
        join_timeout: seconds a rejoining worker and the servers wait for each other (the timeout of
            the group built for it).

    Attributes:
        plan: the `ShardPlan` (``plan.report()``: bytes per server, max / mean).
        role: ``"server"`` or ``"worker"``.
        num_workers: ``world_size - num_servers``.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: str = "sgd",
        *,
        lr: float,
        momentum: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        num_servers: int = 1,
        consistency: str = "sync",
        staleness: int = 0,
        sparse: Sequence[str] = (),
        group: dist.ProcessGroup | None = None,
        store: dist.Store | bool | None = None,
        join_timeout: float = 300.0,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ParameterServer needs an initialised process group (init_process_group)")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        check_consistency(consistency, staleness)
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr!r}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if momentum and optimizer != "sgd":
            raise ValueError(f"momentum applies to optimizer='sgd' only (optimizer={optimizer!r})")
        world = dist.get_world_size()
        if not isinstance(num_servers, int) or isinstance(num_servers, bool) or not 1 <= num_servers < world:
            raise ValueError(f"num_servers must be an integer in [1, {world - 1}] (world size {world} needs at "
                             f"least one worker), got {num_servers!r}")
        self.model = model
        self.consistency, self.staleness = consistency, staleness
        self.num_servers, self.num_workers = num_servers, world - num_servers
        self.group = group if group is not None else gloo_group()
        rank = dist.get_rank()
        self.role = "server" if rank < num_servers else "worker"

        params, self.plan = _plan(model, num_servers, sparse)
        joins = None if store is False else join_store(store)
        self._server: Server | None = None
        self._worker: Worker | None = None
        if self.role == "server":
            self._server = Server(self.plan.pieces[rank], params, num_workers=self.num_workers,
                                  consistency=consistency, staleness=staleness, optimizer=optimizer, lr=lr,
                                  momentum=momentum, betas=betas, eps=eps, group=self.group,
                                  worker_ranks=list(range(num_servers, world)), joins=joins, index=rank,
                                  num_servers=num_servers, join_timeout=join_timeout)
            if rank == 0 and joins is not None:  # what a restarted worker needs to know (ps.rejoin)
                joins.set("settings", pickle.dumps({"num_servers": num_servers, "num_workers": self.num_workers,
                                                    "consistency": consistency, "staleness": staleness,
                                                    "sparse": [n for n, ps in self.plan.tables.items()
                                                               if ps[0].sparse],
                                                    "shapes": {n: tuple(p.shape) for n, p in params.items()}}))
        else:
            self._worker = Worker(params, self.plan, rank - num_servers, process_group(self.group))

    @classmethod
    def _rejoined(cls, model: nn.Module, plan: ShardPlan, settings: dict) -> ParameterServer:
        """A worker's object outside the job's group (`ps.rejoin` gives it its `Worker`)."""
        ps = cls.__new__(cls)
        ps.model, ps.plan, ps.role, ps.group = model, plan, "worker", None
        ps.consistency, ps.staleness = settings["consistency"], settings["staleness"]
        ps.num_servers, ps.num_workers = settings["num_servers"], settings["num_workers"]
        ps._server = ps._worker = None
        ps._rejoin = True
        return ps

    _rejoin = False  # built by ps.rejoin: not in the job's process group

    # ---------------------------------------------------------------- servers
    def serve(self, stop_requested: Callable[[], int] | None = None) -> ServerStats:
        """(Server ranks) run the server loop until every worker has closed or is lost; return its
        `ServerStats`. Raises `WorkerLostError` under ``"sync"`` when a worker is lost. `stop_requested`:
        () -> the number of a signal this process got (0: none), which pull replies then tell the
        workers (`stop_signal`)."""
        if self._server is None:
            raise RuntimeError(f"serve() is for server ranks (0 .. {self.num_servers - 1}); this rank is a worker")
        self._server.stop_requested = stop_requested
        return self._server.serve()

    @property
    def stop_signal(self) -> tuple[int, int] | None:
        """(Workers) (server, signal number) when a server's replies said it got a signal, else None."""
        return None if self._worker is None else self._worker.stop_signal

    @property
    def server_values(self) -> dict[str, torch.Tensor]:
        """(Server ranks) this server's fp32 pieces by parameter name (rows ``start::stride`` of a split table)."""
        return self._need_server().values

    # ---------------------------------------------------------------- checkpoints
    def save_state(self, path: str | os.PathLike, meta: dict | None = None) -> None:
        """Write the servers' state into the checkpoint directory `path`, in the one checkpoint format
        (`distributed_training.checkpoint_shards`; see `distributed_training.ps.state`): each server its
        pieces of the parameters and of their optimizer state (``rank<i>.pt``), rank 0 ``meta.pt``.
        Collective over every rank of the job, called between runs: after the workers' `close` and
        the servers' `serve`, or before any step. `meta` (read on rank 0): more entries of ``meta.pt``
        (a trainer's epoch and data position; ``checksums`` of files others wrote into `path`)."""
        self._need_job_group("save_state")
        path = os.fspath(path)
        rank = dist.get_rank()
        if rank == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier(group=self.group)
        mine: tuple = ("", {"params": {}, "optim": {}, "optim_scalars": []}, None, None, None)
        if self._server is not None:
            state = ServerState(self.plan, self._server)
            packed = state.pack()
            digest = save_file(packed, rank_path(path, rank))
            mine = (digest, summary(packed), packed["param_groups"], self._server.version, None)
        else:
            mine = ("", mine[1], None, None, self._worker.step)
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine, group=self.group)
        if rank == 0:
            shapes = ServerState(self.plan, self._server).layout.shapes
            extra = dict(meta or {})
            written = meta_of([e[1] for e in every], shapes, every[0][2], version=every[0][3],
                              worker_steps=[e[4] for e in every[self.num_servers:]], num_servers=self.num_servers,
                              consistency=self.consistency)
            written["checksums"] = {**extra.pop("checksums", {}),
                                    **{f"rank{r}.pt": e[0] for r, e in enumerate(every) if r < self.num_servers}}
            write_meta({**extra, **written}, path)
        dist.barrier(group=self.group)

    def load_state(self, path: str | os.PathLike) -> int:
        """Start from the checkpoint at `path` (collective over every rank, before the first step): the
        servers read the elements they hold, with their optimizer state, from whichever files hold them
        (written by servers of any plan, or by another strategy's trainer), and take the saved version;
        each worker takes its saved step. Returns the checkpoint's step."""
        self._need_job_group("load_state")
        path = os.fspath(path)
        meta = read_meta(path)
        if meta.get("checkpoint_format") != FORMAT:
            raise CheckpointMismatchError(f"checkpoint {path!r}: format {meta.get('checkpoint_format')!r}, "
                                          f"this version reads {FORMAT!r}")
        if self._server is not None:
            if self._server.version:
                raise RuntimeError("load_state: this parameter server has already applied updates; load a "
                                   "checkpoint into a new one, before its first step")
            checksums = meta.get("checksums", {})
            cache: dict[int, dict] = {}

            def read(k: int) -> dict:
                if k not in cache:
                    cache[k] = load_file(rank_path(path, k), checksums.get(f"rank{k}.pt"))
                return cache[k]

            try:
                ServerState(self.plan, self._server).load(meta, Sources(read, dist.get_rank()))
            except (RuntimeError, ValueError, KeyError) as err:
                raise type(err)(f"checkpoint {path!r} does not fit this parameter server: {err}") from None
        else:
            if self._worker.step:
                raise RuntimeError("load_state: this worker has already stepped; load a checkpoint into a new "
                                   "parameter server, before its first step")
            self._worker.step = worker_step(meta, self._worker.index)  # the servers' gate counts from it too
        dist.barrier(group=self.group)
        return int(meta["step"])

    def continue_from(self, previous: ParameterServer) -> None:
        """Continue where `previous` (the same plan, its run over: workers closed, servers served) stopped:
        a server takes its values, optimizer state and version (in memory, copied), a worker its step;
        as `load_state` from a checkpoint `previous` saved would. Call it before the first step."""
        if previous.plan.pieces != self.plan.pieces or previous.role != self.role:
            raise ValueError("continue_from: the previous parameter server has another shard plan or role")
        if self._server is not None:
            old, new = previous._server, self._server
            if new.version:
                raise RuntimeError("continue_from: this parameter server has already applied updates")
            with torch.no_grad():
                for name, value in old.values.items():
                    new.values[name].copy_(value)
            new.optim.load_piece_state(old.optim.piece_state())  # load_piece_state copies
            # a step-aggregated server (sync) takes the version as the next step to apply: after async or ssp
            # (s >= 1), one update a gradient, no further than the workers' step (as `load_state` does)
            new.version = old.version if new.eager else min(old.version, max(old.pushed, default=0))
            new.pulled_version = [new.version] * new.num_workers
            new.pushed = list(old.pushed)
            new.pulled_clock = [min(old.pushed, default=0)] * new.num_workers
        else:
            if self._worker.step:
                raise RuntimeError("continue_from: this worker has already stepped")
            self._worker.step = previous._worker.step

    # ---------------------------------------------------------------- workers
    def pull(self, rows: dict[str, torch.Tensor] | None = None, *, final: bool = False) -> int:
        """(Workers) fill the model's parameters; return the oldest server version received.
        See `Worker.pull`."""
        return self._need_worker().pull(rows, final=final)

    def push(self, weight: float | None = None) -> None:
        """(Workers) send the model's gradients for the current step (after backward); `weight`: what this
        worker's batch counts (targets kept, or rows), by which ``sync`` weighs its gradient (None: equally)."""
        self._need_worker().push(weight)

    def step(self, weight: float | None = None) -> None:
        """(Workers) push, then go to the next step."""
        worker = self._need_worker()
        worker.push(weight)
        worker.step += 1

    def close(self) -> None:
        """(Workers) leave; returns once every worker has closed (the servers then stop). No-op on a server."""
        if self._worker is not None:
            self._worker.close()

    @property
    def worker_step(self) -> int:
        """(Workers) the step this worker computes next (a rejoined worker's first step)."""
        return self._need_worker().step

    @property
    def worker_index(self) -> int:
        """(Workers) this worker's index, ``rank - num_servers``."""
        return self._need_worker().index

    @property
    def traffic(self) -> dict[str, int]:
        """(Workers) payload bytes so far: push / pull values and row indices."""
        return dict(self._need_worker().traffic)

    @property
    def wait_seconds(self) -> float:
        """(Workers) seconds spent in pulls so far."""
        return self._need_worker().wait_seconds

    @property
    def versions(self) -> list[int]:
        """(Workers) the version each server answered the last pull with."""
        return list(self._need_worker().versions)

    def _need_job_group(self, what: str) -> None:
        if self._rejoin:
            raise RuntimeError(f"{what} is collective over the job's process group, which a rejoined worker "
                               "is not in")

    def _need_worker(self) -> Worker:
        if self._worker is None:
            raise RuntimeError("this is a server rank: pull / push / step are for workers (call serve())")
        return self._worker

    def _need_server(self) -> Server:
        if self._server is None:
            raise RuntimeError("this is a worker rank: server_values is for server ranks")
        return self._server
