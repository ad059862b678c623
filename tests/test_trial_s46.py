"""Defects found in session 46 (earlier trials' "Left" lists), each test failing on the code before its fix."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from distributed_training import DistributedTrainer
from distributed_training.testing import run_distributed


def split_output_worker(rank, world):
    said = {}
    for plan in ({"0": "colwise"}, {"0": "vocab"}):  # a 'colwise' with no 'rowwise' after it; 'vocab' mid-model
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), tensor_parallel_size=2,
                                     tensor_parallel_plan=plan, progress=False)
        batch = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
        try:
            trainer.train_step(batch, F.cross_entropy)
            said[plan["0"]] = "trained"
        except RuntimeError as err:
            said[plan["0"]] = str(err)
        try:
            trainer.evaluate(TensorDataset(*batch), F.cross_entropy, batch_size=4)
            said[plan["0"] + " evaluate"] = "evaluated"
        except RuntimeError as err:
            said[plan["0"] + " evaluate"] = str(err)
        trainer.close()
    return said


def test_a_split_output_fed_to_an_unsplit_layer_names_the_layer_and_the_plan():
    """A plan whose 'colwise' layer has no 'rowwise' after it, or whose 'vocab' layer is not the output
    head, hands the next layer half its features: the error was torch's "mat1 and mat2 shapes cannot be
    multiplied (4x8 and 16x4)" alone (session 45's trial)."""
    for said in run_distributed(split_output_worker, 2, timeout=120):
        for key, style in (("colwise", "colwise"), ("vocab", "vocab"), ("colwise evaluate", "colwise")):
            assert "cannot be multiplied" in said[key], said
            assert f"the last split layer to run before this error was 0 ({style!r})" in said[key], said
            assert "a 'colwise' layer must feed a 'rowwise' one" in said[key], said
