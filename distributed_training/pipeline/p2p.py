"""Messages between pipeline stages: a small header, then the payload.

The header (dtype, number of dimensions, shape) lets the receiver allocate the buffer without knowing
the shape in advance, so the sequence length may change from batch to batch. Headers travel over a CPU
(gloo) group: reading one never waits for the GPU. Payloads travel over the pipeline group (NCCL on
GPUs), posted together in one batch at each *exchange point*: before an action, the sends that the
previous action produced go out with the receive this action needs. Two neighbours that each send to
the other at the same moment (1F1B's steady state: an activation forward, a gradient back) then post
both messages in one group, which NCCL progresses together; posted one after the other on one stream
they would wait for each other forever.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["StageLink", "MAX_DIMS"]

#: dtypes a stage may send (the header carries an index into this list)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)
MAX_DIMS = 6
_HEADER = 2 + MAX_DIMS  # dtype index, ndim, shape padded with zeros


def _header(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype not in _DTYPES:
        raise TypeError(f"a pipeline stage sent a {tensor.dtype} tensor; stages may send {', '.join(map(str, _DTYPES))}")
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"a pipeline stage sent a tensor of {tensor.dim()} dimensions; at most {MAX_DIMS} are "
                         "supported (reshape before the stage boundary)")
    head = torch.zeros(_HEADER, dtype=torch.int64)
    head[0] = _DTYPES.index(tensor.dtype)
    head[1] = tensor.dim()
    head[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return head


class StageLink:
    """This rank's messages to and from the other ranks of its pipeline.

    Args:
        ranks: the global ranks of the pipeline, in stage order (`mesh.ranks("pipeline")`).
        group: the pipeline group the payloads use (NCCL on GPUs).
        header_group: a CPU group over the same ranks for the headers (gloo); `group` itself when it is gloo.
        device: where received payloads are allocated.
    """

    def __init__(self, ranks: list[int], group, header_group, device: torch.device) -> None:
        self.ranks = list(ranks)
        self.group, self.header_group = group, header_group
        self.device = device
        self._in_flight: list[tuple[list, tuple]] = []  # (works, tensors they read) until waited for

    def exchange(self, sends: list[tuple[torch.Tensor, int]], recv_from: int | None) -> torch.Tensor | None:
        """Send each (tensor, pipeline rank) of `sends` and, when `recv_from` is a pipeline rank, receive one
        tensor from it; return the received tensor (ready to use on this rank's stream) or None."""
        headers = []
        for tensor, peer in sends:
            head = _header(tensor)
            headers.append(head)
            self._in_flight.append(([dist.isend(head, self.ranks[peer], group=self.header_group)], (head,)))
        received = None
        ops = [dist.P2POp(dist.isend, t.contiguous() if not t.is_contiguous() else t, self.ranks[peer], self.group)
               for t, peer in sends]
        if recv_from is not None:
            head = torch.empty(_HEADER, dtype=torch.int64)
            dist.recv(head, self.ranks[recv_from], group=self.header_group)
            code, ndim, *shape = head.tolist()
            received = torch.empty(shape[:ndim], dtype=_DTYPES[code], device=self.device)
            ops.append(dist.P2POp(dist.irecv, received, self.ranks[recv_from], self.group))
        if ops:
            works = list(dist.batch_isend_irecv(ops))
            if recv_from is not None:
                # On NCCL the current stream waits (the host goes on); on gloo the data is here after it.
                if len(works) == len(ops):  # one work per message: wait for the receive only
                    works.pop().wait()
                else:  # one work for the whole group (NCCL coalesces): it covers the receive
                    for work in works:
                        work.wait()
                    works = []
            if works:
                self._in_flight.append((works, tuple(op.tensor for op in ops)))
        return received

    def wait_all(self) -> None:
        """Wait until every message sent so far has left (the tensors it read may then be reused)."""
        for works, _ in self._in_flight:
            for work in works:
                work.wait()
        self._in_flight.clear()
