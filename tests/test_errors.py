"""Bad input gets a clear error that names the culprit, on every rank, and never a hang."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed_training import DDP, FSDP, CommunicationOptimizer, DistributedTrainer, init_distributed
from distributed_training.testing import run_distributed

from _models import MLP, Branchy


def _catch(fn):
    try:
        fn()
    except Exception as err:  # the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return None


# ------------------------------------------------------------ mismatched models
def mismatched_shape_worker(rank, world):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3 if rank != 1 else 5))
    return _catch(lambda: DDP(model))


def mismatched_count_worker(rank, world):
    layers = [nn.Linear(4, 4) for _ in range(2 if rank != world - 1 else 3)]
    return _catch(lambda: DDP(nn.Sequential(*layers)))


def test_mismatched_shapes_fail_on_every_rank():
    messages = run_distributed(mismatched_shape_worker, 2, timeout=60)
    for msg in messages:
        assert msg is not None and msg.startswith("ValueError"), messages
        assert "'2.weight'" in msg and "rank 1" in msg and "[5, 8]" in msg and "[3, 8]" in msg, msg


def test_mismatched_parameter_count_fails_on_every_rank():
    messages = run_distributed(mismatched_count_worker, 3, timeout=60)
    for msg in messages:
        assert msg is not None and "rank 2" in msg and "2.weight" in msg, messages


# ------------------------------------------------------------- unused parameters
def globally_unused_worker(rank, world):
    ddp = DDP(Branchy())  # `never` and `branch_b` get no gradient
    x = torch.randn(4, 8)
    return _catch(lambda: F.mse_loss(ddp(x, False), torch.zeros(4, 4)).backward())


def locally_unused_worker(rank, world):
    ddp = DDP(Branchy())
    del ddp.module.never  # keep only the rank-dependent branch unused
    ddp = DDP(ddp.module)
    x = torch.randn(4, 8)
    started = time.monotonic()
    msg = _catch(lambda: F.mse_loss(ddp(x, rank == 0), torch.zeros(4, 4)).backward())
    return msg, time.monotonic() - started


def test_unused_parameter_without_flag_names_it():
    messages = run_distributed(globally_unused_worker, 2, timeout=60)
    for rank, msg in enumerate(messages):
        assert msg is not None and msg.startswith("RuntimeError"), messages
        assert "never.weight" in msg and "branch_b.weight" in msg and f"rank {rank}" in msg, msg
        assert "find_unused_parameters=True" in msg


def test_locally_unused_parameter_errors_without_hanging():
    (msg0, t0), (msg1, t1) = run_distributed(locally_unused_worker, 2, timeout=60, collective_timeout=30)
    assert msg0 is None, msg0  # rank 0 used every parameter: its backward completes
    assert msg1 is not None and "branch_b.weight" in msg1 and "rank 1" in msg1, msg1
    assert max(t0, t1) < 20, "the error must come at once, not after a collective timeout"


# ---------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("cap", [0, -1, "25", float("nan"), True])
def test_bad_bucket_cap(cap):
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DDP(MLP(), bucket_cap_mb=cap)


def test_bucket_size_given_twice_must_agree():
    with pytest.raises(ValueError, match=r"bucket_cap_mb=1.*bucket_size_mb=2"):
        DDP(MLP(), bucket_cap_mb=1, communication=CommunicationOptimizer(bucket_size_mb=2))


def test_fsdp_node_size_without_hybrid_sharding_is_an_error():
    with pytest.raises(ValueError, match="ranks_per_node=2.*hybrid"):
        FSDP(MLP(), ranks_per_node=2)


def test_ddp_rejects_non_modules_and_double_wrapping():
    with pytest.raises(TypeError, match="nn.Module"):
        DDP(lambda x: x)


def test_ddp_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_distributed"):
        DDP(MLP())


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
        ({"gradient_accumulation_steps": 1.5}, "gradient_accumulation_steps"),
        ({"gradient_clip_val": -1.0}, "gradient_clip_val"),
        ({"strategy": "zero9"}, "strategy"),
        ({"context": object(), "timeout": 5.0}, "timeout"),  # would be ignored: the context has its own
    ],
)
def test_trainer_bad_arguments(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DistributedTrainer(MLP(), lambda ps: torch.optim.SGD(ps, lr=0.1), **kwargs)


def test_trainer_rejects_non_modules():
    with pytest.raises(TypeError, match="model"):
        DistributedTrainer("not a model", lambda ps: torch.optim.SGD(ps, lr=0.1))


# ---------------------------------------------------------------------- runtime
def test_runtime_bad_environment(monkeypatch):
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ValueError, match="RANK"):
        init_distributed()
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK=3"):
        init_distributed()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        init_distributed(device="cpu")
    with pytest.raises(ValueError, match="timeout"):
        init_distributed(timeout=-5)


@pytest.mark.slow
def test_plain_python_runs_as_world_of_one(tmp_path, warm_python):
    code = (
        "import torch, torch.nn as nn\n"
        "from distributed_training import init_distributed, DDP\n"
        "ctx = init_distributed()\n"
        "m = DDP(nn.Linear(3, 2)); m(torch.ones(4, 3)).sum().backward()\n"
        "print(ctx.world_size, ctx.rank, ctx.backend, ctx.device, tuple(m.module.weight.grad.shape))\n"
        "ctx.shutdown()\n"
        "import torch.distributed as dist; print(dist.is_initialized())\n"
    )
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = warm_python(["-c", code], env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "0", "gloo", "cpu", "(2,", "3)", "False"], out.stdout


def timeout_worker(rank, world, store):
    # The harness initialised a group; this test exercises the runtime's own, with a short timeout.
    import torch.distributed as dist

    dist.destroy_process_group()
    ctx = init_distributed(timeout=2.0, init_method=f"file://{store}")
    done = store + ".rank0_done"
    try:
        if rank == 1:
            # Never joins the all-reduce below, and stays alive until rank 0's has ended (at most 60 s):
            # a wait for rank 0's word rather than a fixed sleep.
            deadline = time.monotonic() + 60
            while not os.path.exists(done) and time.monotonic() < deadline:
                time.sleep(0.05)
            return None
        started = time.monotonic()
        try:
            msg = _catch(lambda: dist.all_reduce(torch.ones(1)))
        finally:
            open(done, "w").close()
        return msg, time.monotonic() - started
    finally:
        ctx.shutdown()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # for the harness to destroy


@pytest.mark.slow
def test_collective_timeout_is_configurable(tmp_path):
    results = run_distributed(timeout_worker, 2, args=(str(tmp_path / "store"),), timeout=90)
    msg, elapsed = results[0]
    assert msg is not None, "the all-reduce should have timed out"
    assert elapsed < 5.5, f"timed out after {elapsed:.1f}s, expected about 2s"


def test_an_optimizer_over_other_parameters_is_refused_and_a_partly_foreign_one_warned(monkeypatch):
    # Built over another module it trained nothing, silently; a criterion's own parameters in it drift per rank.
    from distributed_training.trainer_arguments import check_optimizer

    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"optimizer: 2 of its 2 parameters .* not the model's"):
        check_optimizer(torch.optim.SGD(other.parameters(), lr=0.1), model)
    with pytest.warns(UserWarning, match=r"1 of its 3 parameters \(indices \[2\]\)"):
        check_optimizer(torch.optim.SGD([*model.parameters(), other.bias], lr=0.1), model)
    check_optimizer(torch.optim.SGD([model.weight], lr=0.1), model)  # a subset: the rest frozen, fine
    check_optimizer(lambda params: torch.optim.SGD(params, lr=0.1), model)
    with torch.device("meta"):  # its meta tensors are replaced when the model gets storage: it trained nothing
        meta = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="meta device"):
        check_optimizer(torch.optim.SGD(meta.parameters(), lr=0.1), meta)
