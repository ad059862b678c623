"""The process group and device for one training process, read from torchrun's environment.

torchrun (and every launcher that follows its contract: Kubeflow, SLURM wrappers, our own test
harness) describes a process through environment variables:

    RANK, WORLD_SIZE              this process among all of them
    LOCAL_RANK, LOCAL_WORLD_SIZE  this process among those on its node
    MASTER_ADDR, MASTER_PORT      where rank 0's TCP store listens

`init_distributed()` reads them, picks NCCL with one GPU per process when CUDA is present and gloo
otherwise, and returns a `DistributedContext`. Without those variables (a plain `python script.py`)
the process runs as a world of one, on an in-memory store, through the very same code path.

The context also holds the job's `Mesh` (`distributed_training.mesh`): the layout of the ranks over the
parallel dimensions, its node boundaries taken from ``LOCAL_WORLD_SIZE``, and this rank's group along
each dimension. This module is the only one that reads the launcher's environment: everything after it
takes the layout from the context.

Nothing here is module-level state: the context owns its process group and is passed explicitly.
"""

from __future__ import annotations

import atexit
import importlib
import os
import time
import uuid
import warnings
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .mesh import Mesh

__all__ = ["DistributedContext", "init_distributed", "DEFAULT_TIMEOUT", "collective_device", "launcher_ranks_per_node",
           "fewest"]

DEFAULT_TIMEOUT = timedelta(minutes=10)

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class DistributedContext:
    """Where this process stands in the job.

    Attributes:
        rank: global rank of this process.
        world_size: number of processes in the job.
        local_rank: rank among the processes of this node (selects the GPU).
        local_world_size: number of processes on this node.
        device: the device this process computes on (``cuda:<local_rank>`` or ``cpu``).
        backend: ``"nccl"`` or ``"gloo"``.
        group: the process group collectives use (``None`` means the default group).
        owns_process_group: whether `shutdown()` destroys the default group (False when the
            caller initialised it before us).
        mesh: the layout of the ranks over the parallel dimensions and this rank's group along each
            (default: data parallelism over all of `group`, nodes of `local_world_size` ranks).
        independent: the ranks train without ever meeting (a parameter server's workers under ssp /
            async, whose only messages go to the servers): what the trainer would agree on among
            them (`every_rank`, the stop on a signal, the steps per epoch, an evaluation's sums) is
            each rank's own, and no peer watch runs, so a rank that dies leaves the others nothing
            to wait for.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    group: dist.ProcessGroup | None = None
    owns_process_group: bool = field(default=False, repr=False)
    mesh: Mesh | None = None
    independent: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.mesh is None:
            self.mesh = Mesh(self.world_size, rank=self.rank, group=self.group,
                             ranks_per_node=max(self.local_world_size, 1))
        elif self.mesh.size() != self.world_size:
            raise ValueError(f"the mesh holds {self.mesh.size()} ranks but world_size is {self.world_size}")

    def set_mesh(self, *, pipeline: int = 1, tensor: int = 1) -> Mesh:
        """Lay the ranks out anew with `pipeline` stages (the outermost dimension), `tensor` ranks
        splitting each layer (the innermost: consecutive ranks, one node) and data parallelism over the
        rest, keeping the node size; `self.mesh` becomes that mesh, which is returned. Nothing changes
        when the mesh already has these sizes (a mesh the user built, with replicate dimensions, is
        kept). Collective (it creates the groups): every rank must call it, before anything takes
        groups from the mesh."""
        mesh = self.mesh
        if mesh.size("pipeline") == pipeline and mesh.size("tensor") == tensor:
            return mesh
        self.mesh = Mesh(self.world_size, pipeline=pipeline, tensor=tensor, ranks_per_node=mesh.ranks_per_node,
                         group=self.group, rank=self.rank)
        return self.mesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def every_rank(self, value: bool) -> bool:
        """Whether `value` is true on every rank (one tiny all-reduce; every rank must call it): how
        ranks decide together, e.g. to stop when any of them runs out of batches, so none hangs.
        Independent ranks (`independent`) do not meet: `value` itself."""
        return self.ranks_where(value) == self.meeting_ranks

    @property
    def meeting_ranks(self) -> int:
        """How many ranks `ranks_where` counts over: the world, or this rank alone (independent ranks)."""
        return 1 if self.world_size == 1 or self.independent else self.world_size

    def ranks_where(self, value: bool) -> int:
        """On how many ranks `value` is true (one tiny all-reduce; every rank must call it); independent
        ranks count their own only."""
        if self.world_size == 1 or self.independent:
            return int(bool(value))
        device = self.device if self.backend == "nccl" else torch.device("cpu")
        flag = torch.tensor([1 if value else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, group=self.group)
        return int(flag.item())

    def barrier(self) -> None:
        if self.world_size > 1:
            if self.backend == "nccl":
                dist.barrier(group=self.group, device_ids=[self.device.index])
            else:
                dist.barrier(group=self.group)

    def shutdown(self, barrier: bool = True) -> None:
        """Destroy the process group if this context created it. Safe to call twice.

        Ranks meet at a barrier first: a rank that tears its connections down while a peer is still
        finishing a collective makes the peer's communication thread abort the process."""
        if self.owns_process_group and dist.is_initialized():
            if barrier:
                try:
                    self.barrier()
                except RuntimeError:
                    pass  # a peer is already gone: nothing left to wait for
            dist.destroy_process_group()
            _let_gloo_threads_settle()
        self.owns_process_group = False

    def __enter__(self) -> "DistributedContext":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # Leaving on an error, peers may never reach the barrier: do not wait for them.
        self.shutdown(barrier=exc_type is None)


def _let_gloo_threads_settle(timeout: float = 3.0, quiet_polls: int = 10) -> None:
    """Wait (GIL released) until gloo's worker threads have been asleep for `quiet_polls` polls in a row
    (5 ms apart), for at most `timeout` seconds.

    A gloo worker drops its reference to a finished collective's tensors *after* `wait()` has
    returned in Python. When that reference is a tensor's last, freeing it needs the GIL; if the
    interpreter is already finalizing by then, the thread is unwound mid-destructor and the process
    aborts ("terminate called without an active exception"), after a job that had succeeded. On a
    loaded machine a worker can lag that long. Linux only (it reads /proc); elsewhere a no-op.

    A worker blocked on the GIL sleeps too (on a futex), so "asleep" is only a hint: each poll's sleep
    lets such a worker take the GIL, and enough quiet polls in a row make it likely that none is left.
    Two polls (10 ms) were not enough on a loaded 2-core machine (session 18's CI: three torchrun jobs
    aborted at exit after succeeding); ten (50 ms) are the default now. The cause of those aborts was
    found in session 19: the group outlived `destroy_process_group` (torch._dynamo's references, see
    `init_distributed`), so its threads lived into the exit; with that fixed there is normally no gloo
    thread left here, and this wait covers groups that something else still holds.
    """
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return
    deadline = time.monotonic() + timeout
    quiet = 0
    while quiet < quiet_polls and time.monotonic() < deadline:
        time.sleep(0.005)  # releases the GIL: a worker waiting for it can finish and go back to sleep
        busy = False
        for tid in os.listdir(tasks):
            try:
                with open(f"{tasks}/{tid}/comm") as f:
                    if not f.read().startswith("pt_gloo"):
                        continue
                with open(f"{tasks}/{tid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue  # the thread has exited
            busy = busy or state not in ("S", "D", "Z", "X")
        quiet = 0 if busy else quiet + 1


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def collective_device(group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> torch.device:
    """Where a small tensor for a collective over `group` lives: `device` (e.g. the gradients') unless
    NCCL needs a GPU and `device` is not one (a rank holding no gradient: a frozen or empty pipeline
    stage); without `device`, this rank's GPU under NCCL and the CPU otherwise."""
    nccl = dist.is_initialized() and dist.get_backend(group) == "nccl"
    if device is not None and (device.type == "cuda" or not nccl):
        return device
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def launcher_ranks_per_node(group: dist.ProcessGroup | None = None) -> int:
    """Ranks per node as the launcher says (``LOCAL_WORLD_SIZE``; default: all of `group` on one node).

    For the wrappers used on their own, without a `DistributedContext` (``FSDP(...,
    sharding_strategy="hybrid")`` with neither ``mesh=`` nor ``ranks_per_node=``); everything built
    from a context takes the node size from its mesh instead."""
    return _env_int("LOCAL_WORLD_SIZE", dist.get_world_size(group))


def _launch_group_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The launch's rendezvous store, under a prefix that only the ranks forming this group now share.

    Under torchrun the store can outlive the workers: the agents' shared store (the default) holds the
    keys of every earlier rendezvous round (among them the addresses gloo dials, now dead) and of an
    earlier group of this round (a second trainer after `shutdown()`, whose store-based barrier counter
    would never match). No launcher variable names the round: ``TORCHELASTIC_RESTART_COUNT`` is each
    agent's own (a membership change does not count it, so after one node's worker fails the nodes'
    counts differ, and ranks keyed by it waited under different prefixes forever).

    So rank 0 opens a new group number in the store, and every other rank has it confirmed before using
    it: a rank reads the newest number, signs in under it with a token of this process, and waits for
    rank 0 to answer that token. A number read before rank 0 opened this group's is an earlier group's,
    whose rank 0 is gone or done and never answers: the rank reads the number again and signs in anew.
    """
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
        is_master=not agent_hosts_store and rank == 0, timeout=timeout,
    )
    groups = dist.PrefixStore("distributed_training/groups", store)
    if rank == 0:
        number = groups.add("opened", 1)
        group = dist.PrefixStore(f"group_{number}", groups)
        signed = [f"signed/rank_{r}" for r in range(1, world_size)]
        try:
            group.wait(signed, timeout)
        except dist.DistStoreError:
            missing = [r for r in range(1, world_size) if not group.check([f"signed/rank_{r}"])]
            raise dist.DistStoreError(
                f"rank 0 waited {timeout.total_seconds():.0f} s for ranks {missing} to join the process group "
                f"(store {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}): did they start?"
            ) from None
        if signed:
            tokens = group.multi_get(signed)
            group.multi_set([f"answer/{t.decode()}" for t in tokens], [b"1"] * len(tokens))
        return group
    token = uuid.uuid4().hex
    deadline = time.monotonic() + timeout.total_seconds()
    pause, signed = 0.01, None
    while True:  # (polled with `check`: a `wait` that times out has c10d print two warnings each time)
        number = groups.add("opened", 0)
        group = dist.PrefixStore(f"group_{number}", groups)
        if number != signed:
            group.set(f"signed/rank_{rank}", token)
            signed = number
        if group.check([f"answer/{token}"]):
            return group
        if time.monotonic() > deadline:
            raise dist.DistStoreError(
                f"rank {rank} waited {timeout.total_seconds():.0f} s for rank 0 to open the process "
                f"group (store {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}): did it start?")
        time.sleep(pause)
        pause = min(2 * pause, 0.25)


def init_distributed(
    backend: str | None = None,
    timeout: timedelta | float | None = None,
    device: str | torch.device | None = None,
    init_method: str | None = None,
) -> DistributedContext:
    """Join (or create) the job's default process group and choose this process's device.

    Args:
        backend: ``"nccl"``, ``"gloo"`` or ``None`` to choose: NCCL when CUDA is available, else gloo.
        timeout: how long any collective may wait before it fails (a `timedelta` or seconds).
            Defaults to 10 minutes.
        device: force a device (``"cpu"`` runs gloo even on a GPU machine).
        init_method: rendezvous URL (``"file:///shared/rdzv"``, ``"tcp://host:port"``); by default
            torchrun's MASTER_ADDR/MASTER_PORT.

    If the default group already exists (the caller initialised it), it is reused and left alone
    at shutdown; it keeps its own timeout (a `timeout` given here then is said not to apply).
    """
    if timeout is not None and dist.is_initialized() and dist.get_rank() == 0:
        warnings.warn(f"timeout={timeout} does not apply: the default process group already exists (your script's "
                      "init_process_group, or a test harness's) and keeps the timeout it was created with; pass "
                      "timeout= to init_process_group instead", UserWarning, stacklevel=3)
    if timeout is None:
        timeout = DEFAULT_TIMEOUT
    elif not isinstance(timeout, timedelta):
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        timeout = timedelta(seconds=float(timeout))

    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        owns = False
        backend = dist.get_backend()
    else:
        rank = _env_int("RANK", 0)
        world_size = _env_int("WORLD_SIZE", 1)
        owns = True
    # Without the LOCAL_* variables, assume one node holds the whole job.
    local_rank = _env_int("LOCAL_RANK", rank)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
    if not 0 <= local_rank < max(local_world_size, 1):
        raise ValueError(f"LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE={local_world_size}")

    if device is not None:
        dev = torch.device(device)
    elif backend in (None, "nccl") and torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"rank {rank}: LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA "
                "device(s) are visible; start at most one process per GPU"
            )
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)

    if backend is None:
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl" and dev.type != "cuda":
        raise ValueError("backend 'nccl' needs a CUDA device")

    if owns:
        kwargs = dict(backend=backend, rank=rank, world_size=world_size, timeout=timeout)
        if dev.type == "cuda":
            # Binding the group to the device lets NCCL create its communicator eagerly.
            kwargs["device_id"] = dev
        if init_method is not None:
            kwargs["init_method"] = init_method
        elif world_size == 1 and "MASTER_ADDR" not in os.environ:
            # A plain `python script.py`: a world of one needs no TCP rendezvous.
            kwargs["store"] = dist.HashStore()
        else:
            missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
            if missing:
                raise RuntimeError(
                    f"WORLD_SIZE={world_size} but {', '.join(missing)} not set: start the job with torchrun "
                    f"(expected variables: {', '.join(_TORCHRUN_VARS)})"
                )
            if "TORCHELASTIC_RESTART_COUNT" in os.environ:  # torchrun: a store that outlives the workers
                kwargs["store"] = _launch_group_store(rank, world_size, timeout)
        # torch._dynamo, imported once a default group exists (building any torch.optim optimizer
        # imports it), keeps references to that group: `destroy_process_group` then cannot free it,
        # its gloo threads live on into the interpreter's exit, and one still busy there aborts the
        # process ("terminate called without an active exception") after a job that had succeeded
        # (measured: the threads remain after `close` unless dynamo came first). So it comes first.
        importlib.import_module("torch._dynamo")
        dist.init_process_group(**kwargs)

    context = DistributedContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        device=dev,
        backend=backend,
        group=None,
        owns_process_group=owns,
    )
    if owns:
        # A script that ends without closing (an exception before `trainer.close()`) would otherwise reach
        # interpreter finalization with the group's threads alive, where one still busy aborts the process
        # ("terminate called without an active exception", exit -6 instead of the script's own status).
        atexit.register(context.shutdown, barrier=False)  # a no-op once the context was shut down
    return context


def fewest(value: int, group, device: torch.device | None = None) -> int:
    """The smallest of every rank's `value` in `group` (every rank of it calls this). Over a CPU group
    (`Mesh.host_group`; `device` None) reading it back waits for the peers, never for a GPU."""
    least = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(least, op=dist.ReduceOp.MIN, group=group)
    return int(least.item())
