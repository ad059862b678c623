"""Session 40: a failure inside a pipeline's `evaluate()` no longer ends the pipeline."""

from __future__ import annotations

import os

import pytest
import torch

from distributed_training.testing import run_distributed


def _chain():
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(8, 8), nn.Tanh())), nn.Linear(8, 2))


class _Flaky(torch.utils.data.Dataset):
    """Samples of a fixed set; sample `bad` raises on global rank `rank` while armed."""

    def __init__(self, n: int, bad: int | None = None, rank: int = 0) -> None:
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 2, generator=g)
        self.bad, self.rank, self.armed = bad, rank, bad is not None

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        if self.armed and i == self.bad and int(os.environ.get("RANK", "0")) == self.rank:
            raise ValueError(f"sample {i} cannot be read")
        return self.x[i], self.y[i]


class _Criterion:
    """MSE that raises on its `fail_at`-th call while armed (the last stage's criterion)."""

    def __init__(self) -> None:
        self.armed, self.calls, self.fail_at = False, 0, 2

    def __call__(self, out, y):
        import torch.nn.functional as F

        self.calls += 1
        if self.armed and self.calls == self.fail_at:
            raise ValueError("the criterion failed")
        return F.mse_loss(out, y)


def eval_failure_worker(rank, world, pipeline, where, schedule, strategy="ddp"):
    import torch.nn.functional as F

    from distributed_training import DistributedTrainer

    net, ref = _chain(), _chain()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    trainer = DistributedTrainer(net, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), progress=False,
                                 strategy=strategy, pipeline_parallel_size=pipeline, pipeline_schedule=schedule, microbatches=4)
    dp, replica = trainer.dp_world_size, trainer.dp_rank
    g = torch.Generator().manual_seed(3)
    criterion = _Criterion()
    stage_of_failure = {"stage": 1, "criterion": pipeline - 1, "data": 0, "metric": pipeline - 1}[where]
    failing_stage = trainer.strategy._pipe_rank == stage_of_failure if pipeline > 1 else True
    layer = trainer.strategy.unwrap(trainer.model).stages[0] if where == "stage" else None
    data = _Flaky(24, bad=9 if where == "data" else None, rank=stage_of_failure)
    said, diffs = [], []

    def boom(module, args):
        raise ValueError("a stage failed in evaluate")

    for step in range(3):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
        n = 16 // dp
        trainer.train_step((x[replica * n:(replica + 1) * n], y[replica * n:(replica + 1) * n]), F.mse_loss)
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        state = trainer.full_state_dict()
        if state:
            diffs.append(max((state[k].cpu() - v).abs().max().item() for k, v in ref.state_dict().items()))
        if step == 0:  # an evaluation that fails on one stage, then training and evaluating on
            hook = layer.register_forward_pre_hook(boom) if where == "stage" and failing_stage else None
            criterion.armed = where == "criterion"
            # (a metric returning a float fails in `evaluate`'s sums on the last stage, after its stages ran:
            # on an evaluation of one batch, after the last rank had acknowledged it, the others hung)
            bad = {"bad": lambda out, y: F.l1_loss(out, y).item()} if where == "metric" else None
            try:
                trainer.evaluate(data, criterion, batch_size=24 if where == "metric" else 4, metrics=bad)
                said.append("passed")
            except Exception as err:  # noqa: BLE001 - every rank of the pipeline raises
                said.append(f"{type(err).__name__}: {err}")
            if hook is not None:
                hook.remove()
            criterion.armed = data.armed = False
    evaluated = trainer.evaluate(data, F.mse_loss, batch_size=4)["loss"]
    with torch.no_grad():
        expected = F.mse_loss(ref(data.x), data.y).item()
    trainer.close()
    return said, diffs, abs(evaluated - expected)


@pytest.mark.parametrize("world,pipeline,where,schedule", [
    (2, 2, "stage", "1f1b"), (2, 2, "criterion", "gpipe"), (2, 2, "data", "1f1b"),
    (4, 4, "stage", "1f1b"), (4, 4, "criterion", "interleaved_1f1b"), (4, 2, "criterion", "1f1b"),
    (2, 2, "metric", "interleaved_1f1b")])
def test_a_pipeline_evaluation_that_failed_leaves_the_pipeline_usable(world, pipeline, where, schedule):
    # The first ranks of an evaluation only send: a later stage's failure cut the pipeline's connections
    # (every later step or evaluation raised "cannot run another step", full_state_dict() too). Now every
    # rank listens for its peers' end or stop during an evaluation, every rank raises, and training and
    # evaluating go on as one process that never ran the failed evaluation.
    results = run_distributed(eval_failure_worker, world, args=(pipeline, where, schedule), timeout=150)
    for said, diffs, evaluated in results:
        assert len(said) == 1 and "passed" not in said[0], said
        assert evaluated < 1e-6, evaluated
    named = {"stage": "a stage failed in evaluate", "criterion": "the criterion failed",
             "data": "sample 9 cannot be read", "metric": "'float' object has no attribute"}[where]
    assert any(named in said[0] for said, _, _ in results), [r[0] for r in results]
    _, diffs, _ = results[0]
    assert len(diffs) == 3 and max(diffs) < 1e-6, diffs


def tied_gpt_failure_worker(rank, world, pipeline, schedule):
    import copy

    from distributed_training import DistributedTrainer
    from distributed_training.models import GPT, GPTConfig
    from distributed_training.pipeline import lm_loss

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=pipeline, n_head=2, n_embd=16, dropout=0.0))
    ref = copy.deepcopy(gpt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    armed = {"on": False, "calls": 0}

    def fail_in_the_last_backward(grad):  # the position embedding: stage 0's; its last action's backward
        if armed["on"]:
            armed["calls"] += 1
            if armed["calls"] == 4:
                raise ValueError("stage 0's last backward failed")
        return grad

    gpt.wpe.weight.register_hook(fail_in_the_last_backward)
    trainer = DistributedTrainer(gpt, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), progress=False,
                                 pipeline_parallel_size=pipeline, pipeline_schedule=schedule, microbatches=4)
    g = torch.Generator().manual_seed(1)
    said, diffs = [], []
    for step in range(3):
        tokens = torch.randint(0, 64, (8, 17), generator=g)
        armed["on"], armed["calls"] = step == 1, 0
        try:
            trainer.train_step((tokens[:, :-1], tokens[:, 1:]))
        except Exception as err:  # noqa: BLE001 - every rank skips the batch
            said.append(type(err).__name__)
        else:
            lm_loss(ref(tokens[:, :-1]), tokens[:, 1:]).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        state = trainer.full_state_dict()
        if state:
            diffs.append(max((state[k].cpu() - v).abs().max().item() for k, v in ref.state_dict().items()))
    trainer.close()
    return said, diffs


@pytest.mark.parametrize("world,schedule", [(2, "1f1b"), (4, "gpipe")])
def test_a_tied_gpt_trains_on_after_the_first_stage_failed_in_its_last_backward(world, schedule):
    # The last stage had finished its schedule and waited in the tied weights' all-reduce, which the first
    # stage, after its abort, never joined (it waited in the pairing of messages): both hung for good (a
    # trial). The tied copies are now summed once the step's end is agreed.
    results = run_distributed(tied_gpt_failure_worker, world, args=(world, schedule), timeout=120)
    for said, _ in results:
        assert len(said) == 1, said
    _, diffs = results[0]
    assert len(diffs) == 3 and max(diffs) < 1e-6, diffs


@pytest.mark.parametrize("world,pipeline", [(2, 2), (2, 1)])
def test_zero1_drops_the_gradients_of_a_failed_first_step(world, pipeline):
    # The first step's passes under no_sync (a pipeline's microbatches, gradient accumulation) leave fresh
    # gradients on the parameters, which only a reduction makes views into ZeRO-1's buckets; the optimizer
    # steps the buckets' slices, so its zero_grad after a failed first step left them, and they joined the
    # next step's (4.3e-2 off one process; a trial). Zeroing the buckets now drops them too.
    from test_trial_s39 import pipeline_retry_worker

    results = run_distributed(pipeline_retry_worker, world, args=(pipeline, "1f1b", "forward", "zero1", 0),
                              timeout=120)
    for said, diffs, evaluated in results:
        assert len(said) == 1 and evaluated < 1e-6, (said, evaluated)
    said, diffs, _ = results[0]
    assert len(diffs) == 4 and max(diffs) < 1e-6, diffs


def held_sends_worker(rank, world):
    import torch.nn.functional as F

    from distributed_training import DistributedTrainer

    trainer = DistributedTrainer(_chain(), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False,
                                 pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b", microbatches=4)
    link, held = trainer.strategy.engine.link, []

    def in_flight(out, y):  # on the last stage, after its stages ran on a batch
        held.append(len(link._in_flight) + len(link._acks))
        return out.sum() * 0

    trainer.evaluate(_Flaky(80), F.mse_loss, batch_size=2, metrics={"held": in_flight})
    trainer.close()
    return held


def test_the_last_rank_holds_no_earlier_batch_in_an_interleaved_evaluation():
    # Interleaved, the last rank also sends (to rank 0's second chunk): those sends, and its
    # acknowledgements, were waited for only at the evaluation's end, one batch's activations more each
    # batch (a review). Now both are waited for as soon as they must have been taken.
    held = [r for r in run_distributed(held_sends_worker, 2, timeout=90) if r][0]
    assert len(held) == 40 and max(held) <= 3, held


def _compressed_run(method, fail):
    """P = 2 x DP = 2 with compression in the stages, 3 steps; step 1 fails in stage 0's last backward
    (`fail`) or is skipped; the full weights after each step (rank 0)."""
    import torch.nn.functional as F

    from distributed_training import CommunicationOptimizer, DistributedTrainer

    net = _chain()
    armed = {"on": False, "calls": 0}

    def fail_last(grad):
        if armed["on"]:
            armed["calls"] += 1
            if armed["calls"] == 4:
                raise ValueError("stage 0's last backward failed")
        return grad

    net[0].weight.register_hook(fail_last)
    communication = (CommunicationOptimizer("topk", compression_ratio=0.3) if method == "topk"
                     else CommunicationOptimizer("powersgd", powersgd_rank=1))
    trainer = DistributedTrainer(net, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), progress=False,
                                 pipeline_parallel_size=2, microbatches=4, communication=communication)
    g = torch.Generator().manual_seed(2)
    states = []
    for step in range(3):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
        mine = slice(8 * trainer.dp_rank, 8 * trainer.dp_rank + 8)
        armed["on"], armed["calls"] = fail and step == 1, 0
        if step == 1 and not fail:
            continue
        try:
            trainer.train_step((x[mine], y[mine]), F.mse_loss)
        except Exception:  # noqa: BLE001 - every rank skips the batch
            pass
        states.append(trainer.full_state_dict())
    trainer.close()
    return states


def compressed_failure_worker(rank, world, method):
    failed, skipped = _compressed_run(method, True), _compressed_run(method, False)
    if not failed[0]:
        return None
    return [max((a[k] - b[k]).abs().max().item() for k in a) for a, b in zip(failed[::2], skipped)]


@pytest.mark.parametrize("method", ["topk", "powersgd"])
def test_compression_keeps_nothing_of_a_step_an_earlier_stage_dropped_late(method):
    # The last stage reduced over its data-parallel group as soon as its schedule ended, before stage 0's
    # last backward raised: the error-feedback residuals (PowerSGD's matrices) kept the dropped step
    # (6.9e-3 / 2.6e-3 off the run that skipped it; a trial). Such reductions wait for the step's end now.
    diffs = [r for r in run_distributed(compressed_failure_worker, 4, args=(method,), timeout=150) if r][0]
    assert max(diffs) == 0, diffs


def hooked_parameter_worker(rank, world, strategy):
    from distributed_training import DistributedTrainer

    net = _chain()
    net[2].weight.register_hook(lambda grad: grad * 0.5)
    try:
        DistributedTrainer(net, lambda ps: torch.optim.SGD(ps, lr=0.1), strategy=strategy, progress=False).close()
        return "built"
    except ValueError as err:
        return str(err)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_sharded_strategies_refuse_a_parameter_hook_they_would_never_run(strategy):
    # FSDP's units replace the parameters by views of flat buffers: a hook on a parameter never ran, and
    # the weights silently differed from one process's (1.1e-3 after a step; a trial).
    for said in run_distributed(hooked_parameter_worker, 2, args=(strategy,), timeout=90):
        assert "parameter '2.weight' has a gradient hook of its own" in said, said


def half_block_hook_worker(rank, world):
    from distributed_training import DistributedTrainer
    from distributed_training.models import GPT, GPTConfig

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.0))
    gpt.blocks[1].register_forward_hook(lambda module, args, out: out * 0.9)
    try:
        DistributedTrainer(gpt, lambda ps: torch.optim.SGD(ps, lr=0.1), pipeline_parallel_size=2, microbatches=2,
                           pipeline_half_blocks=True, progress=False).close()
        return "built"
    except ValueError as err:
        return str(err)


def test_half_blocks_refuse_a_hook_on_a_block_they_never_call():
    # The chain of halves calls a block's attention and MLP parts: a hook on the block never ran, and the
    # training silently differed from one process's (6.8e-3 after a step; a trial).
    for said in run_distributed(half_block_hook_worker, 2, timeout=90):
        assert "the hook registered on blocks.1 would not run" in said, said


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, delay):
        ctx.delay = delay
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import time

        time.sleep(ctx.delay)
        return grad, None


def ddp_dropped_backward_worker(rank, world):
    import torch.nn.functional as F

    from distributed_training import DDP

    net, ref = _chain(), _chain()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    armed = {"on": False}

    def fail(grad):  # the first layer's: reached after the later layers' buckets were launched
        if armed["on"]:
            raise ValueError("a backward failed")
        return grad

    net[0].weight.register_hook(fail)
    device = torch.device("cuda", rank) if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = DDP(net.to(device), bucket_cap_mb=0.0001, first_bucket_cap_mb=0.0001)  # a bucket a layer
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(4)
    diffs = []
    for step in range(4):
        x, y = torch.randn(12, 8, generator=g), torch.randn(12, 2, generator=g)
        armed["on"] = step == 1
        try:
            delay = 0.3 if rank == 1 and step == 1 else 0.0
            out = _SlowBackward.apply(model(x[6 * rank:6 * rank + 6].to(device)), delay)
            F.mse_loss(out, y[6 * rank:6 * rank + 6].to(device)).backward()
            opt.step()
        except ValueError:
            pass
        opt.zero_grad()
        if step != 1:
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        diffs.append(max((a.cpu() - b).abs().max().item() for a, b in zip(net.parameters(), ref.parameters())))
    return diffs


def test_ddp_waits_for_what_a_failed_backward_launched_before_the_next_one():
    # A backward that raised after some buckets' all-reduces started left them in flight: one finished
    # after the next backward had copied its gradients into the bucket (2.2e-2 off one process that skipped
    # the batch; a trial). The next forward now waits for them, and drops them.
    for diffs in run_distributed(ddp_dropped_backward_worker, 2, timeout=90):
        assert max(diffs) < 1e-6, diffs


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_a_failed_accumulation_leaves_no_full_gradient_behind(strategy):
    # Under ZeRO-2/3 the micro-batches accumulated under no_sync before the one that raised stayed in the
    # units' full gradients, which the optimizer's zero_grad (over the shards) never reached: they joined
    # the next step's (2.9e-2 off one process that skipped the batch; a trial).
    from test_trial_s39 import pipeline_retry_worker

    results = run_distributed(pipeline_retry_worker, 2, args=(1, "1f1b", "forward", strategy, 1), timeout=120)
    for said, diffs, evaluated in results:
        assert len(said) == 1 and evaluated < 1e-6, (said, evaluated)
    assert max(results[0][1]) < 1e-6, results[0][1]


def one_replica_eval_failure_worker(rank, world, record):
    import json

    import torch.nn.functional as F

    import distributed_training.failure_agreement as agreement
    from distributed_training import DistributedTrainer

    agreement.AGREE_S = 3.0
    trainer = DistributedTrainer(_chain(), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False,
                                 pipeline_parallel_size=2, microbatches=2, heartbeat_timeout=2.0)
    trainer._peer_exit_after = 1.0
    trainer.train_step((torch.randn(4, 8), torch.randn(4, 2)), F.mse_loss)  # (starts the peer watch)
    said = []
    for call in (lambda: trainer.evaluate(_Flaky(16, bad=0, rank=0), F.mse_loss, batch_size=2),
                 lambda: trainer.train_step((torch.randn(4, 8), torch.randn(4, 2)), F.mse_loss)):
        try:
            call()
            said.append("passed")
        except Exception as err:  # noqa: BLE001
            said.append(str(err))
    with open(f"{record}.{rank}", "w") as f:
        json.dump(said, f)
    trainer.close(barrier=False)
    return said


def test_a_failure_in_one_replicas_pipeline_only_stops_the_job_instead_of_pairing_wrongly(tmp_path):
    # A failed evaluation on one data-parallel replica only (its sample 0 unreadable on rank 0): the other
    # replica finished and waited in the sums' reduction, which the failed replica's next training step
    # would have completed with its gradients (gloo: a collective mismatch, or a silent mix; a review).
    # Now the next call waits for the job's other ranks to have failed too, and refuses to go on.
    import json

    from _failures import failure_report

    report = failure_report(one_replica_eval_failure_worker, 4, args=(str(tmp_path / "said"),), timeout=120)
    for rank in (1, 3):  # (the other replica, the pipeline of ranks 1 and 3: its peer watch names rank 0, or
        path = tmp_path / f"said.{rank}"  # ends it where its collective cannot be woken)
        if path.exists():
            said = json.loads(path.read_text())
            assert all("raised ValueError: sample 0 cannot be read" in s for s in said), said
        else:
            assert f"--- rank {rank} failed ---\nprocess exited with code 75" in report, report
    said = [json.loads((tmp_path / f"said.{rank}").read_text()) for rank in (0, 2)]
    assert all(len(s) == 2 and "passed" not in s for s in said), said  # (no call went on)
    assert all("the evaluation after step 1 failed on 2 of the job's 4 ranks only" in s[1] or "peer rank" in s[1]
               for s in said), said  # (refused, or a peer found ended first)


def interrupted_step_worker(rank, world, strategy):
    import torch.nn.functional as F

    from distributed_training import DistributedTrainer

    net, ref = _chain(), _chain()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    armed = {"on": False}

    def interrupt(grad):  # the first layer's: the later layers' gradients are in by then
        if armed["on"]:
            raise KeyboardInterrupt
        return grad

    net[0].weight.register_hook(interrupt)
    trainer = DistributedTrainer(net, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), strategy=strategy,
                                 progress=False)
    g = torch.Generator().manual_seed(4)
    diffs = []
    for step in range(3):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g)
        armed["on"] = step == 1
        try:
            trainer.train_step((x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]), F.mse_loss)
        except KeyboardInterrupt:
            pass
        if step != 1:
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        state = trainer.full_state_dict()
        if state:
            diffs.append(max((state[k] - v).abs().max().item() for k, v in ref.state_dict().items()))
    trainer.close()
    return diffs


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_a_step_interrupted_by_ctrl_c_leaves_no_gradient_behind(strategy):
    # Ctrl-C caught around train_step (a notebook's interrupt): the interrupted backward's gradients were
    # dropped only for an Exception, and joined the next step's (3.8e-2 off; a trial).
    diffs = [r for r in run_distributed(interrupted_step_worker, 2, args=(strategy,), timeout=90) if r][0]
    assert len(diffs) == 3 and max(diffs) < 1e-6, diffs


def one_rank_step_failure_worker(rank, world, record, where):
    import json

    import torch.nn.functional as F

    import distributed_training.failure_agreement as agreement
    from distributed_training import DistributedTrainer

    agreement.AGREE_S = 3.0
    net = _chain()
    armed = {"on": False}

    def fail(module, args, out):
        if armed["on"]:
            raise ValueError("rank 1's batch is bad")

    net[0].register_forward_hook(fail)
    trainer = DistributedTrainer(net, lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False, heartbeat_timeout=2.0)
    trainer._peer_exit_after = 1.0
    if where == "optimizer" and rank == 1:
        step = trainer.optimizer.step

        def failing_step(*args, **kwargs):
            if armed["on"]:
                raise RuntimeError("CUDA out of memory (injected)")
            return step(*args, **kwargs)

        trainer.optimizer.step = failing_step
    said = []
    for k in range(4):
        armed["on"] = k == 1 and rank == 1 and where in ("forward", "optimizer")
        try:
            trainer.train_step((torch.randn(4, 8), torch.randn(4, 2)), lambda out, y: F.mse_loss(out, y, reduction="sum"))
            said.append("ok")
        except Exception as err:  # noqa: BLE001 - a script catching a bad batch and going on
            said.append(str(err))
        with open(f"{record}.{rank}", "w") as f:
            json.dump(said, f)
    trainer.close(barrier=False)
    return said


@pytest.mark.parametrize("where", ["forward", "optimizer"])
def test_a_step_failed_on_one_rank_only_is_not_trained_past(tmp_path, where):
    # One rank's forward (or optimizer step) raised, the script caught it and went on: that rank's next
    # steps' collectives paired with its peer's pending ones, and it completed "ok" steps 5.2e-2 off one
    # process (forward; a trial), or the replicas drifted apart (optimizer). Now its next call waits for
    # every rank to have failed the step too, and refuses.
    import json

    from _failures import failure_report

    failure_report(one_rank_step_failure_worker, 2, args=(str(tmp_path / "said"), where), timeout=120)
    said = json.loads((tmp_path / "said.1").read_text())
    assert said[0] == "ok" and "ok" not in said[1:], said
    assert any("failed on 1 of the job's 2 ranks only" in s or "peer rank 0" in s for s in said[2:]), said


def every_rank_fails_worker(rank, world):
    import time

    import torch.nn.functional as F

    from distributed_training import DistributedTrainer

    net = _chain()
    armed = {"on": False}

    def fail(module, args, out):  # every rank fails the step, each its own way, in words that look like a peer's
        if armed["on"]:
            raise ValueError("v") if rank == 0 else KeyError("peer_id: the lookup timed out")

    net[0].register_forward_hook(fail)
    trainer = DistributedTrainer(net, lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False)
    said, started = [], time.monotonic()
    for k in range(3):
        armed["on"] = k == 1
        try:
            trainer.train_step((torch.randn(4, 8), torch.randn(4, 2)), F.mse_loss)
            said.append("ok")
        except Exception:  # noqa: BLE001 - every rank skips the batch
            said.append("failed")
    trainer.close()
    return said, time.monotonic() - started


def test_a_step_every_rank_failed_is_agreed_whatever_its_words():
    # The agreement skipped errors by their text ("timeout", "peer": a user's TypeError about a `timeout`
    # argument, a KeyError 'peer_id'): the trainer then refused for good, or one rank went on while the
    # other waited 30 s (a review). Only a peer's failure, by type, is not counted now.
    for said, seconds in run_distributed(every_rank_fails_worker, 2, timeout=90):
        assert said == ["ok", "failed", "ok"] and seconds < 20, (said, seconds)
