"""On 2 GPUs with NCCL: FSDP ranks that ran different units raise on every rank, naming them (there NCCL's
all-gathers of two equal-sized units pair up without any error), and one unit for the experts trains as one
process does (skipped without 2 GPUs)."""

from __future__ import annotations

import pytest
import torch

from distributed_training.testing import run_distributed

from test_trial_s36 import experts_worker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)]


def test_nccl_ranks_running_different_fsdp_units_raise():
    for outcome, said, unchanged in run_distributed(experts_worker, 2, args=(False,), backend="nccl", timeout=180):
        assert outcome == "raised" and "rank 0 gathered 'moe.experts.1'; rank 1 gathered 'moe.experts.0'" in said, said
        assert unchanged
    for outcome, worst, _ in run_distributed(experts_worker, 2, args=(True,), backend="nccl", timeout=180):
        assert outcome == "trained" and worst < 1e-4, (outcome, worst)  # (GPU against the CPU reference)

