"""Messages between pipeline stages: a small header, then the payload.

The header (dtype, number of dimensions, shape) lets the receiver allocate the buffer without knowing
the shape in advance, so the sequence length may change from batch to batch. Headers travel over a CPU
(gloo) group: reading one never waits for the GPU. A message leaves as soon as the host has issued the
computation of its tensor (its shape is known then), and a receive is posted just before the action
that needs it; only the header receive blocks the host, so the hosts wait on one another exactly as
the schedule's data dependencies say.

Payloads to a higher pipeline rank and to a lower one use two different groups (on NCCL, two
communicators, each with its own stream). Between two ranks each then carries one direction only, so a
send waiting for its receiver never holds up a receive queued behind it on the same stream: the
deadlock that 1F1B's steady state (an activation forward, a gradient back, at the same moment) would
otherwise hit on NCCL.

Known shapes. A receive that blocks the host on its header ties the hosts of neighbouring stages
together: a rank cannot issue a microbatch's work before its neighbour's host has issued the work that
produces its input. Where the host's time per step is close to the GPU's (a 1F1B steady state sends a
message each way per microbatch), the ranks then wait for each other's Python rather than running
ahead of their GPUs. So the receiver remembers shapes: the engine opens each step with a key (the
shapes and dtypes of the step's microbatch inputs, which every rank of the pipeline is given alike),
and the n-th message from a peer in a step with a key seen before is allocated with the shape it had
then, its payload receive posted at once; its header is still sent and received, but without waiting,
and checked at the end of the step (`end_step`): a shape that changed although the inputs' did not (a
stage whose output shape depends on the data's values) raises there, naming the message. The first
step with a new key (a new sequence length) goes by headers. Senders do the same in both cases.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["StageLink", "PipelineAborted", "MAX_DIMS"]

#: dtypes a stage may send (the header carries an index into this list)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)
MAX_DIMS = 6
_HEADER = 2 + MAX_DIMS  # dtype index, ndim, shape padded with zeros
# Headers and payloads are told apart by tag where they share a group (gloo, on CPUs); an evaluation's
# acknowledgements travel on a tag of their own (`StageLink.batch_ends`).
_PAYLOAD_TAG, _HEADER_TAG, _EVALUATION_TAG = 0, 1, 2
_ABORT = -1  # a header whose dtype index is this says "stop": the rank in its third field failed
_ACK = -2  # an evaluation's batch ended well on the last rank (`StageLink.batch_ends`)
_ABORT_GRACE_S = 2.0
_KNOWN_KEYS = 32  # step keys whose message shapes a link remembers (least recently used dropped)
_KNOWN_HEADERS = 256  # header tensors a link keeps for reuse (all dropped when full)


class PipelineAborted(RuntimeError):
    """Another rank of the pipeline failed during the step, so this one stopped too."""


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
        up_group / down_group: the groups over `ranks` for payloads sent to a higher / lower pipeline rank
            (may be the same group on gloo, where sends never block).
        header_group: a CPU (gloo) group over `ranks` for the headers (may be the payloads' group on gloo:
            headers and payloads are told apart by tag).
        device: where received payloads are allocated.
    """

    def __init__(self, ranks: list[int], up_group, down_group, header_group, device: torch.device) -> None:
        self.ranks = list(ranks)
        self.up_group, self.down_group, self.header_group = up_group, down_group, header_group
        self.device = device
        self._in_flight: list[tuple[list, tuple, int]] = []  # (works, tensors they read, peer) until waited for
        self._headers: dict[tuple, torch.Tensor] = {}  # (dtype, shape) -> its header tensor (read-only)
        # Known shapes: step key -> {(peer, n): header values of the n-th message from peer in such a step}.
        self._known: OrderedDict[Any, dict[tuple[int, int], list[int]]] = OrderedDict()
        self._step: dict[tuple[int, int], list[int]] | None = None  # the open step's shapes (None: no step)
        self._count: dict[int, int] = {}  # messages received from each peer in the open step
        # Headers of messages received by known shape, not yet checked: peer -> [(work, header, expected, n)].
        self._unchecked: dict[int, deque] = {}
        #: How many messages from one peer a step may receive by known shape before the oldest one's header
        #: is waited for: the host runs at most this far ahead of its neighbour's (and learns of a failed
        #: peer at most this many messages late); None: checked only at `end_step`.
        self.max_lag: int | None = 2
        self.known_shapes = device.type == "cuda"  # on gloo a payload receive blocks the host anyway
        self.received_by_known_shape = 0  # messages received without waiting for their header (all steps)
        # For `resync` after an aborted step: messages posted per peer since the link was made (headers sent,
        # payloads sent with the last steps' shapes, receives posted), and receives posted before the abort.
        self._ledger = _Ledger(len(self.ranks))
        self._stale: list = []
        self._stale_sends: list = []  # stop messages not yet taken when the abort returned
        self.aborted = False  # a step stopped here: messages of it may be in flight (`resync` first)
        self.evaluating = False  # between `begin_evaluation` and `after_evaluation` (or an abort)
        self._last = len(self.ranks) - 1  # the pipeline rank of the last stage
        self._unacked: deque[int] = deque()  # an evaluation's batches not yet acknowledged: their sends
        self._acks: deque = deque()  # (the last rank) (batch, its acknowledgements) not yet waited for
        self._lag = self._batch_sent = self._batches = 0
        self._ack_due = False

    def begin_step(self, key: Any) -> None:
        """Open a step whose messages are determined by `key` (hashable; the same on every rank of the
        pipeline for the same step): messages whose shape a step with this key had are received
        without waiting for their headers."""
        if key not in self._known:
            self._known[key] = {}
            while len(self._known) > _KNOWN_KEYS:
                self._known.popitem(last=False)
        self._known.move_to_end(key)
        self._step, self._count = self._known[key], {}

    def end_step(self) -> None:
        """Close the step: check the headers of the messages received by known shape (raises
        `PipelineAborted` if a peer stopped the step instead, RuntimeError if a shape differed)."""
        self._step = None
        for peer, pending in self._unchecked.items():
            while pending:
                self._check_oldest(peer, pending)

    def _check_oldest(self, peer: int, pending: deque) -> None:
        work, head, expected, n = pending.popleft()
        values = self._wait_header(work, head, peer)
        if values != expected:
            raise RuntimeError(
                f"message {n} of this step from global rank {self.ranks[peer]} has header {values}, but a step with "
                f"the same input shapes had {expected}: a stage's output shape depends on more than its input's "
                "shape, which the pipeline's known-shape receives do not allow")

    def _payload_group(self, sender: int, receiver: int):
        return self.up_group if receiver > sender else self.down_group

    def send(self, tensor: torch.Tensor, me: int, peer: int) -> None:
        """Send `tensor` from pipeline rank `me` to pipeline rank `peer`: header, then payload, now."""
        key = (tensor.dtype, tensor.shape)
        head = self._headers.get(key)  # a step sends the same few headers again and again: built once
        if head is None:
            if len(self._headers) >= _KNOWN_HEADERS:
                self._headers.clear()
            head = self._headers[key] = _header(tensor)  # never modified after this: in-flight sends share it
        payload = tensor if tensor.is_contiguous() else tensor.contiguous()
        works = [dist.isend(head, self.ranks[peer], group=self.header_group, tag=_HEADER_TAG),
                 dist.isend(payload, self.ranks[peer], group=self._payload_group(me, peer), tag=_PAYLOAD_TAG)]
        self._in_flight.append((works, (head, payload), peer))
        self._ledger.sent(peer, _DTYPES.index(tensor.dtype), tuple(tensor.shape))

    def recv(self, me: int, peer: int) -> torch.Tensor:
        """The next tensor pipeline rank `peer` sends to `me` (on NCCL: ready in stream order).

        Raises `PipelineAborted` when `peer` (or a rank before it) failed instead of sending (in a step
        with known shapes: at `end_step`)."""
        values = None
        if self._step is not None and self.known_shapes:
            n = self._count.get(peer, 0)
            self._count[peer] = n + 1
            values = self._step.get((peer, n))
            if values is None:
                values = self._step[peer, n] = self._header_from(peer)
            else:
                head = torch.empty(_HEADER, dtype=torch.int64)
                work = dist.irecv(head, self.ranks[peer], group=self.header_group, tag=_HEADER_TAG)
                self._ledger.headers_posted[peer] += 1
                self.received_by_known_shape += 1
                pending = self._unchecked.setdefault(peer, deque())
                pending.append((work, head, values, n))
                # A header is waited for when the host would run more than max_lag messages ahead of the
                # peer's (a peer's "stop" is heard then at the latest); one already here is checked now, where
                # the backend says so (a gloo point-to-point work reports completion only once waited for).
                while pending and (pending[0][0].is_completed() or
                                   (self.max_lag is not None and len(pending) > self.max_lag)):
                    self._check_oldest(peer, pending)
        code, ndim, *shape = values if values is not None else self._header_from(peer)
        received = torch.empty(shape[:ndim], dtype=_DTYPES[code], device=self.device)
        self._ledger.posted(peer, code, tuple(shape[:ndim]))
        dist.irecv(received, self.ranks[peer], group=self._payload_group(peer, me), tag=_PAYLOAD_TAG).wait()
        return received

    def _header_from(self, peer: int) -> list[int]:
        head = torch.empty(_HEADER, dtype=torch.int64)
        self._ledger.headers_posted[peer] += 1
        return self._wait_header(None, head, peer)

    def _wait_header(self, work, head: torch.Tensor, peer: int, tag: int = _HEADER_TAG) -> list[int]:
        """The values of a header from `peer` (received now, or by the posted `work`)."""
        try:
            if work is None:
                dist.recv(head, self.ranks[peer], group=self.header_group, tag=tag)
            else:
                work.wait()
        except RuntimeError as err:  # the peer's process ended (it failed, and its launcher tore it down)
            lost = PipelineAborted(f"pipeline stopped: global rank {self.ranks[peer]}, which this rank was waiting "
                                   f"for, went away ({str(err).splitlines()[0][:200]})")
            lost.failed_rank, lost.peer_lost = self.ranks[peer], True
            raise lost from err
        values = head.tolist()
        if values[0] == _ABORT:
            err = PipelineAborted(f"pipeline stopped: global rank {values[2]} failed during the step or evaluation "
                                  f"(its own error says why); this rank was waiting for global rank {self.ranks[peer]}")
            err.failed_rank, err.stopped_by_peer = values[2], True  # (a stop message: the peer lives)
            raise err
        return values

    def abort(self, me: int, failed: int | None = None) -> None:
        """Tell every other rank of the pipeline that this step stops (`failed`: the global rank whose
        error started it, default this one): a rank blocked on a header from this one raises
        `PipelineAborted` and tells the others in turn, so no rank waits forever for a message. In an
        evaluation the last rank also sends the stop where its acknowledgements are awaited."""
        failed = self.ranks[me] if failed is None else failed
        self._stale += [work for pending in self._unchecked.values() for work, *_ in pending]
        self._step, self._unchecked, self.aborted = None, {}, True
        head = torch.zeros(_HEADER, dtype=torch.int64)
        head[0], head[2] = _ABORT, failed
        works = []
        for peer in range(len(self.ranks)):
            if peer != me:
                try:
                    works.append(dist.isend(head.clone(), self.ranks[peer], group=self.header_group,
                                            tag=_HEADER_TAG))
                    self._ledger.headers_sent[peer] += 1
                except RuntimeError:  # the peer is gone already: nothing to tell it
                    pass
        if self.evaluating:
            self.evaluating = False
            if me == self._last:
                for peer in range(len(self.ranks) - 1):
                    try:
                        works.append(dist.isend(head.clone(), self.ranks[peer], group=self.header_group,
                                                tag=_EVALUATION_TAG))
                        self._ledger.evals_sent[peer] += 1
                    except RuntimeError:
                        pass
                self._stale_sends += [work for _, works in self._acks for work in works]
                self._acks = deque()
        self._stale_sends += works  # (taken by `resync`, or given a moment by `settle_after_abort`)

    def _grace(self) -> None:
        """Give the stops a moment to reach the peers waiting on this rank before its process may end (a
        peer not listening to this rank never takes its message: it hears from another one). Polled, not
        waited for with a timeout: gloo closes the pair of a wait that times out, and the pipeline may go
        on (`resync` waits for the rest). (A gloo point-to-point work says it completed only once waited
        for, so on gloo this is the whole grace.)"""
        works, deadline = list(self._stale_sends), time.monotonic() + _ABORT_GRACE_S
        while works and time.monotonic() < deadline:
            try:
                works = [work for work in works if not work.is_completed()]
            except RuntimeError:
                break
            time.sleep(0.005)

    # ------------------------------------------------------------------ evaluation
    # In an evaluation the first ranks only send: a later stage's failure would never reach them through
    # the messages they wait for, and a send to a stage that failed is never taken (on gloo its wait never
    # returns). So the last rank acknowledges each batch to every other rank (a header on a tag of its
    # own) when it starts the next one (or at the end), and a rank waits for the acknowledgement of the
    # batch `lag` batches back before it starts one (`batch_starts`), never for its sends: a send is
    # waited for only once its batch is acknowledged.
    # When any stage fails, the last rank hears of it (it waits on its predecessor, which waits on its
    # own, ...) and sends a stop where the acknowledgement was awaited: every rank of the pipeline raises,
    # and `resync` pairs what was left in flight, as after a failed training step.
    def begin_evaluation(self, lag: int) -> None:
        """An evaluation starts (every rank of the pipeline alike): at most `lag` batches unacknowledged."""
        self.wait_all()
        self.evaluating, self._lag, self._unacked, self._acks = True, max(1, lag), deque(), deque()
        self._batches, self._ack_due = 0, False

    def batch_starts(self, me: int) -> None:
        """Before a batch's first message. The last rank acknowledges the batch before (only now: what
        `evaluate` does with a batch's values after the stages ran may fail too); another rank first
        takes the acknowledgement of the batch `lag` back."""
        if me == self._last:
            self._acknowledge()
        else:
            while len(self._unacked) >= self._lag:
                self._take_ack(me)
        self._batch_sent = len(self._in_flight)

    def batch_ends(self, me: int) -> None:
        """After a batch's stages ran on this rank. On the last rank every rank has started this batch,
        so has taken the acknowledgements of the batches `lag` back, and the messages it sent in it (to
        rank 0, interleaved) have been taken: both are waited for now, so neither piles up."""
        if me != self._last:
            self._unacked.append(len(self._in_flight) - self._batch_sent)
            return
        while self._acks and self._acks[0][0] <= self._batches - self._lag:
            for work in self._acks.popleft()[1]:
                work.wait()
        self.wait_all()
        self._batches, self._ack_due = self._batches + 1, True

    def _acknowledge(self) -> None:
        if not self._ack_due:
            return
        head = torch.zeros(_HEADER, dtype=torch.int64)
        head[0] = _ACK
        works = []
        for peer in range(len(self.ranks) - 1):
            works.append(dist.isend(head, self.ranks[peer], group=self.header_group, tag=_EVALUATION_TAG))
            self._ledger.evals_sent[peer] += 1
        self._acks.append((self._batches - 1, works))
        self._ack_due = False

    def _take_ack(self, me: int) -> None:
        """Wait for the last rank's acknowledgement of this rank's oldest unacknowledged batch (raises
        `PipelineAborted` if it stopped instead); that batch's sends have all been taken then."""
        head = torch.empty(_HEADER, dtype=torch.int64)
        self._ledger.evals_posted[self._last] += 1
        self._wait_header(None, head, self._last, tag=_EVALUATION_TAG)
        taken = self._unacked.popleft()
        done, self._in_flight = self._in_flight[:taken], self._in_flight[taken:]
        for works, *_ in done:
            for work in works:
                work.wait()

    def end_evaluation(self, me: int) -> None:
        """Before the evaluation's sums go round: every batch acknowledged (raises `PipelineAborted` if
        the last rank stopped instead)."""
        if me == self._last:
            self._acknowledge()
        else:
            while self._unacked:
                self._take_ack(me)
        self.wait_all()

    def after_evaluation(self) -> None:
        """After the sums went round (every rank took every acknowledgement)."""
        for _, works in self._acks:
            for work in works:
                work.wait()
        self._acks, self.evaluating = deque(), False

    def settle(self, everything: bool = False) -> None:
        """A step ended well on this rank: the payloads it sent before this step have been received (its
        peers started this step, which they do after receiving all of the previous one's), so their
        shapes are no longer kept for `resync`. `everything`: every message so far has been received (an
        evaluation's end, after the broadcast of its sums), so none is kept."""
        self._ledger.settle()
        if everything:
            self._ledger.settle()

    def settle_after_abort(self, me: int, err: BaseException, resync: bool = True) -> None:
        """Right after `abort`, where every rank of the pipeline is alive and raising too (a stage's own
        error, a stop heard from a peer): `resync` now, so that no GPU stream is left waiting for a message
        that never comes (a known-shape receive) under the user's next call (``full_state_dict()``, a
        checkpoint); its wait for the stops replaces their grace. Not after a peer went away, nor on
        Ctrl-C, nor without `resync` (a rank may be blocked elsewhere): the stops get their grace; if the
        pairing fails, the next step tries again."""
        from ..peer_watch import looks_like_peer_loss

        if (not resync or not isinstance(err, Exception) or getattr(err, "peer_lost", False)
                or looks_like_peer_loss(err)):
            self._grace()
            return
        try:
            self.resync(me)
        except Exception:  # noqa: BLE001 - the step's own error is the one to raise
            self.aborted = True
            self._grace()

    def resync(self, me: int) -> None:
        """After an aborted step (`aborted`), on every rank of the pipeline at once (the engine's next
        step or evaluation): pair up every message of it left unmatched, so that the next step's
        messages pair up as if the failed step had not run. For each sender and receiver, the receiver
        posts a receive for each message sent and not yet received (the stop headers, the headers and
        payloads sent before the sender heard of the failure), and the sender sends a filler (zeros) for
        each receive posted for a message it never sent (on GPUs a known-shape receive is posted before
        its header says the message came). One all-gather of the ranks' ledgers over the header group; a
        peer gone raises there."""
        everyone: list = [None] * len(self.ranks)
        dist.all_gather_object(everyone, self._ledger.to_peers(), group=self.header_group)
        mine = self._ledger
        works = list(self._stale) + list(self._stale_sends)
        for peer, theirs in enumerate(everyone):
            if peer == me:
                continue
            sent_to_me, posted_from_me = theirs[me]  # (headers, payloads log, count), as sender / as receiver
            # This rank receiving from `peer`: what it sent beyond what this rank posted.
            for _ in range(sent_to_me[0] - mine.headers_posted[peer]):
                works.append(dist.irecv(torch.empty(_HEADER, dtype=torch.int64), self.ranks[peer],
                                        group=self.header_group, tag=_HEADER_TAG))
                mine.headers_posted[peer] += 1
            for _ in range(sent_to_me[3] - mine.evals_posted[peer]):  # (its receives are never posted ahead)
                works.append(dist.irecv(torch.empty(_HEADER, dtype=torch.int64), self.ranks[peer],
                                        group=self.header_group, tag=_EVALUATION_TAG))
                mine.evals_posted[peer] += 1
            for code, shape in _beyond(sent_to_me, mine.payloads_posted[peer], me, self.ranks[peer]):
                works.append(dist.irecv(torch.empty(shape, dtype=_DTYPES[code], device=self.device),
                                        self.ranks[peer], group=self._payload_group(peer, me), tag=_PAYLOAD_TAG))
                mine.posted(peer, code, shape)
            # This rank sending to `peer`: fillers for what it posted beyond what this rank sent.
            for _ in range(posted_from_me[0] - mine.headers_sent[peer]):
                works.append(dist.isend(torch.zeros(_HEADER, dtype=torch.int64), self.ranks[peer],
                                        group=self.header_group, tag=_HEADER_TAG))
                mine.headers_sent[peer] += 1
            for code, shape in _beyond(posted_from_me, mine.payloads_sent[peer], me, self.ranks[peer]):
                filler = torch.zeros(shape, dtype=_DTYPES[code], device=self.device)
                works.append(dist.isend(filler, self.ranks[peer], group=self._payload_group(me, peer),
                                        tag=_PAYLOAD_TAG))
                mine.record_sent(peer, code, shape)
        for work in works:
            work.wait()
        self.wait_all()
        self._stale, self._stale_sends, self.aborted = [], [], False

    def wait_all(self) -> None:
        """Wait until every message sent so far has left (the tensors it read may then be reused)."""
        try:
            for works, _, peer in self._in_flight:
                for work in works:
                    try:
                        work.wait()
                    except RuntimeError as err:  # the receiver failed: its process ended, or it stopped listening
                        lost = PipelineAborted(f"pipeline stopped: a message to global rank {self.ranks[peer]} did not "
                                               f"go through, that rank failed ({str(err).splitlines()[0][:200]})")
                        lost.failed_rank, lost.peer_lost = self.ranks[peer], True
                        raise lost from err
        finally:
            self._in_flight.clear()


def _beyond(side: tuple, done: int, me: int, peer: int) -> list[tuple[int, tuple]]:
    """The (dtype code, shape) of the payloads in `side` (headers, log, count) from number `done` on."""
    _, log, count, _ = side
    missing = [(code, shape) for seq, code, shape in log if seq >= done]
    if count > done and len(missing) != count - done:
        raise RuntimeError(f"pipeline: cannot pair the messages between global ranks {me} and {peer} after the "
                           "failed step (some are older than the last step): restart from the latest checkpoint")
    return missing if count > done else []


class _Ledger:
    """What a `StageLink` posted per peer since it was made: headers sent and receives of them posted;
    payloads sent and receives of them posted, each with its dtype code and shape kept for the last steps
    (`settle`). `StageLink.resync` compares them across the pipeline after an aborted step."""

    def __init__(self, ranks: int) -> None:
        self.headers_sent = [0] * ranks
        self.headers_posted = [0] * ranks
        self.payloads_sent = [0] * ranks
        self.payloads_posted = [0] * ranks
        self.evals_sent = [0] * ranks  # an evaluation's acknowledgements and stops (`StageLink.batch_ends`)
        self.evals_posted = [0] * ranks
        # (sequence number, dtype code, shape) of the payloads sent to / posted from each peer
        self._sent_log: list[deque] = [deque() for _ in range(ranks)]
        self._posted_log: list[deque] = [deque() for _ in range(ranks)]
        self._step_start = [(0, 0)] * ranks  # (sent, posted) payload numbers when the current step began

    def sent(self, peer: int, code: int, shape: tuple) -> None:
        """A message (header and payload) sent to `peer`."""
        self.headers_sent[peer] += 1
        self.record_sent(peer, code, shape)

    def record_sent(self, peer: int, code: int, shape: tuple) -> None:
        self._sent_log[peer].append((self.payloads_sent[peer], code, shape))
        self.payloads_sent[peer] += 1

    def posted(self, peer: int, code: int, shape: tuple) -> None:
        """A payload receive posted for `peer`'s message (its header counted where it was posted)."""
        self._posted_log[peer].append((self.payloads_posted[peer], code, shape))
        self.payloads_posted[peer] += 1

    def settle(self) -> None:
        for peer in range(len(self._sent_log)):
            for log, start in zip((self._sent_log[peer], self._posted_log[peer]), self._step_start[peer]):
                while log and log[0][0] < start:
                    log.popleft()
            self._step_start[peer] = (self.payloads_sent[peer], self.payloads_posted[peer])

    def to_peers(self) -> list[tuple[tuple, tuple]]:
        """Per peer: (headers sent to it, the payloads' log, their count, evaluation messages sent) and
        the same of receives posted."""
        return [((self.headers_sent[p], list(self._sent_log[p]), self.payloads_sent[p], self.evals_sent[p]),
                 (self.headers_posted[p], list(self._posted_log[p]), self.payloads_posted[p], self.evals_posted[p]))
                for p in range(len(self._sent_log))]
