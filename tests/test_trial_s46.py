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


def test_a_rank_slow_in_every_other_window_is_warned_of(tmp_path):
    """The warning waited for the same rank flagged in two windows in a row: a rank slow only in every
    other log window (flagged, not, flagged, ...) was never warned of (session 45's "Left")."""
    from distributed_training.monitor import Monitor

    with Monitor(tmp_path / "run", rank=0, world_size=1, log_every=1, progress=False, tensorboard=False,
                 system_stats=False) as mon:
        mon._group_ranks = [0, 1]
        own = [(0.004, 0.020), (0.004, 0.004), (0.004, 0.021)]  # rank 1 slow, then not, then slow again
        flagged = [mon._cluster_view(window, [0.03, a, 0.03, b])["cluster/straggler"]
                   for window, (a, b) in enumerate(own)]
        assert flagged == [1.0, 0.0, 1.0]
        assert len(mon._warnings) == 1, mon._warnings
        assert mon._warnings[0].startswith("straggler at step 2: rank 1 works"), mon._warnings
        assert mon._warnings[0].endswith("as in two log windows before"), mon._warnings
        mon._warnings.clear()
