"""Session 40: a failure inside a pipeline's `evaluate()` no longer ends the pipeline."""

from __future__ import annotations

import os

import pytest
import torch

from distributed_training.testing import run_distributed


def _chain():
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(8, 8), nn.Tanh())), nn.Linear(8, 2))


class _Flaky(torch.utils.data.Dataset):
    """Samples of a fixed set; sample `bad` raises on global rank `rank` while armed."""

    def __init__(self, n: int, bad: int | None = None, rank: int = 0) -> None:
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 2, generator=g)
        self.bad, self.rank, self.armed = bad, rank, bad is not None

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        if self.armed and i == self.bad and int(os.environ.get("RANK", "0")) == self.rank:
            raise ValueError(f"sample {i} cannot be read")
        return self.x[i], self.y[i]


class _Criterion:
    """MSE that raises on its `fail_at`-th call while armed (the last stage's criterion)."""

    def __init__(self) -> None:
        self.armed, self.calls, self.fail_at = False, 0, 2

    def __call__(self, out, y):
        import torch.nn.functional as F

        self.calls += 1
        if self.armed and self.calls == self.fail_at:
            raise ValueError("the criterion failed")
        return F.mse_loss(out, y)


def eval_failure_worker(rank, world, pipeline, where, schedule, strategy="ddp"):
    import torch.nn.functional as F

    from distributed_training import DistributedTrainer

    net, ref = _chain(), _chain()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    trainer = DistributedTrainer(net, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), progress=False,
                                 strategy=strategy, pipeline_parallel_size=pipeline, pipeline_schedule=schedule, microbatches=4)
    dp, replica = trainer.dp_world_size, trainer.dp_rank
    g = torch.Generator().manual_seed(3)
    criterion = _Criterion()
    stage_of_failure = {"stage": 1, "criterion": pipeline - 1, "data": 0}[where]
    failing_stage = trainer.strategy._pipe_rank == stage_of_failure if pipeline > 1 else True
    layer = trainer.strategy.unwrap(trainer.model).stages[0] if where == "stage" else None
    data = _Flaky(24, bad=9 if where == "data" else None, rank=stage_of_failure)
    said, diffs = [], []

    def boom(module, args):
        raise ValueError("a stage failed in evaluate")

    for step in range(3):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
        n = 16 // dp
        trainer.train_step((x[replica * n:(replica + 1) * n], y[replica * n:(replica + 1) * n]), F.mse_loss)
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        state = trainer.full_state_dict()
        if state:
            diffs.append(max((state[k].cpu() - v).abs().max().item() for k, v in ref.state_dict().items()))
        if step == 0:  # an evaluation that fails on one stage, then training and evaluating on
            hook = layer.register_forward_pre_hook(boom) if where == "stage" and failing_stage else None
            criterion.armed = where == "criterion"
            try:
                trainer.evaluate(data, criterion, batch_size=4)
                said.append("passed")
            except Exception as err:  # noqa: BLE001 - every rank of the pipeline raises
                said.append(f"{type(err).__name__}: {err}")
            if hook is not None:
                hook.remove()
            criterion.armed = data.armed = False
    evaluated = trainer.evaluate(data, F.mse_loss, batch_size=4)["loss"]
    with torch.no_grad():
        expected = F.mse_loss(ref(data.x), data.y).item()
    trainer.close()
    return said, diffs, abs(evaluated - expected)


@pytest.mark.parametrize("world,pipeline,where,schedule", [
    (2, 2, "stage", "1f1b"), (2, 2, "criterion", "gpipe"), (2, 2, "data", "1f1b"),
    (4, 4, "stage", "1f1b"), (4, 4, "criterion", "interleaved_1f1b"), (4, 2, "criterion", "1f1b")])
def test_a_pipeline_evaluation_that_failed_leaves_the_pipeline_usable(world, pipeline, where, schedule):
    # The first ranks of an evaluation only send: a later stage's failure cut the pipeline's connections
    # (every later step or evaluation raised "cannot run another step", full_state_dict() too). Now every
    # rank listens for its peers' end or stop during an evaluation, every rank raises, and training and
    # evaluating go on as one process that never ran the failed evaluation.
    results = run_distributed(eval_failure_worker, world, args=(pipeline, where, schedule), timeout=150)
    for said, diffs, evaluated in results:
        assert len(said) == 1 and "passed" not in said[0], said
        assert evaluated < 1e-6, evaluated
    named = {"stage": "a stage failed in evaluate", "criterion": "the criterion failed",
             "data": "sample 9 cannot be read"}[where]
    assert any(named in said[0] for said, _, _ in results), [r[0] for r in results]
    _, diffs, _ = results[0]
    assert len(diffs) == 3 and max(diffs) < 1e-6, diffs
