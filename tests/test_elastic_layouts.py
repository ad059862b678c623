"""Resize on restart for every layout (issue 17, item 1): a job trains a global batch with checkpoints,
stops mid-epoch, and is resumed at another world that keeps its layout (ZeRO-1, ZeRO-2, FSDP hybrid
sharding, a pipeline, tensor parallelism; shrinking from 4 ranks, and growing from 2 to 4). After every
optimizer step the whole model (`full_state_dict`, gathered from every rank's pieces) equals one process
trained by a plain loop on the same global batches within 1e-5, and each sample of the epoch is trained
exactly once over the two jobs: the targets carry each sample's index, which the criterion records (on
the ranks that compute the loss: a pipeline's last stage; one rank of each tensor-parallel group).

A world that cannot keep the layout (world 3 under pipeline_parallel_size=2 or tensor_parallel_size=2,
world 2 under both, nodes of 2 ranks for hybrid sharding at world 3) fails at start-up, before any
checkpoint is read, on every rank, with one error naming the constraint and the world sizes that keep it.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from distributed_training import DistributedTrainer
from distributed_training.global_batch import plan_global_batch, valid_world_sizes
from distributed_training.strategies.fsdp_strategy import FSDPStrategy
from distributed_training.testing import run_distributed

N, B, SEED, LR, MOMENTUM = 48, 12, 7, 0.1, 0.9
STOP = 2  # of the epoch's 4 steps: the first job stops mid-epoch
STEPS = N // B


class Indexed(Dataset):
    """(x, [y, index]) pairs: the target's last column is the sample's index, for counting."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(N, 4, generator=g)
        self.y = torch.randn(N, 2, generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        return self.x[i], torch.cat([self.y[i], torch.tensor([float(i)])])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


PLAN = {"0": "colwise", "2": "rowwise"}  # the MLP's first two matrices split; the head replicated

# Layout name -> the trainer's keyword arguments. Hybrid sharding takes nodes of 2 ranks (as torchrun's
# --nproc-per-node=2 would make them; run_distributed puts every rank on one node).
LAYOUTS = {
    "zero1": dict(strategy="zero1"),
    "zero2": dict(strategy="zero2"),
    "hybrid": dict(strategy="hybrid"),
    "pp2": dict(strategy="ddp", pipeline_parallel_size=2, microbatches=2),
    "pp2-zero3": dict(strategy="zero3", pipeline_parallel_size=2, microbatches=2),
    "tp2": dict(strategy="ddp", tensor_parallel_size=2, tensor_parallel_plan=PLAN),
    "tp2-zero1": dict(strategy="zero1", tensor_parallel_size=2, tensor_parallel_plan=PLAN),
    "tp2xpp2": dict(strategy="ddp", tensor_parallel_size=2, tensor_parallel_plan=PLAN, pipeline_parallel_size=2,
                    microbatches=2),
}


def _trainer(layout: str, directory: str | None) -> DistributedTrainer:
    kwargs = dict(LAYOUTS[layout])
    strategy = kwargs.pop("strategy")
    if strategy == "hybrid":
        strategy = FSDPStrategy(sharding_strategy="hybrid", ranks_per_node=2)
    if "pipeline_parallel_size" not in kwargs:
        # The first start's share in 2 micro-batches: a resumed job keeps that micro-batch and accumulates
        # as many as its new share needs (a pipeline cuts the share in its microbatches instead).
        kwargs["gradient_accumulation_steps"] = 2
    extra = dict(checkpoint_dir=directory, checkpoint_every=1) if directory is not None else {}
    return DistributedTrainer(_model(), lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM), strategy,
                              seed=SEED, progress=False, **kwargs, **extra)


def _train(rank, world, layout, directory, max_steps):
    """Train (resuming from `directory`); return (per step: (indices this rank's loss saw, the full
    model on rank 0)), whether this rank counts its replica's samples, and the global batch's cut."""
    seen: list[int] = []

    def criterion(out, target):
        seen.extend(int(i) for i in target[:, -1].tolist())
        return F.mse_loss(out, target[:, :-1])

    trainer = _trainer(layout, directory)
    mesh = trainer.context.mesh
    counts = mesh.rank("tensor") == 0 and mesh.rank("pipeline") == mesh.size("pipeline") - 1
    steps = {}

    def on_step(step, metrics):
        steps[step] = (list(seen), trainer.full_state_dict())  # collective: every rank, every step
        seen.clear()

    trainer.fit(Indexed(), epochs=1, criterion=criterion, global_batch_size=B, max_steps=max_steps, log_every=1,
                on_step=on_step)
    plan = trainer.global_batch
    replicas = getattr(trainer.model, "replicate_world", None)  # FSDP: replicas of the shards (hybrid: nodes)
    trainer.close()
    return steps, counts, (plan.dp_size, plan.per_rank), replicas


def _reference():
    """One process, a plain loop: step s trains positions [s B, (s + 1) B) of the epoch's permutation."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    data = Indexed()
    order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED)).tolist()
    out = {}
    for step in range(1, STEPS + 1):
        idx = order[(step - 1) * B:step * B]
        loss = F.mse_loss(model(data.x[idx]), data.y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        out[step] = (sorted(idx), {k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def _check(job, expected, steps, where):
    for step in steps:
        indices = sorted(i for trained, counts, *_ in job if counts for i in trained[step][0])
        assert indices == expected[step][0], f"{where}, step {step}: trained {indices}, expected {expected[step][0]}"
        got, want = job[0][0][step][1], expected[step][1]
        assert list(got) == list(want), f"{where}: keys {list(got)}"
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{where}, step {step}, {key}: {m}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout, start, worlds", [
    ("zero1", 4, (2, 3)),
    ("zero2", 4, (2, 3)),
    ("hybrid", 4, (2,)),  # 2 nodes x 2 -> one node of 2
    ("pp2", 4, (2,)),  # PP2 x DP2 -> PP2
    ("pp2-zero3", 2, (4,)),  # PP2 -> PP2 x DP2: the job grows
    ("tp2", 4, (2,)),  # TP2 x DP2 -> TP2
    ("tp2-zero1", 2, (4,)),  # TP2 -> TP2 x DP2
])
def test_a_layout_resumed_at_another_world_trains_as_one_process(tmp_path, layout, start, worlds):
    expected = _reference()
    per_replica = LAYOUTS[layout].get("pipeline_parallel_size", 1) * LAYOUTS[layout].get("tensor_parallel_size", 1)
    first = run_distributed(_train, start, args=(layout, str(tmp_path / "first"), STOP), timeout=120)
    # (data-parallel replicas, samples each)
    assert [r[2] for r in first] == [(start // per_replica, B * per_replica // start)] * start
    assert sorted(first[0][0]) == list(range(1, STOP + 1))
    if layout == "hybrid":
        assert [r[3] for r in first] == [2] * 4  # 2 nodes of 2: shards over a node, replicated over the 2
    _check(first, expected, range(1, STOP + 1), f"{layout} at world {start}")
    for world in worlds:
        directory = tmp_path / f"w{world}"
        shutil.copytree(tmp_path / "first", directory)
        resumed = run_distributed(_train, world, args=(layout, str(directory), None), timeout=120)
        assert [r[2] for r in resumed] == [(world // per_replica, B * per_replica // world)] * world
        assert sorted(resumed[0][0]) == list(range(STOP + 1, STEPS + 1))
        if layout == "hybrid":
            assert [r[3] for r in resumed] == [1] * world  # one node: sharded over it, no replica
        _check(resumed, expected, range(STOP + 1, STEPS + 1), f"{layout} resumed at world {world} from {start}")
        counts = [0] * N  # the epoch's samples exactly once over both jobs
        for job in (first, resumed):
            for trained, counted, *_ in job:
                if counted:
                    for indices, _ in trained.values():
                        for i in indices:
                            counts[i] += 1
        assert counts == [1] * N, f"{layout} at world {world}: samples trained {counts}"


# ------------------------------------------------------------------ worlds that cannot keep the layout
def _refused(rank, world, layout, directory):
    """The error of building the trainer (None: built); fit, which resumes, is never reached then."""
    try:
        trainer = _trainer(layout, directory)
    except ValueError as err:
        return str(err)
    trainer.close()
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout, world, needs", [
    ("pp2", 3, ["world size 3 cannot keep pipeline_parallel_size=2 x tensor_parallel_size=1",
                "a multiple of 2 (2, 4, 6, 8, ...)", "world / 2", "global_batch_size"]),
    ("tp2", 3, ["world size 3 cannot keep pipeline_parallel_size=1 x tensor_parallel_size=2",
                "a multiple of 2 (2, 4, 6, 8, ...)"]),
    ("tp2xpp2", 2, ["world size 2 cannot keep pipeline_parallel_size=2 x tensor_parallel_size=2",
                    "a multiple of 4 (4, 8, 12, 16, ...)"]),
    ("hybrid", 3, ["ranks_per_node=2 must divide the world size 3", "multiples of 2 (2, 4, 6, 8, ...)"]),
])
def test_a_world_that_cannot_keep_the_layout_is_refused_on_every_rank(tmp_path, layout, world, needs):
    # The trainer's constructor refuses: before fit, so before any checkpoint is read.
    messages = run_distributed(_refused, world, args=(layout, str(tmp_path / "ckpt")), timeout=90)
    assert len(messages) == world
    for message in messages:
        assert message is not None, f"{layout} was built at world {world}"
        for part in needs:
            assert part in message, message


def test_valid_world_sizes():
    # Where the layout fits but the global batch does not: fit names the world sizes of both.
    with pytest.raises(ValueError, match=r"over 3 data-parallel replicas: .* are 1, 2, 4, 8 \(world sizes 2, 4, 8, 16 "
                                         r"at 2 ranks a replica\)"):
        plan_global_batch(8, 3, others=2)
    assert valid_world_sizes(ranks_per_replica=2, up_to=8) == [2, 4, 6, 8]
    assert valid_world_sizes(12, ranks_per_replica=2, up_to=16) == [2, 4, 6, 8, 12]
    assert valid_world_sizes(12, ranks_per_replica=4) == [4, 8, 12, 16, 24, 48]
