"""A worker's side: pull parameters into the model, push its gradients, one message stream per server.

Every exchange posts its receives first, then its sends, all non-blocking, then waits: a worker never
blocks a server (see protocol.py). The model may live on a GPU: values cross the wire as fp32 CPU tensors
and are copied into (and out of) the parameters.

A lost worker (`sync` only: ssp and async go on without it): the servers answer every later pull or
close with the lost worker's index in the reply's header, and the worker raises `WorkerLostError`; it is
then closed. Told in a pull, it first sends every server a LEAVE (the server's thread reading it then
returns, rather than wait in a receive until the interpreter's exit); after that it sends nothing more,
so that no message waits for a server that has stopped.

Sparse tables: `pull(rows={name: ids})` asks each server for the rows of the given ids that it holds
(local row numbers); the following push sends the gradient of exactly those rows.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .protocol import (STOP_WORKER, Kind, ServerLostError, WorkerLostError, close_connections, recv_reply,
                       send_request)
from ..hangs import is_timeout
from .sharding import Piece, ShardPlan

__all__ = ["Worker"]


class Worker:
    """Worker `index` (of `num_workers`) of a `ShardPlan`; see the module docstring.

    Attributes:
        step: the step this worker is computing (pushed by the next `push`).
        versions: the version each server answered the last pull with.
        traffic: payload bytes so far: ``push_values``, ``push_indices``, ``pull_values``, ``pull_indices``.
        wait_seconds: time spent in pulls (waiting for parameters, the wire included).
    """

    def __init__(self, params: dict[str, torch.nn.Parameter], plan: ShardPlan, index: int,
                 pg: dist.ProcessGroup) -> None:
        """`pg`: the process group to the servers, server `i` at its rank `i` (the job's group, or a
        rejoined worker's group of its own)."""
        self.params, self.plan, self.index, self.pg = params, plan, index, pg
        self.servers = [s for s in range(plan.num_servers) if plan.pieces[s]]
        self.step = 0
        self.versions: list[int] = [0] * plan.num_servers
        self.traffic = {"push_values": 0, "push_indices": 0, "pull_values": 0, "pull_indices": 0}
        self.stop_signal: tuple[int, int] | None = None  # (server, signal number) a server said it got
        self.wait_seconds = 0.0
        self._rows: dict[str, torch.Tensor] = {}  # sparse table -> unique global rows of the last pull
        self._closed = False

    # ---------------------------------------------------------------- rows
    def _local_rows(self, piece: Piece, rows: torch.Tensor | None) -> torch.Tensor | None:
        if rows is None:
            return None
        mine = rows[rows % piece.stride == piece.start] if piece.stride > 1 else rows
        return mine // piece.stride

    def _indices(self, server: int, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, dict]:
        """The indices payload for `server` (counts, then local rows) and each sparse piece's local rows."""
        counts, parts, local = [], [], {}
        for piece in self.plan.pieces[server]:
            if piece.sparse:
                local[piece.name] = self._local_rows(piece, rows.get(piece.name))
                counts.append(-1 if local[piece.name] is None else local[piece.name].numel())
                if local[piece.name] is not None:
                    parts.append(local[piece.name])
        if not counts:
            return None, local
        return torch.cat([torch.tensor(counts, dtype=torch.int64), *parts]), local

    @staticmethod
    def _numel(piece: Piece, local: torch.Tensor | None) -> int:
        return piece.numel if local is None else local.numel() * piece.row_numel

    # ---------------------------------------------------------------- pull
    def pull(self, rows: dict[str, torch.Tensor] | None = None, *, final: bool = False) -> int:
        """Fill the model's parameters from the servers; return the oldest version among them.

        Args:
            rows: for sparse tables, the ids the next batch looks up (any shape); only those rows move.
                A sparse table not named moves whole.
            final: wait until every worker has finished (pushed its last step and made this call, or
                closed) and the servers have applied everything; then pull all of every table. Every
                worker makes this call (or closes) before any gets its answer.
        """
        self._check_open()
        rows = dict(rows or {})
        if final and rows:
            raise ValueError("pull: rows= cannot be given with final=True (the final pull moves every row)")
        for name in rows:
            if name not in self.plan.tables or not self.plan.tables[name][0].sparse:
                sparse = sorted(n for n, ps in self.plan.tables.items() if ps[0].sparse)
                raise ValueError(f"pull: rows= names {name!r}, which is not a sparse table ({sparse})")
        self._rows = {n: torch.unique(r.detach().reshape(-1).to("cpu", torch.int64)) for n, r in rows.items()}
        started = time.perf_counter()
        works, replies = [], []
        for server in self.servers:
            indices, local = self._indices(server, self._rows)
            n = sum(self._numel(p, local.get(p.name)) for p in self.plan.pieces[server])
            posted, header, values = recv_reply(self.pg, server, n)
            works += [(server, w) for w in posted + send_request(
                self.pg, server, Kind.FINAL if final else Kind.PULL, self.index, self.step, None, indices)]
            replies.append((server, header, values, local, indices))
        self._wait(works, "final pull" if final else "pull")
        self.wait_seconds += time.perf_counter() - started
        self._raise_if_lost([(server, header) for server, header, *_ in replies], leave=True)
        for server, header, values, local, indices in replies:
            version, n, _, _ = header.tolist()
            if n != values.numel():
                raise RuntimeError(f"pull: server {server} sent {n} values, expected {values.numel()}")
            self.versions[server] = version
            self.traffic["pull_values"] += 4 * n
            self.traffic["pull_indices"] += 0 if indices is None else 8 * indices.numel()
            self._fill(server, values, local)
        return min(self.versions[s] for s in self.servers) if self.servers else 0

    @torch.no_grad()
    def _fill(self, server: int, values: torch.Tensor, local: dict[str, torch.Tensor | None]) -> None:
        at = 0
        for piece in self.plan.pieces[server]:
            param, picked = self.params[piece.name], local.get(piece.name)
            n = self._numel(piece, picked)
            chunk = values[at : at + n]
            at += n
            if picked is None:
                piece.view(param.data).copy_(chunk.view(piece.local_shape))
            else:
                rows = (picked * piece.stride + piece.start).to(param.device)
                param.data.index_copy_(0, rows, chunk.view(-1, *piece.shape[1:]).to(param.device, param.dtype))

    # ---------------------------------------------------------------- push
    def push(self, weight: float | None = None) -> None:
        """Send the model's gradients of the current step to the servers (zeros where a gradient is None,
        flagged so: a parameter no worker's step reached is left alone, as data parallelism leaves it),
        with what this worker's batch counts (`weight`, for ``sync``'s weighted mean; None: equal weights).

        A sparse table sends the rows of its last pull; without one, the rows its (sparse) gradient names,
        or the whole table (dense gradient)."""
        self._check_open()
        rows = dict(self._rows)
        for name, pieces in self.plan.tables.items():
            grad = self.params[name].grad
            if pieces[0].sparse and name not in rows and grad is not None and grad.is_sparse:
                rows[name] = grad.coalesce().indices()[0].cpu()
        works, keep = [], []
        for server in self.servers:
            indices, local = self._indices(server, rows)
            pieces = self.plan.pieces[server]
            parts = [self._grad(piece, local.get(piece.name)) for piece in pieces]
            # Then a flag per piece: whether its parameter has a gradient (`update.split_push`).
            parts.append(torch.tensor([float(self.params[piece.name].grad is not None) for piece in pieces]))
            values = torch.cat(parts)
            works += [(server, w) for w in send_request(self.pg, server, Kind.PUSH, self.index, self.step, values,
                                                        indices, weight)]
            keep.append((values, indices))
            self.traffic["push_values"] += 4 * (values.numel() - len(pieces))  # (the gradients: not the flags)
            self.traffic["push_indices"] += 0 if indices is None else 8 * indices.numel()
        self._wait(works, "push")

    def _grad(self, piece: Piece, local: torch.Tensor | None) -> torch.Tensor:
        """This piece's gradient as flat fp32 CPU values (rows `local` of it for a sparse piece)."""
        param = self.params[piece.name]
        grad = param.grad
        if local is None:
            if grad is None:
                return torch.zeros(piece.numel)
            if grad.is_sparse:
                grad = grad.to_dense()
            return piece.view(grad.detach()).to("cpu", torch.float32).reshape(-1)
        rows = local * piece.stride + piece.start
        if grad is None:
            return torch.zeros(rows.numel() * piece.row_numel)
        if not grad.is_sparse:
            return grad.detach()[rows.to(grad.device)].to("cpu", torch.float32).reshape(-1)
        grad = grad.coalesce()
        grad_rows, grad_values = grad.indices()[0].cpu(), grad.values().detach().to("cpu", torch.float32)
        mine = grad_rows % piece.stride == piece.start
        grad_rows, grad_values = grad_rows[mine], grad_values[mine]
        at = torch.searchsorted(rows, grad_rows).clamp_(max=max(rows.numel() - 1, 0))
        if grad_rows.numel() and (rows.numel() == 0 or not torch.equal(rows[at], grad_rows)):
            raise RuntimeError(f"push: {piece.name}'s gradient touches rows that the last pull did not ask for "
                               "(give pull(rows=...) every id of the batch)")
        out = torch.zeros((rows.numel(), *piece.shape[1:]))
        out[at] = grad_values
        return out.reshape(-1)

    # ---------------------------------------------------------------- end
    def close(self) -> None:
        """Tell every server that this worker is done, and wait until every worker has (idempotent).

        The wait makes the end a barrier of the whole job: without it, a worker that built a new
        `ParameterServer` right away could reach a server still serving the old one."""
        if self._closed:
            return
        works, acks = [], []
        for server in range(self.plan.num_servers):
            posted, header, _ = recv_reply(self.pg, server, 0)
            works += [(server, w) for w in posted + send_request(self.pg, server, Kind.DONE, self.index, self.step,
                                                                 None, None)]
            acks.append(header)
        self._wait(works, "close")
        self._closed = True
        self._raise_if_lost(list(enumerate(acks)))

    def join(self, consistency: str) -> int:
        """(A restarted worker, on its own group with the servers) announce itself to every server and
        take the step to continue from: the steps it had pushed before it was lost, and under ``ssp`` at
        least the step of the slowest worker still training (with a bound of 0: the servers' version), so
        that nobody waits for it and no step applied without it is computed again.
        Returns that step."""
        works, replies = [], []
        for server in range(self.plan.num_servers):
            posted, header, _ = recv_reply(self.pg, server, 0)
            works += [(server, w) for w in posted + send_request(self.pg, server, Kind.JOIN, self.index, -1, None,
                                                                 None)]
            replies.append(header)
        self._wait(works, "join")
        versions = [int(h[0]) for h in replies]
        pushed = max(int(h[3]) for h in replies)
        self.versions = versions
        self.step = pushed  # each server's proposal (under ssp: not behind the slowest worker training)
        return self.step

    def _wait(self, works: list[tuple[int, object]], doing: str) -> None:
        """Wait for each ``(server, work)``. A failed one (not a timeout): that server is gone. This worker is closed then,
        and its connections too: its receives from the other servers would stay blocked in gloo (and abort
        the interpreter at its exit). Raises `ServerLostError`."""
        for server, work in works:
            try:
                work.wait()
            except RuntimeError as err:
                if is_timeout(err):  # the server is there, slow or waiting for another worker: gloo's own error
                    raise
                self._closed = True
                others = [s for s in range(self.plan.num_servers) if s != server]
                if others:
                    close_connections(self.pg, others[0])
                raise ServerLostError.of(server, self.step, f"worker {self.index}'s {doing} to it failed") from err

    def _raise_if_lost(self, headers: list[tuple[int, torch.Tensor]], leave: bool = False) -> None:
        """Raise `WorkerLostError` if a server's reply header names a lost worker (then this one is closed;
        with `leave`, after sending every server a LEAVE: not after close, whose DONE ended their reading)."""
        for server, header in headers:
            _, _, worker, step = header.tolist()
            if worker == STOP_WORKER:
                self.stop_signal = (server, step)
            if worker >= 0:
                self._closed = True
                if leave:
                    self._leave()
                raise WorkerLostError.of(worker, self.plan.num_servers + worker, step,
                                         f"server {server} told worker {self.index}")

    def _leave(self) -> None:
        """Send every server a LEAVE (the servers still up read it; one that has stopped fails the send)."""
        for server in range(self.plan.num_servers):
            try:
                for work in send_request(self.pg, server, Kind.LEAVE, self.index, self.step, None, None):
                    work.wait()
            except RuntimeError:
                pass  # that server is gone: nothing of it waits for this worker

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("parameter server: this worker is closed")
