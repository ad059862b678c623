"""Our DDP as an ordinary nn.Module: state_dict keys like torch's DDP, and torch.compile in either order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distributed_training import DDP
from distributed_training.testing import run_distributed

from _models import ConvBN


def state_dict_worker(rank, world):
    torch.manual_seed(0)
    model = ConvBN()
    ddp = DDP(model)
    sd = ddp.state_dict()
    # As torch's DDP: the wrapped module's entries under "module.", buffers included.
    assert list(sd) == ["module." + k for k in model.state_dict()], list(sd)[:4]
    assert [n for n, _ in ddp.named_buffers()] == ["module." + n for n, _ in model.named_buffers()]
    changed = {k: v + 1 if v.is_floating_point() else v for k, v in sd.items()}
    ddp.load_state_dict(changed)
    assert all(torch.equal(model.state_dict()[k[len("module."):]], v) for k, v in changed.items())
    return True


@pytest.mark.slow
def test_ddp_state_dict_and_buffers_like_torch_ddp():
    assert run_distributed(state_dict_worker, 2, timeout=120) == [True, True]


def compile_worker(rank, world, order):
    """Each step, the compiled run's parameters and BatchNorm buffers equal the eager run's."""
    torch.manual_seed(0)
    eager_model, compiled_model = ConvBN(), ConvBN()
    compiled_model.load_state_dict(eager_model.state_dict())
    eager = DDP(eager_model)
    if order == "compile(ddp)":
        compiled = torch.compile(DDP(compiled_model), backend="eager")
    else:
        compiled = DDP(torch.compile(compiled_model, backend="eager"))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager_model, compiled_model)]
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(4):
        x, y = torch.randn(6, 3, 8, 8, generator=g), torch.randint(0, 5, (6,), generator=g)
        for wrapped, opt in zip((eager, compiled), opts):
            F.cross_entropy(wrapped(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        for (name, a), b in zip(eager_model.state_dict().items(), compiled_model.state_dict().values()):
            assert torch.allclose(a.float(), b.float(), atol=1e-6), (order, step, name)
    return True


@pytest.mark.slow
def test_torch_compile_in_either_order_matches_eager():
    for order in ("compile(ddp)", "ddp(compile)"):
        assert run_distributed(compile_worker, 2, args=(order,), timeout=240) == [True, True]
