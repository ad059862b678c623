"""On 2+ GPUs with NCCL: our DDP equals torch's DDP step for step (skipped without them)."""

from __future__ import annotations

import copy

import pytest
import torch

from distributed_training.testing import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)]


def nccl_parity_worker(rank: int, world: int) -> float:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from distributed_training import DDP, init_distributed
    from distributed_training.models import GPT, GPTConfig

    ctx = init_distributed()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=3, n_head=4, n_embd=128)).to(ctx.device)
    ours = DDP(copy.deepcopy(base), bucket_cap_mb=0.5)
    ref = TorchDDP(copy.deepcopy(base), device_ids=[ctx.device.index], bucket_cap_mb=0.5)
    opt_o = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    worst = 0.0
    g = torch.Generator(device=ctx.device).manual_seed(rank)
    for _ in range(6):
        idx = torch.randint(0, 512, (4, 64), device=ctx.device, generator=g)
        for model, opt in ((ours, opt_o), (ref, opt_r)):
            model(idx, torch.roll(idx, -1, 1)).backward()
            opt.step()
            opt.zero_grad()
        for a, b in zip(ours.module.parameters(), ref.module.parameters()):
            worst = max(worst, (a - b).abs().max().item())
    return worst


def test_nccl_parity_with_torch_ddp():
    worst = run_distributed(nccl_parity_worker, 2, backend="nccl", timeout=300)
    assert max(worst) <= 1e-5, worst
