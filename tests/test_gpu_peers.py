"""On 2 GPUs with NCCL, what sessions 31 and 33 built and checked only on gloo: a raising rank named by
the peer waiting for it in an NCCL collective (the watcher aborts the communicator), the replicas' per-step
agreement on rows over `Mesh.host_group`'s gloo group under accumulation with ZeRO-3 / FSDP, the
straggler probe (which drains the rank's GPU queue before its tiny all-reduce), and (session 36) a rank
whose data raises inside `fit`, named to the peer spinning in the step's or the batch agreement's collective."""

from __future__ import annotations

import pytest
import torch

from distributed_training.testing import run_distributed

from test_loss_weights import _replicas
from test_trial_s31 import raising_rank_worker
from test_trial_s33 import straggler_worker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_a_rank_whose_step_raises_is_named_by_its_peer_on_nccl(strategy):
    (kind, peer, error, said), (kind_1, _, _, said_1) = run_distributed(
        raising_rank_worker, 2, args=(strategy, 1), backend="nccl", timeout=180)
    assert kind_1 in ("ValueError", "RuntimeError") and "a label out of range" in said_1, said_1
    assert kind == "peer" and peer == 1 and "a label out of range on this rank" in error, said


@pytest.mark.parametrize("strategy, accumulation", [("zero3", 2), ("fsdp", 3)])
def test_replicas_of_uneven_rows_under_accumulation_on_nccl_equal_one_process(strategy, accumulation):
    """Rank 1 holds 1 row, rank 0 7: the replicas agree on the micro-batches over the gloo host group."""
    for worst in run_distributed(_replicas, 2, args=(strategy, False, accumulation, 1, "mse_one_row"),
                                 backend="nccl", timeout=180):
        assert worst <= 1e-5, worst


@pytest.mark.parametrize("where, strategy", [("data", "ddp"), ("forward", "ddp"), ("forward", "zero3"),
                                             ("forward", "tensor")])
def test_a_slow_rank_is_named_a_straggler_on_nccl(where, strategy, tmp_path):
    (said, slowest), (said_1, _) = run_distributed(straggler_worker, 2, args=(where, str(tmp_path), strategy),
                                                   backend="nccl", timeout=180)
    assert said and all("rank 1 works" in m for m in said) and slowest == 1, (said, slowest)
    assert not said_1


def test_balanced_ranks_on_nccl_name_no_straggler(tmp_path):
    """The probe's drain of the GPU queue is the rank's own work: balanced ranks stay unflagged."""
    (said, _), (said_1, _) = run_distributed(straggler_worker, 2, args=("on_step", str(tmp_path)),
                                             backend="nccl", timeout=180)
    assert not said and not said_1, (said, said_1)


def test_a_peer_dead_after_the_loop_is_named_on_nccl_and_close_does_not_raise_it_again(tmp_path):
    """save_checkpoint names the dead peer (NCCL: it would wait for the collective timeout), the calls after
    it raise the same at once, and close() does not raise the failure the script already caught."""
    import json

    from distributed_training.testing import DistributedTestError

    from test_trial_s34 import dead_peer_after_training_worker

    with pytest.raises(DistributedTestError) as caught:  # rank 1's os._exit(1)
        run_distributed(dead_peer_after_training_worker, 2, args=(str(tmp_path),), backend="nccl", timeout=180,
                        grace=90)
    assert "rank 1 failed" in str(caught.value) and "rank 0" not in str(caught.value), caught.value
    for name, text in json.loads((tmp_path / "said.json").read_text()).items():
        assert text.startswith("peer 1: "), (name, text)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_close_gives_the_model_its_trained_weights_back_on_nccl(strategy):
    from test_trial_s34 import given_back_worker

    assert run_distributed(given_back_worker, 2, args=(strategy,), backend="nccl", timeout=180)[0] == (
        True, [False, False, True, True], (3, 2))


@pytest.mark.parametrize("strategy, sequence_parallel", [("ddp", False), ("zero3", True)])
def test_close_gives_a_tensor_parallel_model_back_whole_on_nccl(strategy, sequence_parallel):
    """(Session 45) Under tensor parallelism a clean close put the model's own modules back, whole (the
    parts all-gathered over NCCL, checked against the free GPU memory first)."""
    from test_trial_s45 import tensor_close_worker

    for same_keys, worst, logits, kinds, tied, sizes in run_distributed(
            tensor_close_worker, 2, args=(strategy, sequence_parallel), backend="nccl", timeout=180):
        assert same_keys and worst == 0.0 and logits == 0.0, (worst, logits)
        assert kinds == [] and tied and sizes, (kinds, tied, sizes)


def test_nccl_a_rank_whose_data_raises_is_named_to_the_others():
    # On NCCL the peers' collectives spin: the published error must wake them (the group aborted), not the
    # collective timeout (60 s here).
    from test_trial_s36 import data_fails_worker

    for sharded, fail_after in ((True, 12), (False, 0)):
        (said0, seconds0), (said1, _) = run_distributed(data_fails_worker, 2, args=(sharded, fail_after, None),
                                                        backend="nccl", timeout=180)
        assert said1.startswith("own: corrupt sample"), said1
        assert said0.startswith("peer 1:") and "OSError: corrupt sample" in said0 and seconds0 < 30, (said0, seconds0)
