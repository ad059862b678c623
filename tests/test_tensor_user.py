"""Tensor parallelism as a new user meets it: defects found by trying the documented API on models the
tests did not build for it (Hugging Face GPT-2 and Llama, timm's ViT), each pinned here against one
process or by the error it must raise.

* `evaluate(metrics=...)` under a head split by vocabulary: each metric reads the whole vocabulary's
  logits (an argmax over this rank's columns alone gave every tensor rank another accuracy);
* a projection whose split cuts through a head: the attention's `head_dim` is checked, so models that
  keep their head counts in a config (Hugging Face's Llama with grouped key/value heads) get the plan's
  error instead of a reshape error in the first forward;
* resuming a tensor-parallel checkpoint without tensor parallelism reports the change;
* a sequence that T does not divide under sequence parallelism: the error names `sequence_parallel`.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from distributed_training import DistributedTrainer
from distributed_training.models import GPT, GPTConfig
from distributed_training.tensor import apply_plan
from distributed_training.testing import run_distributed


def _classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 10))


def _classes() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(37, 20, generator=g), torch.randint(0, 10, (37,), generator=g))


def _accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(-1) == targets).float().mean()


def _top_logit(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return outputs.max(-1).values.mean()


def evaluate_metrics_worker(rank, world, strategy):
    base = _classifier()
    x, y = _classes().tensors
    with torch.no_grad():
        logits = base(x)
        want = {"loss": F.cross_entropy(logits, y).item(), "accuracy": _accuracy(logits, y).item(),
                "top": _top_logit(logits, y).item()}
    trainer = DistributedTrainer(copy.deepcopy(base), lambda ps: torch.optim.SGD(ps, lr=0.1), strategy=strategy,
                                 tensor_parallel_size=2, tensor_parallel_plan={"2": "vocab"}, progress=False)
    got = trainer.evaluate(_classes(), F.cross_entropy, batch_size=8, metrics={"accuracy": _accuracy, "top": _top_logit})
    plain = trainer.evaluate(_classes(), F.cross_entropy, batch_size=8)
    trainer.close()
    return want, got, plain


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_evaluate_metrics_read_the_whole_vocabulary(strategy):
    """TP = 2 x DP = 2 (uneven shards: 37 samples): metrics equal one process's, on every rank."""
    results = run_distributed(evaluate_metrics_worker, 4, args=(strategy,), timeout=120)
    for rank, (want, got, plain) in enumerate(results):
        for name, value in want.items():
            assert abs(got[name] - value) <= 1e-5, (rank, name, got, want)
        assert abs(plain["loss"] - want["loss"]) <= 1e-5, (rank, plain, want)


class _GroupedAttention(nn.Module):
    """Hugging Face Llama's layout: no head-count attribute (they live in its config), `head_dim`,
    4 query heads sharing 1 key/value head (16 wide each)."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = 16
        self.q_proj = nn.Linear(64, 64, bias=False)
        self.k_proj = nn.Linear(64, 16, bias=False)
        self.v_proj = nn.Linear(64, 16, bias=False)
        self.o_proj = nn.Linear(64, 64, bias=False)


def head_dim_worker(rank, world):
    errors = {}
    for name, plan in (("kv", {"0.[qkv]_proj": "colwise", "0.o_proj": "rowwise"}),
                       ("o", {"0.o_proj": "rowwise"})):
        model = nn.Sequential(_GroupedAttention())
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            apply_plan(model, plan, dist.group.WORLD)
            errors[name] = None
        except ValueError as err:
            errors[name] = str(err)
            after = model.state_dict()
            assert all(torch.equal(before[k], after[k]) for k in before), "a failed plan changed the model"
    return errors


def test_a_split_through_a_head_names_head_dim():
    for errors in run_distributed(head_dim_worker, 2, timeout=60):
        assert errors["kv"] is not None, "key/value heads of 16 split in halves of 8: no error"
        for word in ("0.k_proj", "head_dim=16", "T=2", "16"):
            assert word in errors["kv"], errors["kv"]
        assert errors["o"] is None, errors["o"]  # o_proj's 64 inputs: 2 heads a rank, fine


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=32, dropout=0.0))


def save_tp_worker(rank, world, directory):
    trainer = DistributedTrainer(_gpt(), lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="ddp",
                                 tensor_parallel_size=2, sequence_parallel=True, progress=False)
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(1))
    trainer.train_step((tokens[:, :-1], tokens[:, 1:]))
    trainer.save_checkpoint(directory)
    trainer.close()


def load_plain_worker(rank, world, directory):
    from distributed_training.logs import get_logger

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    get_logger().addHandler(handler)
    try:
        trainer = DistributedTrainer(_gpt(), lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="ddp", progress=False)
        trainer.load_checkpoint(directory)
        trainer.close()
    finally:
        get_logger().removeHandler(handler)
    return seen


def test_resuming_without_tensor_parallelism_says_so(tmp_path):
    directory = str(tmp_path / "ckpt")
    run_distributed(save_tp_worker, 2, args=(directory,), timeout=120)
    seen = "\n".join(run_distributed(load_plain_worker, 2, args=(directory,), timeout=120)[0])
    assert "the configuration changed" in seen, seen
    assert "tensor_parallel_size: 2 -> 1" in seen and "sequence_parallel: True -> False" in seen, seen


def odd_sequence_worker(rank, world):
    trainer = DistributedTrainer(_gpt(), lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="ddp",
                                 tensor_parallel_size=2, sequence_parallel=True, progress=False)
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))  # 7 tokens
    try:
        trainer.train_step((tokens[:, :-1], tokens[:, 1:]))
    except ValueError as err:
        return str(err)
    finally:
        trainer.close()
    return None


def test_a_sequence_that_does_not_split_names_sequence_parallel():
    """Raised by every tensor rank in the first forward (nobody waits in a collective)."""
    for message in run_distributed(odd_sequence_worker, 2, timeout=60):
        assert message is not None, "7 tokens split between 2 ranks: no error"
        for word in ("sequence length 7", "T=2", "sequence_parallel"):
            assert word in message, message


def no_sequence_start_worker(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.LayerNorm(16))
    try:
        DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), tensor_parallel_size=2,
                           tensor_parallel_plan={"0": "colwise", "2": "rowwise", "3": "sequence"},
                           sequence_parallel=True, progress=False)
    except ValueError as err:
        return str(err)
    return None


def test_sequence_parallel_without_a_sequence_split_module_is_an_error():
    """Nothing split the input: every tensor rank trained on the whole sequence, which the colwise layers
    gathered again (T copies of it), and the parameters left one process's from the first step (0.015
    after 3 SGD steps on a (4, 6, 16) batch) without an error; on a 2-D input the first forward failed in a
    matmul (``mat1 and mat2 shapes cannot be multiplied (4x32 and 16x16)``)."""
    for message in run_distributed(no_sequence_start_worker, 2, timeout=60):
        assert message is not None, "sequence_parallel=True with no 'sequence_split' module: no error"
        for word in ("sequence_parallel=True", "'sequence_split'", "tensor_parallel_plan", "Sequential"):
            assert word in message, message
