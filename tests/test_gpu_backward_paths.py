"""On 2 GPUs with NCCL, session 38's backward paths against one CPU process after every step: two backward
passes before one step, reentrant activation checkpointing (outputs as a tensor and as a dataclass, the end
of the backward queued from a hook on them or from FSDP's recomputation), and a batch skipped after its
backward raised (skipped without 2 GPUs)."""

from __future__ import annotations

import pytest
import torch

from distributed_training.testing import run_distributed

from test_trial_s38 import failed_step_worker, reentrant_worker, two_backward_worker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)]

CLOSE = 1e-4  # a GPU's float32 against the CPU reference


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_nccl_two_backward_passes_before_a_step(strategy):
    diffs = run_distributed(two_backward_worker, 2, args=(strategy, "sync"), backend="nccl", timeout=180)
    assert diffs[1] == [] and len(diffs[0]) == 3 and max(diffs[0]) < CLOSE, diffs


@pytest.mark.parametrize("strategy,as_dataclass", [("ddp", False), ("zero3", False), ("ddp", True), ("zero3", True)])
def test_nccl_reentrant_checkpointing(strategy, as_dataclass):
    (diffs, warned), (_, warned1) = run_distributed(reentrant_worker, 2, args=(strategy, as_dataclass),
                                                    backend="nccl", timeout=180)
    assert len(diffs) == 3 and max(diffs) < CLOSE and warned == warned1 == [], (diffs, warned, warned1)


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_nccl_a_batch_skipped_after_its_backward_raised(strategy):
    diff, _ = run_distributed(failed_step_worker, 2, args=(strategy,), backend="nccl", timeout=180)
    assert diff < CLOSE, diff
