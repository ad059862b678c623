"""On 2 GPUs with NCCL: a pipeline step that raised on one stage, caught on every rank, leaves the pipeline
usable (the next step first receives what the failed one left in flight, known-shape receives included),
and training goes on as one process that skipped that batch; the same after a failed evaluation (skipped
without 2 GPUs)."""

from __future__ import annotations

import pytest
import torch

from distributed_training.testing import run_distributed

from test_trial_s39 import pipeline_retry_worker
from test_trial_s40 import eval_failure_worker, tied_gpt_failure_worker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)]


@pytest.mark.parametrize("schedule,where", [("1f1b", "forward"), ("zbh1", "backward"), ("gpipe", "backward")])
def test_nccl_pipeline_trains_on_after_a_failed_step(schedule, where):
    results = run_distributed(pipeline_retry_worker, 2, args=(2, schedule, where), backend="nccl", timeout=180)
    for said, diffs, evaluated in results:
        assert len(said) == 1 and evaluated < 1e-4, (said, evaluated)
    said, diffs, _ = results[0]
    assert len(diffs) == 4 and max(diffs) < 1e-4, diffs  # (a GPU's float32 against the CPU reference)


@pytest.mark.parametrize("world,where,schedule", [(2, "stage", "1f1b"), (2, "criterion", "gpipe"), (2, "data", "1f1b"),
                                                  (4, "stage", "interleaved_1f1b")])
def test_nccl_pipeline_goes_on_after_a_failed_evaluation(world, where, schedule):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    results = run_distributed(eval_failure_worker, world, args=(world, where, schedule), backend="nccl", timeout=180)
    for said, diffs, evaluated in results:
        assert len(said) == 1 and "passed" not in said[0] and evaluated < 1e-4, (said, evaluated)
    said, diffs, _ = results[0]
    assert len(diffs) == 3 and max(diffs) < 1e-4, diffs


def test_nccl_tied_gpt_trains_on_after_the_first_stage_failed_in_its_last_backward():
    # On NCCL the last stage's host did not wait in the tied weights' all-reduce: its stream did, and the
    # next step's all-reduce of the first stage paired with it (a step's sums shifted by one).
    results = run_distributed(tied_gpt_failure_worker, 2, args=(2, "1f1b"), backend="nccl", timeout=180)
    for said, _ in results:
        assert len(said) == 1, said
    _, diffs = results[0]
    assert len(diffs) == 3 and max(diffs) < 1e-4, diffs
