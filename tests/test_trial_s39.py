"""Session 39's findings, each test failing on the code before its fix."""

from __future__ import annotations

import pytest
import torch

from distributed_training.testing import run_distributed


class _Adapted(torch.nn.Module):
    """A frozen base with a trainable adapter that can be switched off (as PEFT's LoRA)."""

    def __init__(self) -> None:
        super().__init__()
        self.base, self.adapter = torch.nn.Linear(6, 4), torch.nn.Linear(6, 4)
        self.base.requires_grad_(False)
        self.adapter_on = True

    def forward(self, x):
        return self.base(x) + (self.adapter(x) if self.adapter_on else 0)


def _reference_pass_steps(model, net, optimizer, xs, rank, world):
    """Steps of a DPO-like loop: a reference forward with the adapter switched off (PEFT's
    ``disable_adapter()``, which sets its flags to False and back) under no_grad, then a training one."""
    n = xs[0].shape[0] // world
    for x in xs:
        mine = x[rank * n:(rank + 1) * n]
        with torch.no_grad():
            net.adapter_on = False
            net.adapter.requires_grad_(False)
            reference = model(mine)
            net.adapter.requires_grad_(True)
            net.adapter_on = True
        (model(mine) - reference - 1).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        yield


def reference_pass_worker(rank, world, strategy):
    from distributed_training import DistributedTrainer

    torch.manual_seed(0)
    net, ref = _Adapted(), _Adapted()
    ref.load_state_dict(net.state_dict())
    trainer = DistributedTrainer(net, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), strategy=strategy,
                                 progress=False)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 6, generator=g) for _ in range(3)]
    ref_steps = _reference_pass_steps(ref, ref, torch.optim.SGD(ref.adapter.parameters(), lr=0.1, momentum=0.9),
                                      xs, 0, 1)
    diffs = []
    for _ in _reference_pass_steps(trainer.model, net, trainer.optimizer, xs, rank, world):
        next(ref_steps)
        state = trainer.full_state_dict()
        if state:
            diffs.append(max((state[k].cpu() - v).abs().max().item() for k, v in ref.state_dict().items()))
    trainer.close()
    return diffs


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_a_reference_pass_with_an_adapter_switched_off_under_no_grad(strategy):
    # DDP's flag check ran on forwards under no_grad too ("parameter 'adapter.weight' was frozen after DDP
    # wrapped the model"); ZeRO-2/3's requires_grad_ raised at the call itself.
    diffs = run_distributed(reference_pass_worker, 2, args=(strategy,), timeout=90)[0]
    assert len(diffs) == 3 and max(diffs) < 1e-6, diffs
