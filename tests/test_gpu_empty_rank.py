"""On one GPU with NCCL: a rank holding no parameter puts its collectives' tensors on the GPU (NCCL
refuses CPU tensors), as a pipeline stage of only activations needs; skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed_training.testing import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def empty_rank_worker(rank, world):
    from distributed_training import FSDP
    from distributed_training.amp import DynamicLossScaler
    from distributed_training.runtime import collective_device

    scaler = DynamicLossScaler()
    overflow = scaler.unscale_([])  # no gradient on this rank: the flag still on the GPU
    return [str(collective_device()), str(collective_device(None, torch.device("cpu"))),
            str(FSDP(nn.Sequential(nn.ReLU())).device), overflow]


def test_an_empty_rank_collects_on_the_gpu_under_nccl():
    got = run_distributed(empty_rank_worker, 1, backend="nccl", timeout=120)[0]
    assert got[:3] == ["cuda:0"] * 3 and got[3] is False, got
