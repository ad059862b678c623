"""On 2 GPUs with NCCL: session 40's failure agreement and cleanup after a failed step, and session 41's
peer watch from the first collective call (skipped without 2 GPUs). NCCL's collectives run on the GPU's
stream, so a rank's host may be a step ahead of where its peer failed: what CPU tests cannot show."""

from __future__ import annotations

import json

import pytest
import torch

from distributed_training.testing import run_distributed

from _failures import failure_report
from test_trial_s40 import ddp_dropped_backward_worker, every_rank_fails_worker, one_rank_step_failure_worker
from test_trial_s41 import check_first_call_failure_named, first_call_failure_worker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)]


def test_nccl_a_step_every_rank_failed_is_agreed_and_training_goes_on():
    for said, seconds in run_distributed(every_rank_fails_worker, 2, backend="nccl", timeout=120):
        assert said == ["ok", "failed", "ok"] and seconds < 30, (said, seconds)


@pytest.mark.parametrize("where", ["forward", "optimizer"])
def test_nccl_a_step_failed_on_one_rank_only_is_not_trained_past(tmp_path, where):
    failure_report(one_rank_step_failure_worker, 2, args=(str(tmp_path / "said"), where), backend="nccl", timeout=120)
    said = json.loads((tmp_path / "said.1").read_text())
    assert said[0] == "ok" and "ok" not in said[1:], said
    assert any("failed on 1 of the job's 2 ranks only" in s or "peer rank 0" in s for s in said[2:]), said


def test_nccl_ddp_drops_what_a_failed_backward_launched():
    for diffs in run_distributed(ddp_dropped_backward_worker, 2, backend="nccl", timeout=120):
        assert max(diffs) < 1e-4, diffs


def test_nccl_a_failure_in_the_first_call_names_the_rank(tmp_path):
    record = str(tmp_path / "said")
    check_first_call_failure_named(record, failure_report(first_call_failure_worker, 2, args=(record,),
                                                          backend="nccl", timeout=120), within=60)
