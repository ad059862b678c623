"""`ParameterServerStrategy`: the trainer over our parameter server (`distributed_training.ps`).

Ranks ``0 .. num_servers - 1`` are servers: they hold the parameters (sharded) and run the optimizer;
the other ``W = world - num_servers`` ranks are workers. The trainer of a worker sees a context of the
workers only (rank ``rank - num_servers`` of ``W``, their own process group), so that data sharding,
the stop agreement, evaluation and the monitor run among the workers and never wait for a server; the
trainer of a server sees a context of the servers only.

A worker's step: the wrapper's first forward after a push pulls the parameters (`ParameterServer.pull`),
backward runs locally (accumulation too: gradients add up until the step), and `optimizer_step` pushes
them (`ParameterServer.step`); the optimizer the user's factory builds on a worker never steps: the
strategy reads its type and hyperparameters and the servers run that optimizer. `fit` on a server runs
the server loop (`serve`) until every worker has finished and returns ``[]``; at the end of a worker's
`fit` (`end_fit`) every worker pulls the final parameters and closes, and the servers put their own
final values into their model (each sends its pieces to the other servers), so that every rank ends
with the same model (`full_state_dict`, `evaluate` on any rank).

A worker that dies (its process killed) under ``"ssp"`` or ``"async"``: the workers' context is
`independent` (`DistributedContext.independent`), so the trainer's workers never meet: the stop on a
signal and the steps per epoch are each worker's own, no peer watch runs, and evaluation runs on each
worker over the whole set with no all-reduce. The servers drop the dead worker, the others train to
the end, and every surviving rank ends with the servers' final values; server 0 tells the workers left
which workers were dropped (`dropped`), and the job's main rank moves to the lowest worker left. Under
``"sync"`` the survivors' and the servers' `fit` raise `WorkerLostError` naming the worker. A signal
reaching a server waits until the workers have left (it then exits as the workers do).

A loop of your own (`train_step` on the workers): call ``trainer.strategy.serve(trainer.model)`` on the
servers and ``trainer.strategy.finish(trainer.model)`` on every worker after its last step.

Checkpoints (`checkpoint_dir`, consistency ``"sync"``): at a checkpoint step the workers end the running
parameter server, every rank saves (`ParameterServer.save_state`: the servers' pieces; ``worker<i>.pt``:
a worker's RNG states and buffers) and the next parameter server continues from the servers' state in
memory; worker 0 tells the servers, waiting after `serve`, what comes next (`CONTROL_TAG`). A resumed
`fit` starts its parameter server from the checkpoint (`load_state`). See docs/parameter_server.md.

Not supported (yet), each refused with an error naming it: checkpoints under ssp / async,
checkpoint_async and checkpoint_shared=False, an LR scheduler, gradient clipping, fp16 loss scaling,
pipeline / tensor parallelism, weight decay, and optimizers other than SGD (momentum, no Nesterov, no
dampening) and Adam (AdamW without weight decay).
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import load_file, save_file
from ..checkpoint_shards import StateLayout
from ..comm.collectives import broadcast_coalesced
from ..logs import get_logger
from ..mesh import Mesh
from ..runtime import DistributedContext
from .base import OptimizerFactory, Strategy

__all__ = ["ParameterServerStrategy", "ParameterServerModel", "server_optimizer"]

log = get_logger()

FINAL_TAG = 1010  # server -> servers: its pieces of the final parameters (beside the ps protocol's tags 1001 .. 1005)
CONTROL_TAG = 1011  # worker 0 -> servers, with checkpoints: what the next parameter server does (start, save, done)
DROPPED_TAG = 1012  # server 0 -> the workers left: which workers the servers dropped (ssp / async)


@dataclass
class _RoleContext(DistributedContext):
    """A context over the ranks of one role (the workers, or the servers), with `is_main` given:
    the job's main rank is worker 0 (what it reports is the trained model's)."""

    main: bool = field(default=False, repr=False)

    @property
    def is_main(self) -> bool:
        return self.main


class ParameterServerModel(nn.Module):
    """The user's module (``.module``) and, while training, its `ParameterServer` (``.ps``): a forward
    that follows a push first pulls the parameters."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.ps = None
        self.stale = True  # the parameters are not the servers' latest that this worker may see

    def forward(self, *args, **kwargs):
        self.refresh()
        return self.module(*args, **kwargs)

    def refresh(self) -> None:
        """(Workers) pull the parameters if a push made them out of date."""
        if self.ps is not None and self.ps.role == "worker" and self.stale:
            self.ps.pull()
            self.stale = False


def server_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The `ParameterServer` arguments (``optimizer``, ``lr``, ``momentum``, ``betas``, ``eps``) that
    run `optimizer` (torch's SGD, Adam, or AdamW without weight decay) on the servers; a clear error
    for what the servers cannot run."""
    kind = type(optimizer).__name__
    if type(optimizer) not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        raise NotImplementedError(f"strategy 'parameter_server' runs torch.optim.SGD, Adam or AdamW (without weight "
                                  f"decay) on its servers; the optimizer factory returned {kind}")
    groups = optimizer.param_groups
    keys = ("lr", "momentum", "dampening", "nesterov", "betas", "eps", "weight_decay", "amsgrad", "maximize")
    settings = [{k: g[k] for k in keys if k in g} for g in groups]
    if any(s != settings[0] for s in settings[1:]):
        raise NotImplementedError(f"strategy 'parameter_server': the {kind} has {len(groups)} parameter groups with "
                                  "different settings; the servers run one setting for every parameter")
    s = {k: (float(v) if torch.is_tensor(v) else v) for k, v in settings[0].items()}
    unsupported = [f"{k}={s[k]!r}" for k, off in (("weight_decay", 0), ("dampening", 0), ("nesterov", False),
                                                  ("amsgrad", False), ("maximize", False)) if s.get(k, off) != off]
    if unsupported:
        raise NotImplementedError(f"strategy 'parameter_server': {kind}({', '.join(unsupported)}) is not supported by "
                                  "the servers' optimizer (SGD with momentum, Adam)")
    if isinstance(optimizer, torch.optim.SGD):
        return {"optimizer": "sgd", "lr": float(s["lr"]), "momentum": float(s["momentum"])}
    return {"optimizer": "adam", "lr": float(s["lr"]), "betas": tuple(float(b) for b in s["betas"]),
            "eps": float(s["eps"])}


class ParameterServerStrategy(Strategy):
    """Parameters and optimizer on `num_servers` server ranks; the other ranks compute gradients.

    Args:
        num_servers: server ranks (``1 .. world - 1``).
        consistency: ``"sync"`` (equal to data parallelism), ``"ssp"`` (a worker at most `staleness`
            steps ahead of the slowest) or ``"async"`` (each gradient applied on arrival).
        staleness: the bound of ``"ssp"``.
        sparse_embeddings: names of `nn.Embedding` weights whose pushes carry only the rows a step's
            gradient touched (a table built with ``sparse=True`` gives sparse gradients; a dense
            gradient sends the whole table). Pulls move the whole table: the trainer does not know a
            batch's ids before its forward.

    See the module docstring.
    """

    name = "parameter_server"
    replicas_meet = False  # workers talk to the servers only: a dead worker must not stop the others
    member = "worker"  # the trainer's context on a worker: rank = worker index (monitor labels)

    def __init__(self, num_servers: int = 1, consistency: str = "sync", staleness: int = 0,
                 sparse_embeddings: Sequence[str] = ()) -> None:
        if not isinstance(num_servers, int) or isinstance(num_servers, bool) or num_servers < 1:
            raise ValueError(f"num_servers must be a positive integer, got {num_servers!r}")
        from ..ps.parameter_server import check_consistency  # the ps package sits above the strategies

        check_consistency(consistency, staleness)
        if isinstance(sparse_embeddings, str) or not all(isinstance(n, str) for n in sparse_embeddings):
            raise TypeError(f"sparse_embeddings must be a sequence of parameter names, got {sparse_embeddings!r}")
        self.num_servers, self.consistency, self.staleness = num_servers, consistency, staleness
        self._batch_count: float | None = None  # this step's (`set_batch_count`), sent with its push
        self.sparse_embeddings = tuple(sparse_embeddings)
        self.is_server = False
        self.trains = True
        self._ps_group = None  # the gloo group of the ps messages (None: the default group is gloo)
        self._workers_group = None  # the workers' process group (`setup_context`)
        self._settings: dict[str, Any] | None = None
        self.last_stats = None  # (servers) the `ServerStats` of the last `serve`
        self.dropped: list[int] = []  # the workers lost and dropped so far (ssp / async), as server 0 saw them
        self._context: _RoleContext | None = None  # this rank's role's context (`setup_context`)
        self._checkpoints = False  # the trainer checkpoints: worker 0 tells the servers what comes next
        self._resume_path: str | None = None  # (workers) a checkpoint the next parameter server starts from

    # ------------------------------------------------------------ setup
    def check_trainer_options(self, options: dict[str, Any]) -> None:
        """Refuse the trainer options the parameter server does not run (yet), naming the first."""
        checkpoints = options.get("checkpoint_dir") is not None
        for name, value, why in (
                ("checkpoint_dir", checkpoints and self.consistency != "sync",
                 f"the trainer checkpoints consistency='sync' only (consistency={self.consistency!r}): a checkpoint "
                 "step stops every worker at the same step"),
                ("checkpoint_async", checkpoints and bool(options.get("checkpoint_async")),
                 "the servers write their state at the checkpoint step, between two parameter-server runs"),
                ("checkpoint_shared", checkpoints and options.get("checkpoint_shared") is False,
                 "the servers and workers write into one directory shared by every rank"),
                ("lr_scheduler", options.get("lr_scheduler") is not None,
                 "the servers run a constant learning rate (no schedule is sent with the pushes yet)"),
                ("gradient_clip_val", options.get("gradient_clip_val") is not None,
                 "the global gradient norm exists only on the servers, after the workers' gradients are averaged"),
                ("mixed_precision", options.get("mixed_precision") == "fp16",
                 "fp16's loss scaling would have to be undone before the push (use 'bf16' or fp32)"),
                ("compile", options.get("compile") not in (None, False), "not tried yet")):
            if value:
                raise NotImplementedError(f"{name} with strategy 'parameter_server' is not supported: {why}")
        self._checkpoints = checkpoints

    def setup_context(self, context: DistributedContext) -> DistributedContext:
        """This rank's role's context: the workers' (rank ``rank - num_servers`` of ``W``) or the
        servers'. Collective over the job: creates the two role groups (and a gloo group for the
        messages when the job's backend is not gloo)."""
        world, rank, s = context.world_size, context.rank, self.num_servers
        if not s < world:
            raise ValueError(f"num_servers={s} leaves no worker in a world of {world} rank(s): num_servers must be in "
                             f"[1, {world - 1}]" if world > 1 else
                             f"strategy 'parameter_server' needs at least 2 ranks (num_servers={s} servers and a "
                             f"worker), got a world of {world}")
        if context.group is not None:
            raise NotImplementedError("strategy 'parameter_server' runs on the job's default process group "
                                      "(a context over a sub-group is not supported)")
        servers = dist.new_group(list(range(s)))
        workers = dist.new_group(list(range(s, world)))
        self._ps_group = None if context.backend == "gloo" else dist.new_group(backend="gloo")
        self._workers_group = workers
        self.is_server = rank < s
        self.trains = not self.is_server
        group, size, role_rank = (servers, s, rank) if self.is_server else (workers, world - s, rank - s)
        mesh = Mesh(size, group=group, rank=role_rank, ranks_per_node=max(1, min(context.local_world_size, size)))
        # Under ssp / async the workers never meet (only the servers hear from them): a worker that
        # dies is dropped by the servers, and nothing of the trainer's waits for it.
        self._context = _RoleContext(rank=role_rank, world_size=size, local_rank=context.local_rank,
                                     local_world_size=context.local_world_size, device=context.device,
                                     backend=context.backend, group=group, mesh=mesh,
                                     independent=not self.is_server and self.consistency != "sync",
                                     main=not self.is_server and role_rank == 0)
        return self._context

    def setup_module(self, module: nn.Module, context: DistributedContext) -> nn.Module:
        # Every rank starts from the job's rank 0's values (the servers' copy is where training starts).
        with torch.no_grad():
            broadcast_coalesced(list(module.parameters()) + list(module.buffers()), 0, None)
        return ParameterServerModel(module)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer | OptimizerFactory,
                        model: nn.Module) -> torch.optim.Optimizer:
        """Build the user's optimizer (it never steps: the trainer reads its learning rate) and take
        its settings for the servers."""
        built = super().setup_optimizer(optimizer, model)
        self._settings = server_optimizer(built)
        held = {id(p) for group in built.param_groups for p in group["params"]}
        module = getattr(model, "module", model)
        left = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in held]
        if left:  # (the same model and factory on every rank: every rank raises alike)
            # Once every rank is here: a rank that raised and ended while a peer was still inside the
            # collectives before (its role group's connections, the start's broadcast) left that peer gloo's
            # "Connection closed by peer" instead of this error (seen under load in CI).
            dist.barrier(group=self._ps_group)
            raise ValueError(f"strategy 'parameter_server': the optimizer leaves out {len(left)} of the model's "
                             f"parameters that require a gradient (first: '{left[0]}'), but the servers train "
                             "every parameter that requires one, with the optimizer's settings. To leave them "
                             "untrained, set requires_grad=False on them; or give the optimizer all of them")
        return built

    # ------------------------------------------------------------ the parameter server
    def start(self, model: ParameterServerModel) -> None:
        """Build the `ParameterServer` from the model's current values, if none is running."""
        if model.ps is not None:
            return
        load = None
        if self._checkpoints:  # the servers start from the checkpoint the workers' trainer resumed from
            if self.is_server:
                load = self._receive_control()["load"]
            else:
                load, self._resume_path = self._resume_path, None
                self._send_control({"op": "start", "load": load})
        self._build(model)
        if load is not None:
            model.ps.load_state(load)

    def _build(self, model: ParameterServerModel) -> None:
        from ..ps import ParameterServer  # the ps package sits above the strategies

        model.ps = ParameterServer(model.module, **self._settings, num_servers=self.num_servers,
                                   consistency=self.consistency, staleness=self.staleness,
                                   sparse=self.sparse_embeddings, group=self._ps_group)
        model.stale = True

    def _send_control(self, message: dict[str, Any]) -> None:
        """(Worker 0; the others return) send `message` to every server (`CONTROL_TAG`)."""
        if dist.get_rank() != self.num_servers:
            return
        payload = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        for server in range(self.num_servers):
            dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dst=server, group=self._ps_group,
                      tag=CONTROL_TAG)
            dist.send(payload, dst=server, group=self._ps_group, tag=CONTROL_TAG)

    def _receive_control(self) -> dict[str, Any]:
        """(Servers) the next message of worker 0's `_send_control`."""
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src=self.num_servers, group=self._ps_group, tag=CONTROL_TAG)
        payload = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(payload, src=self.num_servers, group=self._ps_group, tag=CONTROL_TAG)
        return pickle.loads(payload.numpy().tobytes())

    def serve(self, model: ParameterServerModel, stop_requested: Callable[[], int] | None = None):
        """(Servers) run the server loop until every worker has finished or is lost; then put the
        servers' final values into this rank's model (each server sends its pieces to the others) and
        tell the workers left which workers were dropped. Returns the `ServerStats`. `stop_requested`:
        () -> a signal's number this server got (0: none): its replies tell the workers, which stop
        (`stop_requested` on their side) and, on SIGTERM in `fit`, save."""
        if not self.is_server:
            raise RuntimeError("serve() is for the parameter server's server ranks (0 .. num_servers - 1)")
        self.start(model)
        while True:
            ps = model.ps
            stats = ps.serve(stop_requested)
            model.ps = None
            self._take_final_values(ps, model)
            self._tell_dropped(stats.dropped)
            self.last_stats = stats
            if not self._checkpoints:
                return stats
            message = self._receive_control()
            if message["op"] == "done":
                return stats
            # A trainer's checkpoint step: save this run's state, then serve the next run from it.
            ps.save_state(message["path"], meta=message["meta"])
            self._build(model)
            model.ps.continue_from(ps)

    def finish(self, model: ParameterServerModel) -> None:
        """(Workers, every one) pull the final parameters (after every worker's last push), send them to
        the servers (worker 0) and leave the parameter server: its servers' `serve` returns."""
        self._leave(model)
        if self._checkpoints:
            self._send_control({"op": "done"})

    def _leave(self, model: ParameterServerModel):
        """`finish` but the servers' next step; returns the parameter server left."""
        if self.is_server:
            raise RuntimeError("finish() is for the parameter server's workers; servers call serve()")
        ps = model.ps
        if ps is None:
            self.start(model)
            ps = model.ps
        ps.pull(final=True)  # every worker's last push applied: the servers' final values
        ps.close()
        model.ps, model.stale = None, False
        self._hear_dropped(ps.worker_index)
        return ps

    # ------------------------------------------------------------ the end of a parameter server's run
    def _take_final_values(self, ps, model: ParameterServerModel) -> None:
        """(Servers, after `serve`) this server's final pieces into its model, and every other server's:
        each sends its pieces (fp32, in plan order) to the others; no worker takes part, so the workers
        left after a drop (even of worker 0) have nothing to do with it. The workers' final pull got
        the same values: nothing is applied after it is answered."""
        plan, me = ps.plan, dist.get_rank()
        params = dict(model.module.named_parameters())
        mine = [ps.server_values[piece.name].reshape(-1) for piece in plan.pieces[me]]
        flat = torch.cat(mine) if mine else torch.empty(0)
        works, received = [], {me: flat}
        for server in range(self.num_servers):
            if server == me:
                continue
            received[server] = torch.empty(sum(piece.numel for piece in plan.pieces[server]), dtype=torch.float32)
            if received[server].numel():
                works.append(dist.irecv(received[server], src=server, group=self._ps_group, tag=FINAL_TAG))
            if flat.numel():
                works.append(dist.isend(flat, dst=server, group=self._ps_group, tag=FINAL_TAG))
        for work in works:
            work.wait()
        with torch.no_grad():
            for server, values in received.items():
                at = 0
                for piece in plan.pieces[server]:
                    param = params[piece.name]
                    piece.view(param.data).copy_(values[at : at + piece.numel].view(piece.local_shape))
                    at += piece.numel

    def _tell_dropped(self, dropped: list[tuple[int, int]]) -> None:
        """(Server 0, after `serve`) send every worker it did not drop a flag per worker: 1 for a worker
        dropped (ssp / async: lost, its process gone). A worker that died after closing is skipped."""
        if dist.get_rank() != 0:
            return
        workers = dist.get_world_size() - self.num_servers
        lost = {worker for worker, _ in dropped}
        flags = torch.tensor([1 if w in lost else 0 for w in range(workers)], dtype=torch.int64)
        works = [dist.isend(flags, dst=self.num_servers + w, group=self._ps_group, tag=DROPPED_TAG)
                 for w in range(workers) if w not in lost]
        for work in works:
            try:
                work.wait()
            except RuntimeError:
                pass  # that worker is gone since it closed: nothing waits for it any more

    def _hear_dropped(self, index: int) -> None:
        """(Workers, after `close`) which workers the servers dropped (server 0's `_tell_dropped`). The
        job's main rank (logs, `full_state_dict`, dtrain's output) moves to the lowest worker left."""
        flags = torch.empty(dist.get_world_size() - self.num_servers, dtype=torch.int64)
        dist.recv(flags, src=0, group=self._ps_group, tag=DROPPED_TAG)
        dropped = [w for w, flag in enumerate(flags.tolist()) if flag]
        new = [w for w in dropped if w not in self.dropped]
        self.dropped = sorted(set(self.dropped) | set(dropped))
        if self._context is not None and self.dropped:
            first = min(w for w in range(flags.numel()) if w not in self.dropped)
            self._context.main = index == first
            if new and index == first:
                log.warning("parameter server: worker(s) %s died during training and were dropped by the servers "
                            "(consistency=%r); the %d others trained to the end (worker %d now reports)",
                            ", ".join(map(str, new)), self.consistency, flags.numel() - len(self.dropped), first)

    def end_fit(self, model: ParameterServerModel) -> None:
        if not self.is_server:
            self.finish(model)

    # ------------------------------------------------------------ steps
    def optimizer_step(self, model: ParameterServerModel, optimizer: torch.optim.Optimizer, precision,
                       max_grad_norm: float | None = None) -> tuple[bool, torch.Tensor | None]:
        """Push this step's gradients to the servers (the local optimizer never steps)."""
        if model.ps is None:
            self.start(model)
        if model.stale:  # a step without a forward: its parameters were never pulled
            model.refresh()
        model.ps.step(self._batch_count)
        self._batch_count = None
        model.stale = True
        return True, None

    def stop_requested(self, model: ParameterServerModel) -> tuple[int, int] | None:
        """(Workers) (server, signal number) when a server said it got a signal, else None."""
        return None if self.is_server or model.ps is None else model.ps.stop_signal

    @property
    def wants_batch_count(self) -> bool:
        # sync weighs each worker's gradient by its batch's count; so does ssp at staleness 0, which
        # waits for every worker's step as sync does (its servers' non-eager path): sync bit for bit.
        return self.consistency == "sync" or (self.consistency == "ssp" and self.staleness == 0)

    def set_batch_count(self, model: ParameterServerModel, count: float | None) -> None:
        self._batch_count = count

    def model_state_dict(self, model: ParameterServerModel) -> dict[str, Any]:
        """The module's state; a worker in the middle of training pulls the latest parameters first."""
        model.refresh()
        return model.module.state_dict()

    def evaluate_batch(self, model: ParameterServerModel, batch, criterion, metrics):
        model.refresh()  # evaluation calls the module itself: the latest parameters first
        return None

    def state_layout(self, model, optimizer):
        """Nothing for the trainer's writer: the servers write their pieces (`save_checkpoint_files`);
        the shapes of the trained parameters."""
        if not self._checkpoints:
            raise NotImplementedError("checkpoints with strategy 'parameter_server' are written at fit's checkpoint "
                                      "steps (checkpoint_dir, checkpoint_every): save_checkpoint / load_checkpoint "
                                      "need the trainer's checkpoint_dir; a ParameterServer of your own loop can "
                                      "(save_state / load_state)")
        named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
        return StateLayout(shapes={n: tuple(p.shape) for n, p in named}, params=[], optimizer=[])

    def save_checkpoint_files(self, model: ParameterServerModel, path: str, part: dict[str, Any],
                              meta: dict[str, Any]) -> bool:
        """(Workers, every one, between two steps of `fit`) end the running parameter server (final pull),
        write ``worker<i>.pt`` (`part`: RNG states, buffers), have the servers save their state into
        `path` with the trainer's `meta` (`ParameterServer.save_state`: ``rank<s>.pt``, ``meta.pt``), and
        start the next parameter server from the servers' state in memory: the next step is an unbroken
        run's."""
        self.state_layout(model, None)  # refuses without the trainer's checkpoint_dir
        if model.ps is None:
            raise RuntimeError("save_checkpoint with strategy 'parameter_server' saves between two steps of fit "
                               "(checkpoint_every, save_on_preemption): the servers save while they serve")
        index = dist.get_rank() - self.num_servers
        os.makedirs(path, exist_ok=True)
        name = f"worker{index}.pt"
        digest = save_file(part, os.path.join(path, name))
        ps = self._leave(model)  # first: a worker lost since its last push is named here (WorkerLostError)
        digests: list = [None] * (dist.get_world_size() - self.num_servers)
        dist.all_gather_object(digests, (name, digest), group=self._workers_group)
        self._send_control({"op": "save", "path": path, "meta": {**meta, "checksums": dict(digests)}})
        ps.save_state(path)
        self._build(model)
        model.ps.continue_from(ps)
        return True

    def load_checkpoint_files(self, model: ParameterServerModel, path: str, meta: dict[str, Any]) -> dict[str, Any]:
        """(Workers, every one; the servers wait in `serve`) start the next parameter server from `path`
        (the servers read their pieces: `load_state`); returns this worker's ``worker<i>.pt`` (RNG states,
        buffers) when the checkpoint has one for as many workers, else ``{}``."""
        self.state_layout(model, None)
        if model.ps is not None:
            raise RuntimeError("load_checkpoint with strategy 'parameter_server': load before the first step (a "
                               "parameter server is running)")
        self._resume_path = path
        self.start(model)  # now (the servers load it too): the first forward pulls the checkpoint's parameters
        workers = dist.get_world_size() - self.num_servers
        name = f"worker{dist.get_rank() - self.num_servers}.pt"
        digest = meta.get("checksums", {}).get(name)
        if digest is None or len((meta.get("ps") or {}).get("worker_steps") or []) != workers:
            return {}
        return load_file(os.path.join(path, name), digest)

    def planner_kind(self) -> str:
        return "ddp"

